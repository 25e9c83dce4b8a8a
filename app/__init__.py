"""imagenet-dp: data-parallel ResNet training on ImageNet-format datasets.

From Python (a REPL or a notebook at the repository root):

    import torch, torchvision
    import app

    catalog = app.open_catalog()                  # ./datasets.toml, or a path to another
    data = catalog.dataset("sample")              # any entry: imagenet_local, imagenet_s3, ...
    train_set = data.solutions("LOC_train_solution.csv", classes=range(10))
    val_set = data.solutions("LOC_val_solution.csv", classes=range(10))
    model = torchvision.models.resnet18(num_classes=10)     # any nn.Module
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    setup = app.prepare_training(model, train_set, devices=["cpu", "cpu"], optimizer=opt,
                                 batch_size=32, epochs=2, image_size=64)
    history = app.train(setup, loss=torch.nn.CrossEntropyLoss(), val=val_set, schedule=None)

The verbs:
    open_catalog(path)          the dataset catalog: .dataset(name) -> .solutions(table,
                                classes=...) or .split("train" | "val", classes=...)
    prepare_training(model, train_set, devices, optimizer, batch_size, epochs, image_size,
                     parallel="threads" | "processes", config="configs/x.toml", **knobs)
    train(setup, loss, val, schedule, logger, resume) -> pandas DataFrame, one row per epoch
    logging_to(logger)          a `with` block: every train inside logs to `logger`
    loggers                     Console(), Notebook(), Jsonl(path), TensorBoard(), Wandb(...)

Replicas are threads of this process by default (one per device; nothing is pickled, so a
model or loss defined in a notebook trains), or the driver's worker processes. Mistakes raise
app.UserError with the driver's one-line message. help(app.prepare_training) and
help(app.train) say more; docs/python-api.md has the whole story. The driver:
python bin/driver.py --help.

Nothing heavy is imported until a verb is used: importing any app.* module runs this file,
and DALI's reader processes must stay free of torch.
"""

import importlib

# name -> the module that defines it, imported on first use (PEP 562)
_VERBS = {
    "open_catalog": "app.launch.python_api",
    "prepare_training": "app.launch.python_api",
    "train": "app.launch.python_api",
    "TrainingSetup": "app.launch.python_api",
    "logging_to": "app.loggers",
    "loggers": "app.loggers",
    "UserError": "app.runtime.errors",
}
__all__ = list(_VERBS)


def __getattr__(name: str):
    if name not in _VERBS:
        raise AttributeError(f"module 'app' has no attribute {name!r}")
    module = importlib.import_module(_VERBS[name])
    return module if module.__name__ == f"app.{name}" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_VERBS))
