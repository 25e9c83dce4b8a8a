"""The 128 px / 5-epoch Imagenette row's 2020 holder's recipe in fastai's own code, for
`bin/bench.py peers --trainers ours,fastai`: pete88b's "mini net" notebook (85.77%) as it
trains, on a local copy of the photos instead of the downloaded archive. fastai's DataBlock
(folders, `Resize` = a random square of the shorter side, flips, pixels in 0-1 with no
normalisation), fastai's XResNet with one SE-ResNeXt block a stage (64 groups, reduction 8,
Mish), `ranger` (Lookahead around fastai's RAdam), label smoothing, `fit_flat_cos`; fp32.

It runs in its own interpreter with fastai on the path (`make peer-fastai` installs it into
.peers/fastai, beside the training dependencies), so nothing of the product imports fastai.
It prints a JSON line per epoch: val top-1 (fastai's `accuracy`), the wall-clock time at the
epoch's end, the images trained and the seconds its training steps took."""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

from fastai.vision.all import (AvgPool, Callback, CategoryBlock, DataBlock, FlipItem,
                               GrandparentSplitter, ImageBlock, LabelSmoothingCrossEntropy,
                               Learner, MishJit, ProgressCallback, Recorder, Resize,
                               SEResNeXtBlock, XResNet, accuracy, find_bs, get_image_files,
                               parent_label, ranger, set_seed, top_k_accuracy)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the Imagenette row's 2020 holder's recipe "
                                     "in fastai (his notebook's defaults)")
    parser.add_argument("data", help="an Imagenette folder: train/<wnid>/, val/<wnid>/")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--bs", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=None, help="the notebook's: "
                        "min(8, cores)")
    parser.add_argument("--seed", type=int, default=None, help="fastai's set_seed "
                        "(reproducible: cuDNN deterministic)")
    return parser.parse_args(argv)


def mini_net(classes: int):
    """The holder's net: fastai's XResNet, one SE-ResNeXt block a stage, wider groups and a
    milder squeeze than xse_resnext18's, Mish (his MishJit), average-pooled shortcuts."""
    return XResNet(SEResNeXtBlock, 1, [1, 1, 1, 1], n_out=classes, groups=64, reduction=8,
                   act_cls=MishJit, sa=0, sym=0, pool=AvgPool)


class EpochReport(Callback):
    """One JSON line per epoch, after the Recorder has its metrics (so a higher order)."""
    order = Recorder.order + 1

    def before_train(self):
        self.images, self.started = 0, time.perf_counter()

    def after_batch(self):
        if self.training:
            self.images += find_bs(self.yb)

    def after_train(self):
        self.train_s = time.perf_counter() - self.started

    def after_epoch(self):
        names = self.recorder.metric_names[1:-1]  # without "epoch" and "time"
        top1 = float(self.recorder.values[-1][names.index("accuracy")])
        print(json.dumps({"epoch": self.epoch + 1, "top1": top1, "time": time.time(),
                          "train_images": self.images, "train_s": self.train_s}), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.seed is not None:
        set_seed(args.seed, reproducible=True)
    root = Path(args.data)
    block = DataBlock(blocks=(ImageBlock, CategoryBlock),
                      splitter=GrandparentSplitter(valid_name="val"),
                      get_items=get_image_files, get_y=parent_label,
                      item_tfms=[Resize(args.size), FlipItem(0.5)])
    kwargs = {} if args.workers is None else {"num_workers": args.workers}
    dls = block.dataloaders(root, path=root, bs=args.bs, **kwargs)
    learn = Learner(dls, mini_net(len(dls.vocab)),
                    opt_func=partial(ranger, mom=0.9, sqr_mom=0.99, eps=1e-6, beta=0.0),
                    metrics=[accuracy, top_k_accuracy], loss_func=LabelSmoothingCrossEntropy(),
                    cbs=EpochReport())
    learn.remove_cb(ProgressCallback)  # the bars: a terminal's, not a log's
    learn.logger = lambda *_: None
    learn.fit_flat_cos(args.epochs, args.lr, wd=args.wd)


if __name__ == "__main__":
    main()
