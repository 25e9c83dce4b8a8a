import collections
import itertools
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from app.catalog import sample, tables
from app.catalog.storage import DatasetRoot
from app.catalog.tables import train_cls_list
from app.data.augment import EvalRecipe, Plan, TrainRecipe, center_crop_box, random_resized_crop_box
from app.data.dali_memory import IMAGENET_LARGEST, decoder_memory, largest_image
from app.data.decode import BadImage, open_image, to_rgb
from app.data.decoders import build_pipeline
from app.data.device import ToDevice
from app.data.pillow_pipeline import BatchRequest, ReadAhead, build_loader
from app.data.pipeline import InputFormat, PipelineSpec, Skipped
from app.data.sampler import ShardedBatches


def indices(batches) -> list[list[int]]:
    return [[i for i, _ in batch] for batch in batches]


def test_an_epoch_sees_every_image_once_and_epochs_differ():
    batches = ShardedBatches(103, 10, seed=1)
    batches.set_epoch(0)
    first = indices(batches)
    assert len(first) == math.ceil(103 / 10) and len(first[-1]) == 3
    assert sorted(sum(first, [])) == list(range(103))
    batches.set_epoch(1)
    assert indices(batches) != first


def test_two_workers_split_exactly_the_global_batch_of_one():
    single = ShardedBatches(103, 20, seed=5)
    halves = [ShardedBatches(103, 10, rank=r, world_size=2, seed=5) for r in range(2)]
    for epoch in (0, 3):
        for b in [single, *halves]:
            b.set_epoch(epoch)
        for whole, a, b in zip(indices(single), indices(halves[0]), indices(halves[1])):
            assert whole == a + b and not set(a) & set(b)
        assert len(halves[0]) == len(halves[1]) == len(single)


def test_uneven_last_batch_may_leave_a_worker_empty_but_steps_stay_aligned():
    workers = [ShardedBatches(41, 10, rank=r, world_size=4, seed=0) for r in range(4)]
    per_worker = [indices(w) for w in workers]
    assert len({len(p) for p in per_worker}) == 1  # same number of steps everywhere
    assert sorted(sum((sum(p, []) for p in per_worker), [])) == list(range(41))
    assert [len(p[-1]) for p in per_worker] == [1, 0, 0, 0]


def test_resuming_mid_epoch_gives_the_remaining_batches():
    full = ShardedBatches(50, 8, seed=2)
    full.set_epoch(4)
    later = ShardedBatches(50, 8, seed=2)
    later.set_epoch(4, start_step=3)
    assert list(later) == list(full)[3:] and len(later) == len(full) - 3


def test_validation_counts_every_image_exactly_once():
    parts = [ShardedBatches(23, 4, rank=r, world_size=3, shuffle=False) for r in range(3)]
    seen = sum((sum(indices(p), []) for p in parts), [])
    assert sorted(seen) == list(range(23))


def test_augmentation_seed_depends_on_image_and_epoch_not_on_worker():
    one = ShardedBatches(20, 20, seed=0)
    two = ShardedBatches(20, 10, rank=1, world_size=2, seed=0)
    seeds_one = dict(sum(list(one), []))
    assert all(seeds_one[i] == s for i, s in sum(list(two), []))
    one.set_epoch(1)
    assert dict(sum(list(one), [])) != seeds_one


def repeated(num_items, batch_size, world_size, reps=3, seed=7):
    return [ShardedBatches(num_items, batch_size, rank=r, world_size=world_size, seed=seed,
                           repetitions=reps) for r in range(world_size)]


def steps_of(workers) -> list[list[list[tuple[int, int]]]]:
    """[step][worker] -> that worker's (index, seed) pairs."""
    return [list(step) for step in zip(*(list(w) for w in workers))]


@pytest.mark.parametrize("world_size", [1, 2])
def test_repeated_augmentation_keeps_the_epoch_length_and_repeats_each_image(world_size):
    """torchvision's RASampler: 103 images, 3 reps -> 34 images x 3 (never more steps)."""
    workers = repeated(103, 10 // world_size, world_size)
    steps = steps_of(workers)
    assert len(steps) == len(workers[0]) == math.ceil(102 / 10)
    seen = [i for step in steps for part in step for i, _ in part]
    assert len(seen) == 102 and set(collections.Counter(seen).values()) == {3}
    for w in workers:
        w.set_epoch(1)
    assert {i for step in steps_of(workers) for part in step for i, _ in part} != set(seen)


@pytest.mark.parametrize("world_size, batch_size", [(3, 4), (4, 5), (8, 2)])
def test_repeated_copies_in_a_full_step_land_on_different_workers(world_size, batch_size):
    """(4, 5): a global batch of 20 holds 6 whole images and parts of two more."""
    workers = repeated(200, batch_size, world_size)
    together = 0
    for step in steps_of(workers):
        if sum(map(len, step)) < world_size * batch_size:
            continue  # the last, short step
        for part in step:
            indices = [i for i, _ in part]
            assert len(indices) == len(set(indices))
        counts = collections.Counter(i for part in step for i, _ in part)
        together += sum(1 for n in counts.values() if n > 1)
    assert together >= 50  # most copies do share a step: the check above is not vacuous


def seeds_by_image(workers) -> dict[int, set[int]]:
    seeds = collections.defaultdict(set)
    for step in steps_of(workers):
        for part in step:
            for i, seed in part:
                seeds[i].add(seed)
    return dict(seeds)


def test_each_copy_has_its_own_augmentation_seed_whatever_the_worker():
    seeds = seeds_by_image(repeated(60, 5, 4))
    assert len(seeds) == 20 and all(len(s) == 3 for s in seeds.values())
    assert seeds_by_image(repeated(60, 20, 1)) == seeds
    plain = dict(sum(list(ShardedBatches(60, 20, seed=7)), []))
    assert all(plain[i] in s for i, s in seeds.items())  # copy 0: the seed without repeats


def test_repeated_augmentation_resumes_mid_epoch():
    full, later = repeated(103, 10, 2)[1], repeated(103, 10, 2)[1]
    full.set_epoch(2)
    later.set_epoch(2, start_step=4)
    assert list(later) == list(full)[4:] and len(later) == len(full) - 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_workers_split_exactly_the_repeated_global_batch_of_one(world_size):
    """What keeps N workers x batch b equal to one worker x batch N*b under --ra-sampler
    (the driver-level check, as in tests/test_parallel.py, takes ~2 minutes here)."""
    one = repeated(103, 5 * world_size, 1)
    parts = repeated(103, 5, world_size)
    for epoch in (0, 3):
        for b in one + parts:
            b.set_epoch(epoch)
        steps = steps_of(parts)
        assert len(steps) == len(one[0])
        for (whole,), step in zip(steps_of(one), steps):
            assert whole == sum(step, [])


def test_random_resized_crop_boxes_respect_scale_and_ratio():
    from torchvision.transforms import RandomResizedCrop
    rng = random.Random(0)
    torch.manual_seed(0)
    ours, theirs = [], []
    for _ in range(3000):
        height, width = rng.randint(40, 500), rng.randint(40, 500)
        top, left, h, w = random_resized_crop_box(height, width, rng)
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
        ours.append((h * w / (height * width), w / h))
        _, _, h, w = RandomResizedCrop.get_params(torch.empty(1, height, width),
                                                  (0.08, 1.0), (3 / 4, 4 / 3))
        theirs.append((h * w / (height * width), w / h))
    ours, theirs = np.array(ours), np.array(theirs)
    assert ours[:, 0].min() >= 0.08 * 0.9 and ours[:, 0].max() <= 1.0
    # the same algorithm as torchvision: same distribution of areas and aspect ratios
    assert abs(ours[:, 0].mean() - theirs[:, 0].mean()) < 0.02
    assert abs(np.log(ours[:, 1]).std() - np.log(theirs[:, 1]).std()) < 0.02
    for q in (0.1, 0.5, 0.9):
        assert abs(np.quantile(ours[:, 0], q) - np.quantile(theirs[:, 0], q)) < 0.03


def test_shorter_side_boxes_are_squares_of_the_shorter_side_anywhere_along_the_longer():
    recipe = TrainRecipe(32, crop="shorter-side")
    for height, width in ((100, 160), (160, 100)):
        boxes = {recipe.plan(height, width, seed).box for seed in range(200)}
        long_side = max(height, width)
        offsets = {left if width > height else top for top, left, _, _ in boxes}
        # every box is the whole shorter side, square, inside the image
        assert {(h, w) for _, _, h, w in boxes} == {(100, 100)}
        assert {left if height > width else top for top, left, _, _ in boxes} == {0}
        assert min(offsets) == 0 and max(offsets) == long_side - 100 and len(offsets) > 40
    # a square image: the whole of it, as fastai's Resize gives
    assert {recipe.plan(64, 64, seed).box for seed in range(20)} == {(0, 0, 64, 64)}


def test_train_recipe_is_deterministic_per_seed_and_flips_half():
    recipe = TrainRecipe(32)
    assert recipe.plan(100, 80, 7) == recipe.plan(100, 80, 7)
    flips = [recipe.plan(100, 80, s).flip for s in range(1000)]
    assert 400 < sum(flips) < 600


def test_eval_crop_is_the_resize_then_centre_crop_box():
    assert center_crop_box(256, 512, 0.875) == (16, 144, 224, 224)
    assert EvalRecipe(224).plan(256, 512, 0) == Plan((16, 144, 224, 224), False, ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_to_device_normalises_like_torchvision(dtype):
    from torchvision.transforms.v2 import functional as F
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    expected = F.normalize(images.double() / 255, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # loaders stack NHWC; the result is NCHW for the model
    out, labels = ToDevice(InputFormat(torch.device("cpu"), dtype))(
        images.permute(0, 2, 3, 1).contiguous(), torch.arange(2))
    assert out.shape == (2, 3, 8, 8) and out.dtype == dtype and out.is_contiguous()
    assert torch.allclose(out.double(), expected, atol=1e-5) and labels.tolist() == [0, 1]


def test_to_device_takes_the_formats_statistics():
    """--mean 0,0,0 --std 1,1,1 (fastai's plain Learner): pixels in [0, 1]; any other statistics
    as torchvision's Normalize applies them."""
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    nhwc = images.permute(0, 2, 3, 1).contiguous()
    unit, _ = ToDevice(InputFormat(torch.device("cpu"), mean=(0.0,) * 3, std=(1.0,) * 3))(
        nhwc, torch.arange(2))
    assert torch.allclose(unit, images.float() / 255, atol=1e-6)
    mean, std = (0.5, 0.25, 0.0), (0.5, 2.0, 0.1)
    out, _ = ToDevice(InputFormat(torch.device("cpu"), mean=mean, std=std))(nhwc, torch.arange(2))
    from torchvision.transforms.v2 import functional as F
    assert torch.allclose(out, F.normalize(images.float() / 255, list(mean), list(std)),
                          atol=1e-5)


def test_nhwc_batches_become_channels_last_without_a_layout_copy():
    """The permute of an NHWC batch is already channels_last: the dtype conversion is the only
    copy, and it keeps the strides."""
    images = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    out, _ = ToDevice(InputFormat(torch.device("cpu"), channels_last=True))(images,
                                                                            torch.arange(2))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == (2, 3, 8, 8)
    nchw, _ = ToDevice(InputFormat(torch.device("cpu")))(images, torch.arange(2))
    assert torch.equal(out, nchw)


def quirk_image(tiny_sample, kind: str):
    """(path, the pixels the generator drew for it) for the CMYK / PNG / gray train image."""
    label = {"cmyk": 0, "png": 1, "gray": 2}[kind]
    spec = sample.PRESETS["tiny"]
    folder = tiny_sample / tables.TRAIN_DIR / sample.REAL_SYNSETS[label][0]
    # the quirky one is the class's first image: the smallest image number
    path = min(folder.iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    job = sample.ImageJob(str(path), label, (0, 1, label, 0), spec.classes, spec, kind)
    return path, sample.render(job)[0].astype(np.float64)


@pytest.mark.parametrize("kind, tolerance", [("png", 0.0), ("cmyk", 12.0), ("gray", 12.0)])
def test_quirky_images_decode_to_the_right_rgb(tiny_sample, kind, tolerance):
    path, drawn = quirk_image(tiny_sample, kind)
    decoded = to_rgb(open_image(path.read_bytes()))
    assert decoded.mode == "RGB" and decoded.size == (drawn.shape[1], drawn.shape[0])
    pixels = np.asarray(decoded, dtype=np.float64)
    if kind == "gray":
        drawn = np.asarray(Image.fromarray(drawn.astype(np.uint8)).convert("L").convert("RGB"),
                           dtype=np.float64)
    assert np.abs(pixels - drawn).mean() <= tolerance


@pytest.mark.parametrize("data, reason", [
    (b"", "empty file"), (b"hello, I am text", "not decodable"),
])
def test_undecodable_bytes_raise_bad_image(data, reason):
    with pytest.raises(BadImage, match=reason):
        to_rgb(open_image(data))


def test_truncated_jpeg_is_a_bad_image(tiny_sample):
    data = next((tiny_sample / tables.VAL_DIR).iterdir()).read_bytes()
    with pytest.raises(BadImage):
        to_rgb(open_image(data[: len(data) // 2]))


@pytest.mark.parametrize("auto_augment", ["off", "ta_wide", "ra", "imagenet"])
def test_loader_skips_and_reports_bad_images(tiny_copy, auto_augment):
    root = DatasetRoot("t", str(tiny_copy))
    frame = train_cls_list(root)
    broken = {frame.path[3]: b"", frame.path[10]: b"not an image"}
    for path, data in broken.items():
        (tiny_copy / path).write_bytes(data)
    (tiny_copy / frame.path[20]).unlink()
    broken[frame.path[20]] = None
    batches = ShardedBatches(len(frame), 64, seed=0)
    loader = build_loader(root, frame, TrainRecipe(24, auto_augment=auto_augment), batches,
                          workers=2)
    skipped, images, labels = [], 0, []
    for batch in loader:
        skipped += batch.skipped
        images += len(batch)
        labels.append(batch.labels)
        assert batch.images.dtype == torch.uint8 and batch.images.shape[1:] == (24, 24, 3)
    assert sorted(s.path for s in skipped) == sorted(broken)
    reasons = {s.path: s.reason for s in skipped}
    assert reasons[frame.path[20]] == "missing" and reasons[frame.path[3]] == "empty file"
    assert images == len(frame) - 3
    assert sorted(torch.cat(labels).tolist()) == sorted(frame.label.drop([3, 10, 20]).tolist())
    assert isinstance(skipped[0], Skipped)


def test_an_exception_without_a_message_makes_a_bad_image_not_a_crash(monkeypatch):
    """Some decoders raise errors whose str() is empty."""
    def refuse(*_args, **_kwargs):
        raise ValueError()
    monkeypatch.setattr(Image, "open", refuse)
    with pytest.raises(BadImage, match="not decodable: ValueError"):
        open_image(b"\xff\xd8 something")


class RecordRequests(torch.utils.data.Dataset):
    """Hands back what DataLoader asked this loader process for."""

    def __len__(self) -> int:
        return 103

    def __getitems__(self, request: BatchRequest) -> list:
        info = torch.utils.data.get_worker_info()
        return [(info.id if info else 0, request)]


@pytest.mark.parametrize("workers", [0, 2])
def test_read_ahead_announces_what_the_same_loader_process_gets_next(workers):
    """Real DataLoader processes: the batches are ShardedBatches' own, in order, and each one
    announces exactly the rows of the next two batches that its process is then handed."""
    batches = ShardedBatches(103, 10, seed=4)
    batches.set_epoch(3, start_step=1)
    loader = DataLoader(RecordRequests(), batch_sampler=ReadAhead(batches, workers),
                        num_workers=workers, collate_fn=lambda items: items[0],
                        multiprocessing_context="fork" if workers else None)
    got = list(loader)
    assert [request.items for _, request in got] == list(batches) and len(got) == 10
    for process in range(max(workers, 1)):
        mine = [request for worker, request in got if worker == process]
        for k, request in enumerate(mine):
            assert request.upcoming == [row for later in mine[k + 1:k + 3]
                                        for row, _ in later.items]


def test_dali_decoder_memory_is_per_thread_and_sized_for_each_split():
    train = decoder_memory("train", batch_size=256, threads=8)
    assert train.decoder_options() == {"device_memory_padding": 211_025_920,
                                       "host_memory_padding": 140_544_512}  # NVIDIA's
    # one GPU buffer and two pinned host buffers per thread: 1.69 GB and 2.25 GB
    assert (train.threads, train.device_bytes, train.pinned_bytes) == (8, 1_688_207_360,
                                                                       2_248_712_192)
    val = decoder_memory("val", batch_size=256, threads=8)  # DALI's 16 MiB and 8 MiB
    assert (val.threads, val.device_bytes, val.pinned_bytes) == (8, 128 * 2**20, 128 * 2**20)
    # threads beyond the batch's images would never decode: they get no buffers
    small = decoder_memory("val", batch_size=3, threads=8)
    assert (small.threads, small.device_bytes, small.pinned_bytes) == (3, 48 * 2**20,
                                                                       48 * 2**20)
    assert decoder_memory("train", batch_size=32, threads=0).threads == 1  # -j 0
    with pytest.raises(KeyError):
        decoder_memory("test", 32, 4)


def test_dalis_preallocation_hint_is_the_largest_of_a_sample_of_headers(tiny_copy):
    root = DatasetRoot("t", str(tiny_copy))
    paths = list(train_cls_list(root).path)
    sizes = {path: Image.open(tiny_copy / path).size for path in paths}
    everything = largest_image(root, paths, sample=len(paths))
    assert everything == (max(w for w, _ in sizes.values()), max(h for _, h in sizes.values()))
    chosen = random.Random(0).sample(paths, 20)  # the seeded sample: every worker's the same
    assert largest_image(root, paths, sample=20) == (max(sizes[p][0] for p in chosen),
                                                     max(sizes[p][1] for p in chosen))
    for path in chosen[:10]:  # unreadable files are passed over
        (tiny_copy / path).write_bytes(b"")
    assert largest_image(root, paths, sample=20) == (max(sizes[p][0] for p in chosen[10:]),
                                                     max(sizes[p][1] for p in chosen[10:]))
    for path in chosen[10:]:
        (tiny_copy / path).unlink()
    assert largest_image(root, paths, sample=20) == IMAGENET_LARGEST  # nothing to go by


@pytest.mark.parametrize("decoder", ["pillow", "dali"])
def test_a_resumed_pipeline_repeats_the_augmented_batch_exactly(tiny_sample, decoder):
    """Exact resume with auto-augment on: batch (epoch 1, step 2) of a pipeline started at the
    epoch's beginning and of a fresh one started at that step are the same to the bit."""
    if decoder == "dali":
        pytest.importorskip("nvidia.dali")
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = train_cls_list(root)
    spec = PipelineSpec(root, frame, TrainRecipe(32, auto_augment="ra", ra_magnitude=15),
                        ShardedBatches(len(frame), 32, seed=6), 1,
                        InputFormat(torch.device("cpu")))
    batches = []
    for start in (0, 2):
        pipeline = build_pipeline(decoder, spec)
        try:
            batches.append(list(itertools.islice(pipeline.epoch(1, start), 2 - start, 3 - start)))
        finally:
            pipeline.close()
    (straight,), (resumed,) = batches
    assert torch.equal(straight.labels, resumed.labels)
    assert torch.equal(straight.images, resumed.images)
