"""The nvJPEG input pipeline on CPU (torchvision's decode_jpeg with device="cpu": the code that
runs on a GPU with device="cuda"): the same batches, crops, flips and ops as the Pillow path,
bad and quirky files skipped or decoded by Pillow, never a crash.

Pixel tolerance, the DALI tests' (tests/pipelines.py assert_pillows_batches): at most 1.0 of
255 on average over a batch, 3.0 on any image, 6.0 with auto-augment (whose ops spread the
decoders' small differences: solarize flips a value near its threshold, posterize drops a bit),
images that get Equalize left out (exact on equal pixels, it spreads its input's small
differences over whole levels). Measured on the tiny sample: plain 0.19 on a batch and 0.55
on an image; with TA-wide, RandAugment and AutoAugment at most 0.32 and 4.2.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data import decoders, nvjpeg_pipeline
from app.data.augment import IMAGENET_MEAN, IMAGENET_STD, EvalRecipe, TrainRecipe
from app.data.decode import open_image, to_rgb
from app.data.decoders import build_pipeline, resolve_decoder
from app.data.device import ToDevice
from app.data.encoded import EncodedDataset, collate_encoded
from app.data.image_ops import apply_ops
from app.data.pillow_pipeline import ImageDataset, apply_on_pil, collate
from app.data.pipeline import InputFormat
from app.data.resolution import TrainSizes
from app.data.sampler import ShardedBatches
from pipelines import (assert_pillows_batches, batches_of, damage_five, level_difference,
                       sample_photos, spec_for, wide_ops)


@pytest.mark.parametrize("split, auto_augment", [
    ("train", "off"), ("val", "off"), ("train", "ta_wide"), ("train", "ra"),
    ("train", "imagenet")])
def test_nvjpeg_and_pillow_give_the_same_batches(tiny_sample, split, auto_augment):
    assert_pillows_batches("nvjpeg", tiny_sample, split, auto_augment)


def test_the_ops_on_tensors_are_pillows(tiny_sample):
    """Every op of TA-wide (and AutoAugment's Invert) at a few magnitudes of both signs, on
    tensors against PIL images: exact, but Rotate within 1 level on at most 1% of the values
    (its sample points in another order of float operations: here 0.1%)."""
    photos = sample_photos(tiny_sample, 64)
    for name, magnitude in wide_ops():
        for photo in photos:
            pillow = np.asarray(apply_ops(photo, ((name, magnitude),))).astype(np.int16)
            tensor = torch.from_numpy(np.asarray(photo).copy()).permute(2, 0, 1)
            ours = apply_ops(tensor, ((name, magnitude),)).permute(1, 2, 0).numpy()
            difference = np.abs(pillow - ours.astype(np.int16))
            if name == "Rotate":
                assert difference.max() <= 1 and (difference > 0).mean() <= 0.01, magnitude
            else:
                assert difference.max() == 0, (name, magnitude)


def quirky(root, paths) -> dict[str, str]:
    """Path -> kind of the sample's CMYK JPEG, its PNG under a .JPEG name and a grey JPEG."""
    kinds = {}
    for path in paths:
        with Image.open(f"{root.url}/{path}") as image:
            kind = "png" if image.format == "PNG" else {"CMYK": "cmyk", "L": "gray"}.get(
                image.mode)
        if kind and kind not in kinds.values():
            kinds[path] = kind
    return kinds


def test_bad_files_are_skipped_and_quirky_ones_decoded_as_pillow_does(tiny_copy):
    # cut at its end: the header is whole, the end of image marker gone (Pillow decides in the
    # loader: the device never sees it); the Huffman file fails the batch's decode call, then
    # its own, then Pillow's
    root, frame, batches, damaged = damage_five(tiny_copy, slice(None, -400))
    spec = spec_for(root, frame, TrainRecipe(24, auto_augment="ta_wide"), batches)
    out = batches_of("nvjpeg", spec, 0, 0)
    reasons = {s.path: s.reason for b in out for s in b.skipped}
    assert set(reasons) == set(damaged.values())
    assert reasons[damaged["empty"]] == "empty file"
    assert reasons[damaged["missing"]] == "missing"
    assert reasons[damaged["huffman"]].startswith("not decodable: broken data stream")
    assert reasons[damaged["truncated"]].startswith("not decodable: image file is truncated")
    assert sum(len(b) for b in out) == len(frame) - 5 and len(out) == 5
    # The same files are bad for Pillow (the truncated one for the same reason), so the batches
    # align image for image: the CMYK JPEG and the PNG come from Pillow in the loader (its
    # pixels exactly), the grey JPEG from the decoder (within the tolerance).
    pillow = batches_of("pillow", spec, 0, 0)
    pillow_reasons = {s.path: s.reason for b in pillow for s in b.skipped}
    assert set(pillow_reasons) == set(reasons)
    assert pillow_reasons[damaged["truncated"]] == reasons[damaged["truncated"]]
    kinds = quirky(root, set(frame.path) - set(reasons))
    assert sorted(kinds.values()) == ["cmyk", "gray", "png"]
    for step, (a, b) in enumerate(zip(pillow, out)):
        paths = [frame.path[index] for index, _ in batches.items(batches.order(0), 0, step)
                 if frame.path[index] not in reasons]
        for position, path in enumerate(paths):
            if path in kinds:
                difference = level_difference(a.images[position:position + 1],
                                              b.images[position:position + 1])
                limit = 3.0 if kinds[path] == "gray" else 0.0
                assert difference.mean() <= limit, kinds[path]
                kinds.pop(path)
    assert not kinds  # each was found


@st.composite
def damaged_jpeg(draw, jpegs: list[bytes]) -> bytes:
    """One of `jpegs`, intact, cut short, with bytes changed or with bytes inserted."""
    data = bytearray(jpegs[draw(st.integers(0, len(jpegs) - 1))])
    damage = draw(st.sampled_from(["intact", "cut", "changed", "inserted"]))
    if damage == "cut":
        del data[draw(st.integers(0, len(data) - 1)):]
    elif damage == "changed":
        for _ in range(draw(st.integers(1, 12))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif damage == "inserted":
        data[draw(st.integers(0, len(data))):0] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def through_both(tiny_sample, blobs: list[bytes], seed: int, decoder=None) -> tuple:
    """`blobs` as one batch through the nvJPEG path (the loader's prepare, then the device
    decoder on the CPU, a new one unless given), and through Pillow's: (the nvJPEG
    DeviceBatch, Pillow's HostBatch)."""
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = load_tables(root).train
    recipe = TrainRecipe(32, auto_augment="ta_wide")
    batches = ShardedBatches(len(frame), 4)
    ours, pillow = EncodedDataset(root, frame, recipe, batches), \
        ImageDataset(root, frame, recipe, batches)
    decoder = decoder or nvjpeg_pipeline.DeviceDecoder(ToDevice(InputFormat(torch.device("cpu"))))
    batch = decoder(collate_encoded([ours.decode(f"{i}.JPEG", (blob, None, i), seed, recipe)
                         for i, blob in enumerate(blobs)]))
    return batch, collate([pillow.decode(f"{i}.JPEG", (blob, None, i), seed, recipe)
                           for i, blob in enumerate(blobs)])


def sample_jpegs(tiny_sample, count: int) -> list[bytes]:
    frame = load_tables(DatasetRoot("tiny", str(tiny_sample))).train
    return [(tiny_sample / path).read_bytes() for path in frame.path[:count]]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_jpegs_are_skipped_or_kept_as_pillow_decides(tiny_sample, data):
    """Batches of the sample's JPEGs, damaged at random, through the nvJPEG path (the batch
    whole, else image by image, else Pillow) and through Pillow's: no crash, the same images
    skipped, the others in order."""
    blobs = data.draw(st.lists(damaged_jpeg(sample_jpegs(tiny_sample, 6)), min_size=1,
                               max_size=4))
    batch, expected = through_both(tiny_sample, blobs, data.draw(st.integers(0, 2**31 - 1)))
    assert {s.path for s in batch.skipped} == {s.path for s in expected.skipped}
    assert torch.equal(batch.labels, expected.labels)
    assert len(batch.images) == len(expected)
    assert not len(expected) or batch.images.shape[1:] == (3, 32, 32)


@pytest.mark.parametrize("failure, cause", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     "the GPU is out of memory"),
    (RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support"),
     "this torchvision was built without nvJPEG")])
def test_a_decoder_failure_not_of_the_image_is_named_once(tiny_sample, monkeypatch, caplog,
                                                         failure, cause):
    """Every call of torchvision's decoder fails for a reason that is the machine's: the
    batch goes image by image, then to Pillow (its pixels exactly), and one warning per step
    names the cause, however many batches follow."""
    def failing(jpegs, **options):
        raise failure
    monkeypatch.setattr(nvjpeg_pipeline, "decode_jpeg", failing)
    jpegs = sample_jpegs(tiny_sample, 6)
    to_device = ToDevice(InputFormat(torch.device("cpu")))
    decoder = nvjpeg_pipeline.DeviceDecoder(to_device)
    with caplog.at_level("INFO", logger="imagenet_dp"):
        for blobs in (jpegs[:4], jpegs[4:]):
            batch, expected = through_both(tiny_sample, blobs, 3, decoder)
            assert torch.equal(batch.images, to_device(expected.images, expected.labels)[0])
            assert not batch.skipped
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all(f"nvJPEG failed on cpu: {cause} (" in w
                                      for w in warnings)
    assert "one by one" in warnings[0] and "Pillow decodes" in warnings[1]
    assert "--decoder pillow" in warnings[0]


def test_an_image_nvjpeg_refuses_is_decoded_by_pillow_from_its_plan(tiny_sample, monkeypatch,
                                                                    caplog):
    """nvJPEG refuses some JPEGs Pillow reads (unusual chroma subsampling): the batch's call
    fails, each image is tried alone, the refused one comes from Pillow with the same plan."""
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = load_tables(root).val
    spec = spec_for(root, frame, EvalRecipe(32), ShardedBatches(len(frame), 16, shuffle=False))
    refused = (tiny_sample / frame.path[3]).read_bytes()
    real = nvjpeg_pipeline.decode_jpeg
    calls = []

    def picky(jpegs, **options):
        calls.append(len(jpegs))
        if any(jpeg.numpy().tobytes() == refused for jpeg in jpegs):
            raise RuntimeError("Unknown chroma subsampling")
        return real(jpegs, **options)
    monkeypatch.setattr(nvjpeg_pipeline, "decode_jpeg", picky)
    with caplog.at_level("INFO", logger="imagenet_dp"):
        batch = batches_of("nvjpeg", spec, 0, 0)[0]
    # the first batch, then each of its images alone; the other batches (100 images) in one
    assert calls == [16] + [1] * 16 + [16] * 5 + [4]
    assert f"nvJPEG could not decode {frame.path[3]}; Pillow did" in caplog.text
    assert "WARNING" not in {r.levelname for r in caplog.records}  # the image's failure
    expected = apply_on_pil(to_rgb(open_image(refused)), EvalRecipe(32), 0)
    normalised = batch.images[3] * torch.tensor(IMAGENET_STD).view(3, 1, 1) + \
        torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    assert torch.equal((normalised * 255).round().to(torch.uint8).permute(1, 2, 0), expected)
    assert len(batch) == 16 and not batch.skipped


def test_auto_prefers_dali_then_nvjpeg_on_a_gpu_and_pillow_on_a_cpu(monkeypatch):
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    monkeypatch.setattr(decoders, "dali_imports", lambda: True)
    assert resolve_decoder("auto", cuda) == "dali" and resolve_decoder("auto", cpu) == "pillow"
    monkeypatch.setattr(decoders, "dali_imports", lambda: False)
    assert resolve_decoder("auto", cuda) == "nvjpeg" and resolve_decoder("auto", cpu) == "pillow"
    assert resolve_decoder("nvjpeg", cpu) == "nvjpeg"


def test_progressive_resizing_changes_the_size_with_the_epoch(tiny_sample):
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = load_tables(root).train
    spec = spec_for(root, frame, TrainRecipe.for_sizes(TrainSizes(32, 64, 1, 2)),
                    ShardedBatches(len(frame), 64, seed=1), workers=2)
    pipeline = build_pipeline("nvjpeg", spec)
    try:
        for epoch, size in [(1, 32), (2, 64)]:
            assert {b.images.shape[-2:] for b in pipeline.epoch(epoch)} == {(size, size)}
    finally:
        pipeline.close()
