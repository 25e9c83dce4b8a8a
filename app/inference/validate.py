"""bin/validate.py: top-1/top-5 of a checkpoint or an export over a dataset's whole val split, by
the driver's own evaluation (`driver.py -e`) set up from the model's files (architecture,
classes, validation resize and crop); the weights go in as --pretrained, so a checkpoint and an
export are read the same way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.config.sources import parse_config
from app.launch import remote_output, run
from app.models import saved_weights
from app.models.saved_weights import ModelSpec
from app.runtime.errors import UserError


def driver_args(model: str, spec: ModelSpec) -> list[str]:
    """The driver's flags that evaluate `model` as it was evaluated in training."""
    args = ["-e", "--pretrained", model, "-a", spec.arch, "--norm", spec.norm,
            "--image-size", str(spec.crop), "--val-crop-size", str(spec.crop),
            "--val-resize-size", str(spec.resize), "--mean", ",".join(map(str, spec.mean)),
            "--std", ",".join(map(str, spec.std))]
    if spec.model_kwargs:
        args += ["--model-kwargs", ",".join(spec.model_kwargs)]
    if spec.selection and spec.selection != "0":
        args += ["--classes", spec.selection]
    return args


def main(model: str, extra: list[str]) -> int:
    """`extra`: the driver's flags (--dataset, --catalog, --val-flip-tta, --devices, -b, -j,
    --run-name, --output-dir, ...). Prints the result as one line at the end."""
    if "--use-ema" in extra:  # the driver's EMA is a run's state; --pretrained takes weights
        raise UserError("validate.py rates a checkpoint's trained weights; for its EMA weights "
                        "export them (bin/export.py CHECKPOINT DIR --ema) and validate DIR")
    spec = saved_weights.read(model).spec
    if spec is None:
        raise UserError(f"{model} is a plain state dict: it does not say which model it is; "
                        "evaluate it with driver.py -e --pretrained it --arch ...")
    argv = driver_args(model, spec) + extra
    config, _ = parse_config(argv)
    if not config.run.name:
        argv += ["--run-name", f"validate-{time.strftime('%Y%m%d-%H%M%S')}"]
        config, _ = parse_config(argv)
    code = run.main(argv)
    if code == 0:
        print(summary(model, remote_output.run_dir(config.run.output_dir, config.run.name)))
    return code


def summary(model: str, run_dir: Path) -> str:
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [record for record in records if "val/top1" in record][-1]
    return (f"{model}: top-1 {metrics['val/top1']:.4f}  top-5 {metrics['val/top5']:.4f}  "
            f"({metrics['val/images']} images, {metrics['val/skipped']} skipped; "
            f"{run_dir / 'metrics.jsonl'})")
