"""The Python API (app.prepare_training, app.train) on CPU: replicas in threads and in
processes compute what one replica with the whole batch does; an interrupt saves, returns and
resumes exactly; a failing replica stops the others; bad arguments are one line each, before
any thread starts."""

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

import app
from app.runtime.errors import UserError
from app.training import checkpoint
from app.training.user_parts import UserParts
from conftest import REPO

TABLE = "LOC_train_solution.csv"  # 141 images of the tiny sample: a short last step


class TinyNet(nn.Module):
    """GroupNorm, independent of how a batch is split across replicas."""

    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(2, 2 * width),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images):
        return self.head(self.features(images))


@pytest.fixture(scope="module")
def tiny(sample_cache):
    return app.open_catalog(REPO / "datasets.toml").dataset("sample_tiny")


def setup_of(tiny, tmp_path, devices, batch_size, name, parallel="threads", **knobs):
    torch.manual_seed(0)  # the same initial weights for every run
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return app.prepare_training(model, tiny.solutions(TABLE), devices=devices,
                                optimizer=optimizer, batch_size=batch_size, image_size=32,
                                parallel=parallel, workers=0, output_dir=str(tmp_path),
                                run_name=name, **knobs)


def relative_difference(a: dict, b: dict) -> float:
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in a)
    return float((num / sum((a[k].double() ** 2).sum() for k in a)).sqrt())


EXACT = {"epochs": 1, "dtype": "float64", "check_every": 1, "print_freq": 100}


def test_threads_and_processes_match_one_replica_with_twice_the_batch(tiny, tmp_path, caplog):
    """As tests/test_parallel.py's driver test: 2 x 5 images per step compute what 1 x 10
    does (--check-every 1: the replicas were compared after every step). The first run also
    takes a config file whose optimizer, loss and schedule keys your own objects replace:
    they are named once, and not used."""
    runs = {}
    resnet50 = str(REPO / "configs" / "resnet50.toml")
    for name, devices, batch, parallel, config in [
            ("one", ["cpu"], 10, "threads", resnet50),
            ("threads", ["cpu", "cpu"], 5, "threads", ""),
            ("processes", ["cpu", "cpu"], 5, "processes", "")]:
        setup = setup_of(tiny, tmp_path, devices, batch, name, parallel, config=config, **EXACT)
        history = app.train(setup, loss=nn.CrossEntropyLoss(), logger=[])
        assert list(history.epoch) == [1]
        assert checkpoint.load(setup.run_dir / "checkpoints" / "last.pt")["step"] == 15
        runs[name] = {k: v.clone() for k, v in setup.model.state_dict().items()}
    [ignored] = [m for m in caplog.messages if m.startswith("ignored from")]
    assert ignored == (
        f"ignored from {resnet50}: your model replaces arch = 'resnet50'; your train_set "
        "replaces dataset = 'imagenet_local'; your optimizer replaces optimizer = 'sgd', "
        "lr = 0.1, momentum = 0.9, nesterov = False, weight_decay = 0.0001; your loss replaces "
        "label_smoothing = 0.1; your schedule replaces schedule = 'cosine', warmup_epochs = 5")
    assert "label_smoothing = 0.1" not in (tmp_path / "one" / "config.toml").read_text()
    assert runs["one"]["head.weight"].dtype == torch.float32  # the caller's model, as it was
    assert relative_difference(runs["one"], runs["threads"]) < 1e-9
    assert relative_difference(runs["one"], runs["processes"]) < 1e-9
    # the same averaging code in the same order: threads and processes agree bit for bit
    assert all(torch.equal(runs["threads"][k], runs["processes"][k]) for k in runs["one"])
    torch.manual_seed(0)
    assert relative_difference(runs["one"], TinyNet().state_dict()) > 1e-2  # it trained


def slow_loss(logits, targets):
    """Steps at a real model's pace rather than as fast as a tiny one can."""
    time.sleep(0.02)
    return nn.functional.cross_entropy(logits, targets)


class Announcements(io.TextIOBase):
    """sys.stderr as it was, plus an event set when the caller's thread announces that it
    took the interrupt ("SIGINT: saving a checkpoint of the step under way")."""

    def __init__(self, stream):
        self.stream, self.taken = stream, threading.Event()

    def write(self, text: str) -> int:
        if "saving a checkpoint of the step under way" in text:
            self.taken.set()
        return self.stream.write(text)


def interrupting_loss(at_call: int, announcements: Announcements):
    """Presses Ctrl-C (SIGINT to this process, as a notebook's Stop button does) during
    replica 0's `at_call`-th step, and holds that step until the caller's thread has taken the
    interrupt: where the run stops does not depend on how busy the machine is."""
    calls = []

    def loss(logits, targets):
        if threading.current_thread().name == "replica 0 (cpu)":
            calls.append(1)
            if len(calls) == at_call:
                os.kill(os.getpid(), signal.SIGINT)
                assert announcements.taken.wait(timeout=120), "the interrupt was not taken"
        return slow_loss(logits, targets)
    return loss


def decaying(optimizer, steps=60):
    """optimizer -> scheduler, with a parameter that has a default (not a factor(epoch, step))."""
    return torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=steps)


def test_an_interrupt_saves_returns_and_resumes_exactly(tiny, tmp_path, monkeypatch):
    """The LR decays over the run (a scheduler of the caller's), and resumes with it."""
    before = set(threading.enumerate())
    flags = {"epochs": 2, "print_freq": 1}
    straight = setup_of(tiny, tmp_path, ["cpu", "cpu"], 5, "straight", **flags)
    history = app.train(straight, loss=slow_loss, logger=[], schedule=decaying)
    assert len(history) == 2 and history.lr.iloc[-1] < 0.15  # from 0.2 towards 0.1 at step 30

    stopped = setup_of(tiny, tmp_path, ["cpu", "cpu"], 5, "stopped", **flags)
    announcements = Announcements(sys.stderr)
    monkeypatch.setattr(sys, "stderr", announcements)
    history = app.train(stopped, loss=interrupting_loss(18, announcements), logger=[],
                        schedule=decaying)
    monkeypatch.undo()
    assert set(threading.enumerate()) == before  # every replica and the server thread ended
    assert list(history.epoch) == [1]  # the history so far
    saved = checkpoint.load(stopped.run_dir / "checkpoints" / "last.pt")
    # replica 0 was held inside step 18 (the 3rd of epoch 2) until the stop was asked
    assert saved["epoch"] == 1 and 18 <= saved["step"] <= 19
    with pytest.raises(UserError, match="resume=True"):
        app.train(stopped, loss=slow_loss, logger=[], schedule=decaying)

    history = app.train(stopped, loss=slow_loss, logger=[], resume=True, schedule=decaying)
    assert list(history.epoch) == [1, 2]
    for key, value in straight.model.state_dict().items():
        assert torch.equal(value, stopped.model.state_dict()[key]), key
    assert set(threading.enumerate()) == before


def failing_loss_in(thread_name: str, at_call: int):
    calls = []

    def loss(logits, targets):
        if threading.current_thread().name == thread_name:
            calls.append(1)
            if len(calls) == at_call:
                raise RuntimeError("the loss broke")
        return nn.functional.cross_entropy(logits, targets)
    return loss


def test_a_replica_that_raises_stops_the_others_and_raises_in_the_caller(tiny, tmp_path):
    before = set(threading.enumerate())
    setup = setup_of(tiny, tmp_path, ["cpu", "cpu"], 5, "broken", epochs=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the loss broke") as raised:
        app.train(setup, loss=failing_loss_in("replica 1 (cpu)", 3), logger=[])
    assert time.monotonic() - started < 30
    assert any("replica 1 (cpu)" in note for note in raised.value.__notes__)
    assert set(threading.enumerate()) == before


def other_model_optimizer(model):
    return torch.optim.SGD(TinyNet().parameters(), lr=0.1)


def factory(build):
    """What the test passes as optimizer=: a function parameters -> `build(parameters)`."""
    return lambda model: (lambda parameters: build(parameters))


NO_RESTARTS = ("max_restarts= is not a knob here; app.train raises a replica's error in your "
               "thread: continue with app.train(setup, ..., resume=True)")


@pytest.mark.parametrize("change, message", [
    ({"devices": ["cpu", "cuda:7"]}, "devices=['cpu', 'cuda:7']: device cuda:7 not available"),
    ({"devices": ["tpu"]}, "devices=['tpu']: unknown device 'tpu'; use cpu, cuda or cuda:N"),
    pytest.param({"devices": 2}, "devices=2: this machine has no CUDA GPU; for replicas on the "
                 "CPU pass devices=['cpu', 'cpu'], or \"all\"",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
    ({"optimizer": other_model_optimizer}, "optimizer: built on parameters that are not the "
                                           "model's"),
    ({"optimizer": factory(lambda parameters: torch.optim.SGD(TinyNet().parameters(), lr=0.1))},
     "optimizer: built on parameters that are not the model's"),
    ({"optimizer": factory(list)}, "optimizer: your function returned list, not a "
                                   "torch.optim.Optimizer"),
    ({"lr": 0.3, "momentum": 0}, "prepare_training: lr=, momentum= shape(s) the config's "
                                 "optimizer, but you pass your own optimizer=: set it there, or "
                                 "pass optimizer=None"),
    ({"compile": "on"}, "compile='on': torch.compile is not thread-safe, so threads train "
                        "eagerly; use parallel='processes' to compile"),
    ({"sync": "allreduce"}, "sync='allreduce' needs a process per replica (torch.distributed); "
                            "threads average through the parameter server: drop sync= or use "
                            "parallel='processes'"),
    ({"max_restarts": 1}, NO_RESTARTS),
    ({"max_restarts": 1, "parallel": "processes"}, NO_RESTARTS),
    ({"model": lambda: TinyNet(classes=1000)}, "model: its output for one image has shape "
                                               "(1, 1000), but the train set has 10 classes"),
    ({"lable_smoothing": 0.1}, "unknown keyword lable_smoothing=; did you mean "
                               "label_smoothing=?"),
    ({"label_smoothing": 2}, "label_smoothing must be in"),
    ({"arch": "resnet50"}, "arch= is not a knob here; the API trains the model you pass"),
])
def test_bad_arguments_are_one_line_before_any_thread_starts(tiny, change, message):
    before = set(threading.enumerate())
    model = change.pop("model", TinyNet)()
    optimizer = change.pop("optimizer", lambda m: torch.optim.SGD(m.parameters(), lr=0.1))(model)
    arguments = {"devices": ["cpu", "cpu"], "optimizer": optimizer, "image_size": 32, **change}
    with pytest.raises(UserError, match=re.escape(message)) as raised:
        app.prepare_training(model, tiny.solutions(TABLE), **arguments)
    assert "\n" not in str(raised.value)
    assert set(threading.enumerate()) == before


@pytest.mark.parametrize("loss, parallel, knobs, message", [
    (nn.CrossEntropyLoss(reduction="none"), "threads", {}, "loss: returned (2,) for a batch of "
                                                           "2, not a scalar tensor"),
    (lambda logits, targets: logits.sum(), "processes", {}, "loss: does not pickle"),
    (nn.CrossEntropyLoss(), "threads", {"label_smoothing": 0.1},
     "prepare_training: label_smoothing= shape(s) the config's loss, but you pass your own "
     "loss=: build it into yours, or pass loss=None"),
    (nn.CrossEntropyLoss(), "threads", {"warmup_epochs": 1, "lr_min": 0.01},  # schedule=None
     "prepare_training: warmup_epochs=, lr_min= shape(s) the config's schedule, but you "
     "pass your own schedule=: pass schedule=\"cosine\""),
])
def test_a_bad_loss_is_refused_before_any_replica_starts(tiny, tmp_path, loss, parallel, knobs,
                                                         message):
    before = set(threading.enumerate())
    setup = setup_of(tiny, tmp_path, ["cpu", "cpu"], 5, "bad", parallel, **knobs)
    with pytest.raises(UserError, match=re.escape(message)):
        app.train(setup, loss=loss, logger=[])
    assert set(threading.enumerate()) == before
    assert not (setup.run_dir / "checkpoints").exists()


@pytest.mark.parametrize("schedule, factors", [
    (None, [1, 1, 1, 1]),  # constant
    (lambda epoch, step: 0.5 ** epoch + step / 100, [1, 1.01, 0.5, 0.51]),  # 2 steps an epoch
    (torch.optim.lr_scheduler.LinearLR, [1 / 3, 7 / 15, 3 / 5, 11 / 15]),  # its defaults
    (torch.optim.lr_scheduler.PolynomialLR, [1, 0.8, 0.6, 0.4]),
    (lambda optimizer, n=4: torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=n),
     [1, 0.75, 0.5, 0.25]),
])
def test_a_schedule_is_constant_a_factor_or_an_optimizer_to_scheduler_function(schedule,
                                                                               factors):
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = UserParts(model, schedule=schedule).scheduler(optimizer, None, 2)
    lrs = []
    for _ in factors:
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.2 * factor for factor in factors])


def test_setups_prepared_in_a_row_get_run_folders_of_their_own(tiny, tmp_path):
    setups = [app.prepare_training(TinyNet(), tiny.solutions(TABLE), devices=["cpu"],
                                   image_size=32, output_dir=str(tmp_path)) for _ in range(3)]
    assert len({setup.run_dir for setup in setups}) == 3
    assert all(setup.run_dir.is_dir() for setup in setups)


STDIN_SCRIPT = """
import sys
import torch, torch.nn as nn
import app
tiny = app.open_catalog("datasets.toml").dataset("sample_tiny")
def setup(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return app.prepare_training(model, tiny.solutions("LOC_train_solution.csv"),
                                devices=["cpu", "cpu"], optimizer=optimizer, batch_size=5,
                                image_size=32, epochs=1, parallel="processes", workers=0,
                                output_dir=sys.argv[1], run_name="stdin")
class Own(nn.Linear):
    pass
try:
    app.train(setup(nn.Sequential(nn.Flatten(), Own(3 * 32 * 32, 10))), logger=[])
except app.UserError as error:
    print("refused:", error)
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 10))
history = app.train(setup(model), loss=nn.CrossEntropyLoss(), logger=[])
print("epochs:", list(history.epoch))
"""


def test_a_script_read_from_stdin_trains_in_processes(sample_cache, tmp_path):
    """`python - < script.py`: the spawned workers must not try to run '<stdin>' as a file,
    and a class defined in that script is refused as a prompt's would be."""
    result = subprocess.run([sys.executable, "-", str(tmp_path)], input=STDIN_SCRIPT,
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: model: Own is defined in this notebook or prompt" in result.stdout
    assert "epochs: [1]" in result.stdout
    assert (tmp_path / "stdin" / "checkpoints" / "last.pt").is_file()
