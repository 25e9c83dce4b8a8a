"""Read what wandb wrote to an offline run's .wandb file, as protobuf Records.

The file is a LevelDB-style log (wandb's "datastore"): a 7-byte file header (":W&B", magic
0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, kind:
1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a header is zero padding.
Checksums are not verified: a test only needs the records back.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = struct.Struct("<IHB")
FILE_HEADER = struct.Struct("<4sHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, magic, _ = FILE_HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a wandb datastore file"
    records, pending, position = [], b"", FILE_HEADER.size
    while position + HEADER.size <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER.size:
            position += left_in_block
            continue
        _, length, kind = HEADER.unpack_from(data, position)
        position += HEADER.size
        if kind == 0:  # zero padding up to the end of the block
            position += left_in_block - HEADER.size
            continue
        pending += data[position:position + length]
        position += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def of_kind(records, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def history(records) -> list[dict]:
    """One dict per logged step: {"_step": n, "val/top1": ..., ...}."""
    return [{"/".join(item.nested_key) or item.key: json.loads(item.value_json)
             for item in row.item} for row in of_kind(records, "history")]


def config(records) -> dict:
    """The run's config as logged (the last value of each key)."""
    values = {}
    for update in [r.config for r in of_kind(records, "run")] + of_kind(records, "config"):
        for item in update.update:
            values["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return values
