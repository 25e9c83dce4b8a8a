"""Where the images are and what they are: datasets.toml -> a DatasetRoot (catalog, storage,
locations) -> the tables of [path, label] of each split (tables: Kaggle's LOC files and
train_cls.txt; imagefolder: one folder per class; shards: WebDataset tars and parquet files,
with shard_index and shard_store; labels: wnids, words, --classes), the generated sample
datasets (sample), archives downloaded and unpacked on first use (archive, download), the list
of skipped images (skipped) and bin/make_shards.py's writer.

The face: Catalog. Imports only app.runtime and app.config. Nothing here imports torch.
"""

from app.catalog.catalog import Catalog

__all__ = ["Catalog"]
