"""`bin/bench.py gpu-check` and `photos pack|receive` (the real photos of its imagenette part):
their flags (app/bench/gpu_check.py runs the parts, app/bench/photo_parts.py packs and receives)."""

from __future__ import annotations

import argparse
import os

from app.bench.gpu_check import BUDGET_S, PHOTOS, WORK


def add_gpu_check(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "gpu-check", help="prove a GPU machine end to end within a time budget (a new GPU box, "
        "a cloud image, a driver upgrade): parts in their order of value, each with its own "
        "deadline, each report written the moment it ends (--list names them; the imagenette "
        f"part is skipped unless `bench.py photos receive` put photos in --work's {PHOTOS}/)")
    check.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the "
                       f"parts (default {BUDGET_S:.0f}; a "
                       "larger budget gives the gpu tests more time, then the extras)")
    check.add_argument("--out", default="gpu-check", help="the report folder: <part>.json, "
                       "<part>.log, summary.md")
    check.add_argument("--work", default=str(WORK), help="compile caches, the generated "
                       f"sample, run folders and the real photos ({PHOTOS}/; kept out of --out)")
    check.add_argument("--archive", help="also pack the report folder into this .tar.gz after "
                       "each part")
    check.add_argument("--parts", default="", help="only these, comma-separated (bin/bench.py "
                       "gpu-check --list names them)")
    check.add_argument("--list", action="store_true", help="name the parts and their "
                       "deadlines in this budget, run nothing")
    check.add_argument("-n", "--test-processes", type=int, default=4, help="gpu test "
                       "processes sharing the GPU (needs pytest-xdist; 1 = one after the other)")
    check.add_argument("-k", "--select", default="", help="only the gpu tests matching this "
                       "pytest -k expression")
    check.add_argument("--dali-threads", type=int, default=8, help="decoding threads (-j) of "
                       "the DALI pipelines whose memory is measured")
    check.add_argument("--dali-batch", type=int, default=256, help="their batch size")
    check.add_argument("--dali-sample", default="tiny", choices=("tiny", "bench"),
                       help="the generated sample they read (bench: ImageNet-sized images; "
                       "the first batch's memory depends on it, the build's does not)")


DEFAULT_PARTS = ".carry/imagenette144"
PART_MIB = 60.0  # a copy of 64 MiB holds a part beside the project's own files


def add_photos(commands: argparse._SubParsersAction) -> None:
    photos = commands.add_parser("photos", help="real photos for a GPU machine without "
                                 "network: re-encoded small and split into parts that are "
                                 "copied one at a time (pack), then put together there "
                                 "(receive) for gpu-check's imagenette part")
    actions = photos.add_subparsers(dest="action", required=True)
    pack = actions.add_parser("pack", help="re-encode an ImageFolder (train/<class>/, "
                              "val/<class>/) with its shorter side at N px into parts p1, "
                              "p2, ... of at most --part-size, in a folder git ignores")
    pack.add_argument("source", help="the photos, e.g. an unpacked Imagenette")
    pack.add_argument("--out", default=DEFAULT_PARTS, help="the parts' folder; git must "
                      f"ignore it (default {DEFAULT_PARTS}: /.carry/ is in .gitignore)")
    pack.add_argument("--shorter-side", type=int, default=144, help="px (144: a 128 px "
                      "crop with room to move, as bin/make_shards.py --shorter-side)")
    pack.add_argument("--part-size", type=float, default=PART_MIB, help="MiB per part, "
                      f"at most (default {PART_MIB:.0f})")
    pack.add_argument("-j", "--workers", type=int, default=os.cpu_count() or 1,
                      help="processes re-encoding the photos")
    receive = actions.add_parser("receive", help="on the GPU machine: unpack the parts "
                                 "copied there into the copy gpu-check's imagenette part "
                                 "trains on (a part already in is skipped)")
    receive.add_argument("parts", nargs="?", default=DEFAULT_PARTS, help="where the parts "
                         f"were copied (default {DEFAULT_PARTS})")
    receive.add_argument("--into", default=str(WORK / PHOTOS), help="the copy: "
                         f"{PHOTOS}/ in gpu-check's --work folder (default: in the default "
                         "--work)")
