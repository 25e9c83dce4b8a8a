"""`bin/bench.py photos pack|receive`: its flags (app/bench/photo_parts.py packs and receives)."""

from __future__ import annotations

import argparse
import os

from app.bench.gpu_check import PHOTOS, WORK

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
