"""Where the images are and what they are: datasets.toml -> a DatasetRoot (catalog, storage,
locations) -> each split's [path, label] table (tables, imagefolder, shards, labels); generated
samples (sample), files fetched once per machine (fetcher, archive), a remote run folder's
uploads (remote_run, uploader), the skipped images (skipped) and bin/make_shards.py's writer.

The face: Catalog. Imports only app.runtime and app.config. Nothing here imports torch.
"""

from app.catalog.catalog import Catalog

__all__ = ["Catalog"]
