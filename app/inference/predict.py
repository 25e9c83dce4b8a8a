"""Classify images with a trained model (a checkpoint or an export folder): the top-k classes of
each image, by wnid and words. Images get the model's validation transform by the evaluation's
own code (app/data), so an image the evaluation rated correctly is predicted the same way here.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TextIO

import torch

from app.catalog import locations
from app.data.augment import EvalRecipe
from app.data.decode import BadImage, open_image, to_rgb
from app.data.device import pixel_statistics
from app.data.pillow_pipeline import apply_on_pil
from app.inference.model_files import LoadedModel, open_model
from app.models.saved_weights import EXPORT_ONNX, ONNX_INPUT, ONNX_OUTPUT
from app.runtime.errors import UserError

# In a folder, files with these suffixes are classified; a file named on its own always is.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
DECODE_THREADS = 4  # Pillow decodes and resizes without holding the GIL


@dataclass(frozen=True)
class Prediction:
    image: str
    top: list[tuple[int, float]]  # (class index, probability), most probable first


@dataclass(frozen=True)
class Failure:
    image: str
    reason: str


Runner = Callable[[torch.Tensor], torch.Tensor]  # normalised NCHW float32 -> logits


class TorchRunner:
    """Our PyTorch model, on the GPU when there is one."""

    def __init__(self, loaded: LoadedModel, device: str = "auto"):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = loaded.model.to(self.device).eval()

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.to(self.device, non_blocking=True)).float().cpu()


class OnnxRunner:
    """The export's model.onnx in ONNX Runtime (CUDA when its build and a GPU offer it)."""

    def __init__(self, folder: str):
        import onnxruntime  # noqa: PLC0415 (only for --onnx)
        path = locations.join(folder, EXPORT_ONNX)
        wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
        available = onnxruntime.get_available_providers()
        try:
            self.session = onnxruntime.InferenceSession(
                locations.read_bytes(path), providers=[p for p in wanted if p in available])
        except (RuntimeError, ValueError) as error:  # onnxruntime's own errors subclass these
            raise UserError(f"{path}: ONNX Runtime cannot load it ({str(error)[:120]})"
                            ) from None

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run([ONNX_OUTPUT], {ONNX_INPUT: images.numpy()})[0])


class Transform:
    """Image bytes -> the normalised (3, S, S) float32 tensor the evaluation would feed."""

    def __init__(self, recipe: EvalRecipe, mean: Iterable[float], std: Iterable[float]):
        self.recipe = recipe
        # the evaluation's own float32 arithmetic (app/data/device.py)
        self.mean, self.std = pixel_statistics(tuple(mean), tuple(std), torch.float32)

    def __call__(self, data: bytes) -> torch.Tensor:
        pixels = apply_on_pil(to_rgb(open_image(data)), self.recipe, seed=0)
        return pixels.permute(2, 0, 1).to(torch.float32).sub_(self.mean).div_(self.std)

    @classmethod
    def of(cls, loaded: LoadedModel) -> "Transform":
        return cls(loaded.recipe, loaded.spec.mean, loaded.spec.std)


def image_files(inputs: list[str]) -> tuple[list[str], list[Failure]]:
    """Files named, and image files in the folders named, in that order."""
    files, failures = [], []
    for item in inputs:
        try:
            if locations.is_folder(item):
                found = [f for f in locations.files_below(item)
                         if f.lower().endswith(IMAGE_SUFFIXES)]
                files += found
                if not found:
                    failures.append(Failure(item, "a folder without images"))
            else:
                files.append(item)
        except UserError as error:
            failures.append(Failure(item, str(error)))
    return files, failures


def load(location: str, transform: Transform) -> torch.Tensor | Failure:
    try:
        return transform(locations.read_bytes(location))
    except UserError as error:
        return Failure(location, str(error))
    except BadImage as error:  # Pillow names the in-memory file it was given: not useful here
        return Failure(location, "not an image: " + re.sub(r" <_io\.BytesIO object at \w+>",
                                                           "", str(error)))


def predict(runner: Runner, files: list[str], transform: Transform, k: int = 5,
            batch_size: int = 64, threads: int = DECODE_THREADS
            ) -> Iterator[Prediction | Failure]:
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(files), batch_size):
            chunk = files[start:start + batch_size]
            loaded = list(pool.map(lambda f: load(f, transform), chunk))
            good = [(f, x) for f, x in zip(chunk, loaded) if isinstance(x, torch.Tensor)]
            top = iter(())
            if good:
                probabilities = runner(torch.stack([x for _, x in good])).softmax(dim=1)
                values, indices = probabilities.topk(min(k, probabilities.shape[1]), dim=1)
                top = iter(zip(values.tolist(), indices.tolist()))
            for image, item in zip(chunk, loaded):
                if isinstance(item, Failure):
                    yield item
                else:
                    values, indices = next(top)
                    yield Prediction(image, list(zip(indices, values)))


def run(model: str, inputs: list[str], k: int = 5, as_json: bool = False, batch_size: int = 64,
        device: str = "auto", onnx: bool = False, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    """bin/predict.py: 0 when every image was classified, 1 when some could not be. Writes to
    sys.stdout and sys.stderr as they are at the call (a caller may have redirected them)."""
    out, err = out or sys.stdout, err or sys.stderr
    loaded = open_model(model)
    if onnx and loaded.kind != "export":
        raise UserError(f"--onnx runs an export's {EXPORT_ONNX}; {model} is a checkpoint "
                        "(bin/export.py CHECKPOINT OUT_DIR --onnx writes one)")
    runner = OnnxRunner(model) if onnx else TorchRunner(loaded, device)
    labels = loaded.labels()
    if not loaded.spec.class_names:
        print(f"note: {model} holds no class names (saved before they were stored); classes "
              "are shown by index", file=err)
    files, failures = image_files(inputs)
    for failure in failures:
        print(f"error: {failure.image}: {failure.reason}", file=err)
    for result in predict(runner, files, Transform.of(loaded), k, batch_size):
        if isinstance(result, Failure):
            failures.append(result)
            print(f"error: {result.image}: {result.reason}", file=err)
        else:
            print(format_json(result, labels) if as_json else format_text(result, labels),
                  file=out, flush=True)
    if not files and not failures:
        raise UserError("no images given")
    return 1 if failures else 0


def format_text(result: Prediction, labels: list[tuple[str, str]]) -> str:
    lines = [result.image]
    for index, probability in result.top:
        name, words = labels[index]
        lines.append(f"  {probability:7.2%}  {name}  {words}".rstrip())
    return "\n".join(lines)


def format_json(result: Prediction, labels: list[tuple[str, str]]) -> str:
    """One JSON object per image (JSON Lines)."""
    return json.dumps({"image": result.image, "top": [
        {"index": index, "class": labels[index][0], "words": labels[index][1],
         "probability": probability} for index, probability in result.top]})
