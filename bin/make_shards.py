#!/usr/bin/env python3
"""Write a catalog entry as WebDataset tars or Hugging Face parquet files, which the `wds` and
`parquet` layouts read (docs/datasets.md, "Shards").

    python bin/make_shards.py --dataset imagenet_local --format wds /data/imagenet-wds
    python bin/make_shards.py --dataset imagenet_s3 --format parquet /data/in-pq --shard-size 500MB
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.catalog.shard_writer import main  # noqa: E402
from app.runtime.cli import run_cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_cli(main))
