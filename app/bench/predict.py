"""Predict throughput: an export's model.onnx in ONNX Runtime beside our PyTorch model, on the
same images, transform and batches (bin/predict.py's code for both), with how far their logits
and top-1 agree. With `-a ARCH`, a freshly initialised model is exported to a temporary folder:
speed does not depend on the weights."""

from __future__ import annotations

import tempfile
import timeit

import torch

from app.catalog import locations
from app.inference.export import export_model
from app.inference.model_files import LoadedModel, build, open_model
from app.inference.predict import OnnxRunner, Runner, TorchRunner, Transform, image_files, predict
from app.models.saved_weights import ModelSpec


def fresh_model(arch: str, image_size: int) -> LoadedModel:
    torch.manual_seed(0)
    spec = ModelSpec(arch, 1000, crop=image_size)
    return LoadedModel(build(spec).eval(), spec, f"a fresh {arch}", "checkpoint")


def run(model: str, arch: str, image_size: int, images: list[str], batch_size: int,
        repeats: int, limit: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        if arch:
            export_model(fresh_model(arch, image_size), folder, onnx=True, report=lambda _: None)
            model = folder
        loaded = open_model(model)
        files, failures = image_files(images)
        files = files[:limit] if limit else files
        transform = Transform.of(loaded)
        batches = [torch.stack([transform(locations.read_bytes(f))
                                for f in files[i:i + batch_size]])
                   for i in range(0, len(files), batch_size)]
        runners: dict[str, Runner] = {"pytorch": TorchRunner(loaded, "cpu"),
                                      "onnxruntime": OnnxRunner(model)}
        results, logits = [], {}
        for name, runner in runners.items():
            logits[name] = torch.cat([runner(batch) for batch in batches])  # also warms up
            model_s = min(timeit.repeat(lambda: [runner(batch) for batch in batches],
                                        number=1, repeat=repeats))
            e2e_s = min(timeit.repeat(lambda: list(predict(runner, files, transform, 5,
                                                           batch_size)), number=1, repeat=repeats))
            results.append({"runtime": name, "model_images_per_s": len(files) / model_s,
                            "e2e_images_per_s": len(files) / e2e_s})
    return {"arch": loaded.spec.arch, "image_size": loaded.spec.crop, "images": len(files),
            "skipped": len(failures), "batch_size": batch_size, "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "results": results,
            "max_logit_difference": float((logits["pytorch"] - logits["onnxruntime"])
                                          .abs().max()),
            "top1_agreement": float((logits["pytorch"].argmax(1) ==
                                     logits["onnxruntime"].argmax(1)).float().mean())}
