#!/usr/bin/env python3
"""Export a checkpoint for the tools that serve models: model.safetensors and config.json in
timm's local-dir form, and with --onnx model.onnx (dynamic batch) for ONNX Runtime.

    python bin/export.py runs/r50/checkpoints/best.pt exports/r50 --onnx
    python -c 'import timm; timm.create_model("local-dir:exports/r50", pretrained=True)'
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.runtime.cli import run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="export.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint (.pt), a path "
                        "or any fsspec URL")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs "
                        "trained with --model-ema)")
    parser.add_argument("--onnx", action="store_true", help="also write model.onnx")
    args = parser.parse_args(argv)
    from app.inference.export import export  # noqa: PLC0415 (torch and timm: after parsing)
    for path in export(args.checkpoint, args.out_dir, ema=args.ema, onnx=args.onnx):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
