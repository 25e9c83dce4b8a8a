"""The index of one shard on the local disk: where each sample's image bytes lie in a local file
and which class the shard gives it, so that a sample is one pread, never a walk of the shard.
A tar is its own data file (tarfile reads its headers, seeking past the data); a parquet file's
image bytes are written back to back into a data file of their own, row group by row group.
A shard cut short or damaged raises ShardError naming the shard and byte offset or row group.
"""

from __future__ import annotations

import os
import posixpath
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.runtime.errors import UserError, first_line
from app.runtime.files import atomic_path

# A WebDataset sample's image: its first member with one of webdataset's image extensions.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "tif", "tiff")
CLASS_EXTENSION = "cls"
REDOWNLOAD = "download or write it again (bin/make_shards.py), or remove it from the split"


class ShardError(UserError):
    """A shard that cannot be read as its format says."""


RESUME = "resume with --resume auto (the last checkpoint stands)"


def missing_shard(shard: str, how: str = "") -> ShardError:
    """A listed shard that is not there (any more): removed or moved, or a partial copy."""
    return ShardError(f"shard {shard} is missing{how}; put it back (download or copy it "
                      f"again), then {RESUME}")


@dataclass(frozen=True)
class ShardIndex:
    offsets: np.ndarray  # int64: the image bytes' first byte in the local data file
    sizes: np.ndarray  # int64: their length (0: the sample has no image bytes)
    labels: np.ndarray  # int64: the class index the shard gives each sample

    def __len__(self) -> int:
        return len(self.offsets)

    def save(self, path: Path) -> None:
        """Atomically (readers in other processes see the whole index or none)."""
        with atomic_path(path) as temporary, open(temporary, "wb") as file:
            np.savez(file, offsets=self.offsets, sizes=self.sizes, labels=self.labels)

    @classmethod
    def load(cls, path: Path) -> "ShardIndex":
        with np.load(path) as arrays:
            return cls(arrays["offsets"], arrays["sizes"], arrays["labels"])


def split_member_name(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of the file name, the
    extension everything after it (`a/n01_1.seg.png` -> `a/n01_1`, `seg.png`)."""
    folder, base = posixpath.split(name)
    stem, _, extension = base.partition(".")
    return posixpath.join(folder, stem), extension.lower()


def index_tar(path: Path, shard: str) -> ShardIndex:
    """The samples of a local tar, in member order; `shard` names it in messages."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise missing_shard(shard) from None
    offsets, sizes, labels = [], [], []
    key, image, label = None, None, None

    def close_sample() -> None:
        if key is None:
            return
        if label is None:
            raise ShardError(f"shard {shard}: sample {key} has no .{CLASS_EXTENSION} member "
                             "(its class index); every sample needs one")
        offsets.append(image.offset_data if image else 0)
        sizes.append(image.size if image else 0)
        labels.append(label)

    tar = None
    try:
        tar = tarfile.open(path, "r:")
        with tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise ShardError(
                        f"shard {shard} is truncated: member {member.name} at byte offset "
                        f"{member.offset_data} needs {member.size} bytes, the file ends at "
                        f"{size}; {REDOWNLOAD}")
                member_key, extension = split_member_name(member.name)
                if member_key != key:
                    close_sample()
                    key, image, label = member_key, None, None
                if extension in IMAGE_EXTENSIONS and image is None:
                    image = member
                elif extension == CLASS_EXTENSION:
                    label = _class_index(tar.extractfile(member).read(), shard, member)
            close_sample()
    except tarfile.TarError as error:
        offset = tar.offset if tar is not None else 0
        raise ShardError(f"shard {shard} is damaged near byte offset {offset} "
                         f"({first_line(error)}); {REDOWNLOAD}") from None
    return ShardIndex(np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64),
                      np.array(labels, dtype=np.int64))


def _class_index(text: bytes, shard: str, member: tarfile.TarInfo) -> int:
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ShardError(f"shard {shard}: {member.name} at byte offset {member.offset_data} "
                         f"holds {text[:20]!r}, not a class index") from None


def parquet_file(source, shard: str):
    """pyarrow's ParquetFile of a path or an open file; one without a footer names its size."""
    import pyarrow as pa  # noqa: PLC0415 (only the shard layouts need pyarrow)
    import pyarrow.parquet as pq  # noqa: PLC0415
    try:
        return pq.ParquetFile(source)
    except FileNotFoundError:
        raise missing_shard(shard) from None
    except (pa.ArrowInvalid, OSError) as error:
        end = os.path.getsize(source) if isinstance(source, (str, Path)) else source.seek(0, 2)
        raise ShardError(f"shard {shard} is truncated or not parquet: no readable footer at "
                         f"byte offset {end} ({first_line(error, 100)}); {REDOWNLOAD}") from None


def parquet_labels(source, shard: str) -> np.ndarray:
    """The `label` column of a parquet shard: only that column's pages are read."""
    handle = parquet_file(source, shard)
    if "label" not in handle.schema_arrow.names or "image" not in handle.schema_arrow.names:
        raise ShardError(f"shard {shard}: columns {handle.schema_arrow.names}, expected `image` "
                         "(struct of bytes and path) and `label`, as Hugging Face's imagenet-1k")
    labels = [_row_group(handle, group, "label", shard).column(0).fill_null(-1).to_numpy()
              .astype(np.int64) for group in range(handle.num_row_groups)]
    return np.concatenate(labels) if labels else np.empty(0, dtype=np.int64)


def unpack_parquet(source: Path, data_path: Path, shard: str) -> ShardIndex:
    """Write the image bytes of a local parquet shard back to back into `data_path`, row group
    by row group (memory: one row group), and index them."""
    handle = parquet_file(source, shard)
    labels = parquet_labels(source, shard)
    offsets, sizes, written = [], [], 0
    with open(data_path, "wb") as out:
        for group in range(handle.num_row_groups):
            images = _row_group(handle, group, "image", shard).column(0)
            for chunk in images.chunks:
                values = chunk.flatten()[chunk.type.get_field_index("bytes")]
                ends = np.frombuffer(values.buffers()[1], dtype=_offset_type(values))[
                    values.offset:values.offset + len(values) + 1].astype(np.int64)
                data = values.buffers()[2]
                first, last = int(ends[0]), int(ends[-1])
                out.write(memoryview(data)[first:last] if data is not None else b"")
                valid = np.asarray(values.is_valid()) & np.asarray(chunk.is_valid())
                sizes.append(np.where(valid, np.diff(ends), 0))
                offsets.append(written + ends[:-1] - first)
                written += last - first
    if sum(len(s) for s in sizes) != len(labels):
        raise ShardError(f"shard {shard}: {len(labels)} labels but "
                         f"{sum(len(s) for s in sizes)} images; {REDOWNLOAD}")
    empty = np.empty(0, dtype=np.int64)
    return ShardIndex(np.concatenate(offsets) if offsets else empty,
                      np.concatenate(sizes) if sizes else empty, labels)


def _row_group(handle, group: int, column: str, shard: str):
    import pyarrow as pa  # noqa: PLC0415
    try:
        return handle.read_row_group(group, columns=[column])
    except (pa.ArrowException, OSError) as error:
        raise ShardError(f"shard {shard}: row group {group} of {handle.num_row_groups} is "
                         f"unreadable ({first_line(error, 100)}); {REDOWNLOAD}") from None


def _offset_type(values) -> type:
    import pyarrow as pa  # noqa: PLC0415
    return np.int64 if pa.types.is_large_binary(values.type) else np.int32
