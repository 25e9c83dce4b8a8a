"""pytorch/examples imagenet/main.py's recipe, every bench's baseline: its input pipeline for
`e2e` and `loader` (peer_batches), and main.py as it trains on N devices
(`--multiprocessing-distributed`), a process for `start` and `peers`: a process per device from
torch.multiprocessing.spawn, torchvision's model in DDP, SGD with a step schedule, validation,
rank 0's checkpoint; the devices here are CPU processes under gloo. As main.py, `-j` is the
whole machine's loader processes, and the module imports what main.py imports at its top, so
each spawned process pays what main.py's do. Rank 0 prints a JSON line with the time of its
first optimizer step, and one per epoch with its val top-1 (a fraction)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from PIL import Image

from app.runtime.devices import cpu_threads

if TYPE_CHECKING:  # main.py's processes import nothing more
    import pandas as pd

    from app.catalog.storage import DatasetRoot

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def train_transform(size: int) -> transforms.Compose:
    return transforms.Compose([transforms.RandomResizedCrop(size),
                               transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                               transforms.Normalize(MEAN, STD)])


class PeerDataset(torch.utils.data.Dataset):
    """main.py's ImageFolder (Pillow, RGB) over a catalog's table: a folder or a bucket."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame, size: int):
        self.root, self.rows, self.transform = root, list(zip(frame.path, frame.label)), \
            train_transform(size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        path, label = self.rows[index]
        with self.root.fs.open(self.root.path(path), "rb") as handle:
            return self.transform(Image.open(handle).convert("RGB")), label


def peer_batches(root: DatasetRoot, frame: pd.DataFrame, size: int, batch_size: int,
                 workers: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """float32 NCHW batches moved to the device, epoch after epoch, as main.py's loop does."""
    loader = torch.utils.data.DataLoader(
        PeerDataset(root, frame, size), batch_size=batch_size, shuffle=True,
        num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    while True:
        for images, labels in loader:
            yield (images.to(device, non_blocking=True), labels.to(device, non_blocking=True))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pytorch/examples' ImageNet recipe, on CPUs")
    parser.add_argument("data", help="an ImageFolder root: train/<class>/, val/<class>/")
    parser.add_argument("-a", "--arch", default="resnet18")
    for flags, value in ((("-j", "--workers"), 4), (("--epochs",), 1), (("--image-size",), 224),
                         (("-b", "--batch-size"), 256), (("--world",), 1)):  # world: main.py's GPUs
        parser.add_argument(*flags, type=int, default=value)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    parser.add_argument("--out", default=".", help="where rank 0 saves its checkpoint")
    parser.add_argument("--seed", type=int, default=None, help="main.py's --seed: seeds torch")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one process: main.py's "
                        "--gpu 0, cuDNN autotuning on, fp32)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.world > 1:
        mp.spawn(main_worker, nprocs=args.world, args=(args,))
    else:
        main_worker(0, args)


def main_worker(rank: int, args: argparse.Namespace) -> None:
    distributed = args.world > 1
    if args.seed is not None:
        # what main.py seeds; not its cudnn.deterministic, which would slow a GPU run
        torch.manual_seed(args.seed)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True  # main.py's
    if distributed:
        dist.init_process_group("gloo", init_method=args.dist_url, world_size=args.world,
                                rank=rank)
    # the cores shared between the ranks, capped by OMP_NUM_THREADS as ours are (a fair race)
    torch.set_num_threads(cpu_threads(args.world))
    model = models.__dict__[args.arch]().to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    batch = args.batch_size // args.world
    workers = (args.workers + args.world - 1) // args.world
    size = args.image_size
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_transform(size))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(size * 256 // 224), transforms.CenterCrop(size),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)]))
    sampler = torch.utils.data.distributed.DistributedSampler
    train_sampler = sampler(train_set) if distributed else None
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=batch, shuffle=train_sampler is None, num_workers=workers,
        sampler=train_sampler, pin_memory=device.type == "cuda")
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_size=batch, num_workers=workers, pin_memory=device.type == "cuda",
        sampler=sampler(val_set, shuffle=False) if distributed else None)
    for epoch in range(args.epochs):
        if train_sampler:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, device, first_epoch=epoch == 0,
              report=rank == 0)
        top1 = validate(val_loader, model, criterion, device, distributed)
        scheduler.step()
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "top1": top1, "time": time.time()}),
                  flush=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, "checkpoint.pth.tar"))
    if distributed:
        dist.destroy_process_group()


def train(loader, model, criterion, optimizer, device, first_epoch: bool, report: bool) -> None:
    model.train()
    for step, (images, target) in enumerate(loader):
        loss = criterion(model(images.to(device, non_blocking=True)),
                         target.to(device, non_blocking=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if first_epoch and step == 0 and report:
            print(json.dumps({"first_step_time": time.time()}), flush=True)


def validate(loader, model, criterion, device, distributed: bool) -> float:
    """Top-1 over the val set, as main.py's `acc1` (summed over processes when distributed)."""
    model.eval()
    counts = torch.zeros(2)  # right, seen
    with torch.no_grad():
        for images, target in loader:
            target = target.to(device, non_blocking=True)
            output = model(images.to(device, non_blocking=True))
            criterion(output, target)
            counts += torch.tensor([(output.argmax(1) == target).sum().item(), len(target)])
    if distributed:
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


if __name__ == "__main__":
    main()
