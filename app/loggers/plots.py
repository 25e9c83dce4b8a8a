"""Training curves from metrics.jsonl: loss, top-1/top-5, LR and images/s, one or several runs.
Drawn with matplotlib's object API on the Agg canvas: no display and no pyplot global state, so
it is safe inside a training process."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from app.runtime.errors import UserError
from app.runtime.files import atomic_path


def load_metrics(path: str | Path) -> pd.DataFrame:
    """Records of one run in step order, a resume's records replacing those it re-logs. A torn
    last line (killed while writing) is ignored; any other unreadable line is an error."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror}; is this a run folder?") from None
    kept: list[dict] = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise UserError(f"{path}:{number}: not a JSON record") from None
        if "event" in record:  # a restart (app/launch/run.py record_restart): no metrics to draw
            continue
        if kept and record["step"] < kept[-1]["step"]:  # a resume rewound to an earlier step
            kept = [old for old in kept if old["step"] < record["step"]]
        kept.append(record)
    return pd.DataFrame.from_records(kept)


PANELS = (  # (title, x column, [(column, line style)])
    ("loss", "step", [("train/loss", "-"), ("val/loss", "o--")]),
    ("val accuracy", "epoch", [("val/top1", "o-"), ("val/top5", "s--"),
                               ("val_ema/top1", "^:")]),
    ("learning rate", "step", [("train/lr", "-")]),
    ("images/s", "step", [("train/images_per_sec", "-")]),
)


def draw_curves(runs: dict[str, pd.DataFrame], path: str | Path) -> None:
    figure = curves_figure(runs)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=90, format="png")


def curves_figure(runs: dict[str, pd.DataFrame]):
    from matplotlib.figure import Figure  # noqa: PLC0415 (a second to import: only when drawing)
    figure = Figure(figsize=(11, 7))
    # fixed margins: the constrained layout measures every label first, doubling a draw's time
    figure.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, wspace=0.18,
                           hspace=0.35)
    axes = figure.subplots(2, 2).ravel()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for axis, (title, x, series) in zip(axes, PANELS):
        for (label, frame), colour in zip(runs.items(), colours):
            for column, style in series:
                if column not in frame or x not in frame:
                    continue
                points = frame[[x, column]].dropna()
                if points.empty:
                    continue
                name = column if len(runs) == 1 else f"{label} {column}"
                axis.plot(points[x], points[column], style, color=colour, label=name,
                          markersize=3)
        axis.set_title(title)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
    figure.suptitle(", ".join(runs))
    return figure


def main(argv: list[str]) -> int:
    """bin/plot.py RUN_DIR... [-o PNG]"""
    import argparse  # noqa: PLC0415
    parser = argparse.ArgumentParser(prog="bin/plot.py", description="Draw training curves "
                                     "from metrics.jsonl of one or several runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (runs/<name>)")
    parser.add_argument("-o", "--output", help="PNG to write (default: RUN_DIR/curves.png for "
                        "one run, compare.png for several)")
    args = parser.parse_args(argv)
    folders = [Path(run) for run in args.runs]
    output = args.output or (folders[0] / "curves.png" if len(folders) == 1 else "compare.png")
    draw_curves({folder.resolve().name: load_metrics(folder / "metrics.jsonl")
                 for folder in folders}, output)
    print(f"wrote {output}")
    return 0
