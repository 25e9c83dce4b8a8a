"""The run configuration: one typed dataclass tree, filled from defaults, a TOML file and flags
(flags > file > defaults: sources.py). Every parameter is declared once (type, default, help,
range check, aliases); its flag is its key (`optim.weight_decay` -> --weight-decay).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

Check = tuple[Callable[[Any], bool], str]  # (is the value allowed?, "must be ...")

# the input's default statistics (of pixels in [0, 1]): ImageNet's train set's
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def at_least(low: float) -> Check:
    return (lambda v: v >= low, f"must be at least {low:g}")


def positive() -> Check:
    return (lambda v: v > 0, "must be positive")


def between(low: float, high: float) -> Check:
    return (lambda v: low <= v < high, f"must be in [{low:g}, {high:g})")


def param(default, help: str, *aliases: str, choices: tuple | None = None,
          check: Check | None = None, flag: str = ""):
    """One declared parameter. Its flag is --<key> (or `flag`); `aliases` are further names
    (pytorch/examples' -a, -b, -j, --wd, ...); `check` is its range."""
    metadata = {"help": help, "aliases": aliases, "choices": choices, "check": check,
                "flag": flag}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class DataConfig:
    dataset: str = param("", "dataset name in the catalog (default: the catalog's `default`)")
    catalog: str = param("datasets.toml", "path of the dataset catalog (relative: to the "
                         "current folder, else to the project folder)")
    classes: int | list[str] = param(
        0, "class subset: a count (first N of the synset mapping) or comma-separated wnids; "
        "0 = all", check=(lambda v: not isinstance(v, int) or v >= 0,
                          "must be 0 (all), a positive count or a list of wnids"))
    image_size: int = param(0, "train and val crop size in pixels (sets both of "
                            "--train-crop-size and --val-crop-size); 0 = the dataset's "
                            "image_size, else 224", check=(lambda v: v >= 0, "must be 0 (auto) "
                                                           "or a positive size"))
    train_crop_size: int = param(0, "train crop size (RandomResizedCrop's output); 0 = "
                                 "--image-size", check=at_least(0))
    val_resize_size: int = param(0, "val: resize the shorter side to this, then centre-crop "
                                 "--val-crop-size; 0 = the crop / 0.875 (256 for 224)",
                                 check=at_least(0))
    val_crop_size: int = param(0, "val centre crop size; 0 = --image-size", check=at_least(0))
    # FFCV's progressive resizing (its resolution.min_res, max_res, start_ramp, end_ramp)
    progressive_start_size: int = param(
        0, "progressive resizing: train crop size up to --progressive-start-epoch (0 = off); "
        "then linear, rounded to multiples of 32, up to --progressive-end-size at "
        "--progressive-end-epoch. Epochs count from 0, as in FFCV; its ResNet-50 88-epoch "
        "config: 160, 192, 65, 76", check=at_least(0))
    progressive_end_size: int = param(0, "progressive resizing: the last train crop size",
                                      check=at_least(0))
    progressive_start_epoch: int = param(0, "progressive resizing: the epoch the ramp starts",
                                         check=at_least(0))
    progressive_end_epoch: int = param(0, "progressive resizing: the epoch the ramp reaches "
                                       "--progressive-end-size", check=at_least(0))
    train_index: str = param(
        "cls", "train image list: cls = ImageSets/CLS-LOC/train_cls.txt (all images), "
        "csv = LOC_train_solution.csv (boxed images only, ~42%%), listing = directory listing",
        choices=("cls", "csv", "listing"))
    decoder: str = param(
        "auto", "input pipeline: dali = NVIDIA DALI (the GPU's hardware JPEG decoder; on a CPU "
        "its CPU operators), nvjpeg = torchvision's batched nvJPEG decode on the training GPU "
        "(nothing to install; libjpeg-turbo on a CPU), pillow = Pillow in DataLoader "
        "processes, auto = on CUDA dali when DALI is installed, else nvjpeg; on a CPU pillow",
        choices=("auto", "dali", "nvjpeg", "pillow"))  # + DECODERS
    hw_decoder_load: float = param(
        1.0, "DALI on a GPU: share of each batch for the hardware JPEG decoder (1.0: every "
        "image it can take, independent of the batch)", check=(lambda v: 0 <= v <= 1,
                                                               "must be in [0, 1]"))
    workers: int = param(4, "data loading processes per device", "-j", check=at_least(0))
    mean: list[float] = param(list(IMAGENET_MEAN), "input normalisation: the R,G,B mean of "
                              "pixels in [0, 1] (timm's --mean); 0,0,0 with --std 1,1,1: "
                              "pixels in [0, 1], as fastai's plain Learner",
                              check=(lambda v: len(v) == 3, "must be 3 numbers: R,G,B"))
    std: list[float] = param(list(IMAGENET_STD), "input normalisation: the R,G,B standard "
                             "deviation (timm's --std)", check=(lambda v: len(v) == 3 and min(
                                 v) > 0, "must be 3 positive numbers: R,G,B"))
    max_bad_fraction: float = param(
        0.01, "stop when more than this share of an epoch's images cannot be read or decoded "
        "(they are skipped and listed in skipped.tsv)",
        check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"))


@dataclass(kw_only=True)
class AugmentConfig:
    """Training and evaluation recipes beyond the crop and flip of every image."""
    # which images an epoch takes, and how they are evaluated
    ra_sampler: bool = param(False, "whether to use Repeated Augmentation in training: an "
                             "epoch takes 1/ra_reps of the images, ra_reps times each, the "
                             "copies on different devices")
    ra_reps: int = param(3, "number of repetitions for Repeated Augmentation",
                         check=at_least(1))
    val_flip_tta: bool = param(False, "evaluate on the mean of the logits of each val image "
                               "and its horizontal mirror (FFCV's lr_tta)")
    # per-image, in the input pipeline
    crop_min_scale: float = param(
        0.08, "the smallest share of an image's area a training crop covers (RandomResizedCrop's "
        "scale, from this to 1; torchvision's 0.08; fastai's Imagenette scripts 0.35: a milder "
        "crop for a run of a few epochs)", check=(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    train_crop: str = param(
        "random-resized", "training crop: random-resized = RandomResizedCrop (--crop-min-scale "
        "of the area, aspect 3/4-4/3), shorter-side = a square of the image's shorter side at a "
        "random place along the longer one, resized (fastai's Resize: its Imagenette 128 px / "
        "5-epoch leaderboard entries; evaluate it with --val-resize-size equal to the crop)",
        choices=("random-resized", "shorter-side"))  # app/data/augment.py TRAIN_CROPS
    auto_augment: str = param(
        "off", "auto augment policy: ta_wide = TrivialAugmentWide, ra = RandAugment (2 ops), "
        "imagenet = AutoAugment's ImageNet policy, off",
        choices=("off", "ta_wide", "ra", "imagenet"))  # app/data/auto_augment.py AUTO_AUGMENT
    ra_magnitude: int = param(9, "magnitude of auto augment policy (RandAugment's bin of 31)",
                              check=(lambda v: 0 <= v <= 30, "must be in [0, 30]"))
    # per-batch, on the device
    random_erase: float = param(
        0.0, "random erasing probability (per image, on the normalised batch)",
        check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"))
    mixup_alpha: float = param(0.0, "mixup alpha (0 = off)", check=at_least(0))
    cutmix_alpha: float = param(0.0, "cutmix alpha (0 = off; with --mixup-alpha: one of the "
                                "two per batch)", check=at_least(0))


@dataclass(kw_only=True)
class ModelConfig:
    arch: str = param(
        "resnet34", "model name: any timm name (resnet18/34/50/101/152, ...), resnet18_small "
        "(3x3 stem, no max-pool, for low-resolution images) or xse_resnext_mini (the SE-ResNeXt "
        "with one block a stage of Imagenette's 128 px / 5-epoch row)", "-a")
    norm: str = param("batch", "normalisation layers: batch (BatchNorm) or group (GroupNorm, "
                      "independent of the batch split)", choices=("batch", "group"))
    # timm's own model options (app/models/factory.py)
    drop_path: float = param(0.0, "stochastic depth: timm's drop_path_rate, the drop rate of "
                             "the last block (rising linearly from 0 over the blocks)",
                             check=between(0, 1))
    model_kwargs: list[str] = param(
        [], "comma-separated key=value options for timm.create_model, values read as Python "
        "literals where they are (0.1, True, None), else strings: aa_layer=blurpool for "
        "BlurPool after each strided convolution (timm's placement; FFCV blurs before it). "
        "timm's ResNets start each block's last BatchNorm at zero (zero_init_last=True)",
        check=(lambda v: all("=" in item for item in v), "must be key=value items"))
    pretrained: str = param("", "start from these weights (a checkpoint, an export folder, a "
                            "timm/torchvision state dict .pth or .safetensors; a path or any "
                            "fsspec URL): a new run, a head of another class count re-initialised")
    # The loss sits with the model options, as timm's recipes group it.
    bce_loss: bool = param(False, "timm's BinaryCrossEntropy (its A1-A3 recipes) instead of "
                           "cross-entropy; --label-smoothing and mixup/cutmix targets as "
                           "timm's train.py feeds it")
    bce_target_thresh: float = param(0.0, "with --bce-loss: targets above this become 1, the "
                                     "rest 0 (timm's bce_target_thresh; 0 = off)",
                                     check=between(0, 1))


@dataclass(kw_only=True)
class OptimConfig:
    optimizer: str = param(
        "sgd", "optimizer: sgd, adamw, lars (timm's; for large global batches, e.g. MLPerf's "
        "ResNet-50: LARS, 5 warmup epochs, label smoothing 0.1, eps 0, trust coefficient "
        "0.001), lamb (timm's, with its gradient-norm clip at 1.0; --momentum is beta1), "
        "ranger (fastai's: Lookahead around RAdam, decoupled decay; --momentum is beta1)",
        choices=("sgd", "adamw", "lars", "lamb", "ranger"))
    lr: float = param(0.1, "learning rate per 256 images; scaled by the global batch size",
                      check=positive())
    momentum: float = param(0.9, "SGD momentum (AdamW: beta1)", check=between(0, 1))
    nesterov: bool = param(False, "Nesterov momentum for SGD")
    weight_decay: float = param(
        1e-4, "weight decay (not applied to normalisation and bias parameters)", "--wd",
        check=at_least(0))
    norm_weight_decay: float = param(0.0, "weight decay of normalisation layers' parameters "
                                     "(torchvision's flag; here 0 by default: no decay, and "
                                     "no LARS/LAMB adaptation)", check=at_least(0))
    bias_weight_decay: float = param(0.0, "weight decay of the other layers' biases (0 by "
                                     "default, as for norms)", check=at_least(0))
    clip_grad_norm: float = param(0.0, "clip the global L2 norm of the averaged gradients to "
                                  "this (0 = off; the norm stays on the device)",
                                  check=at_least(0))
    label_smoothing: float = param(0.0, "label smoothing of the cross-entropy loss",
                                   check=between(0, 1))
    schedule: str = param(
        "cosine", "LR schedule after warmup: cosine (to --lr-min), step, poly (polynomial "
        "decay of power --lr-poly-power to --lr-min: MLPerf's LARS schedule), or ffcv = FFCV's "
        "'cyclic' schedule (linear from 1e-4 x LR to the LR at --lr-peak-epoch, then linear to "
        "zero at the last epoch, per step; its ramp replaces the warmup)",
        choices=("cosine", "step", "poly", "ffcv"))
    warmup_epochs: float = param(5.0, "warmup length in epochs", "--lr-warmup-epochs",
                                 check=at_least(0))
    lr_warmup_method: str = param("linear", "warmup: linear (from --lr-warmup-decay x LR up to "
                                  "the LR) or constant (--lr-warmup-decay x LR; at 1 before "
                                  "a cosine: fastai's flat-then-cosine)",
                                  choices=("linear", "constant"))
    lr_warmup_decay: float = param(0.0, "the warmup's starting factor (torchvision: 0.01; 0 = "
                                   "linear from the first step's share, as before)",
                                   check=(lambda v: 0 <= v <= 1, "must be in [0, 1]"))
    lr_min: float = param(0.0, "cosine and poly schedules: the LR they end at (torchvision's "
                          "--lr-min; MLPerf's end learning rate)",
                          check=at_least(0))
    lr_poly_power: float = param(2.0, "poly schedule: the power of the decay (MLPerf: 2)",
                                 check=positive())
    lr_peak_epoch: float = param(2.0, "ffcv schedule: the epoch the LR peaks at (FFCV: 2)",
                                 check=at_least(0))
    step_epochs: int = param(30, "step schedule: decay every N epochs", check=at_least(1))
    step_gamma: float = param(0.1, "step schedule: decay factor")


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = param(90, "number of full passes over the train set", check=at_least(1))
    batch_size: int = param(
        256, "batch size PER DEVICE; the global batch is this times the number of devices",
        "-b", check=at_least(1))
    accum_steps: int = param(
        1, "gradient accumulation: micro-batches of --batch-size per optimizer step, gradients "
        "exchanged once per step; the effective global batch (which scales the LR) is batch "
        "size x devices x this", check=at_least(1))
    keep_global_batch: bool = param(
        True, "resumed on another number of devices, keep the checkpoint's global batch and "
        "sample order by choosing the per-device batch and --accum-steps for it (the rule: "
        "docs/reliability.md); --no-keep-global-batch trains on with -b and --accum-steps as "
        "given, a new global batch, from a checkpoint at an epoch's end only")
    # torchvision's names and semantics (app/training/ema.py)
    model_ema: bool = param(False, "keep an exponential moving average of the weights (and "
                            "buffers), evaluated beside them every epoch (val_ema/*); costs one "
                            "more copy of the model in device memory")
    model_ema_steps: int = param(32, "update the EMA every N optimizer steps",
                                 check=at_least(1))
    model_ema_decay: float = param(0.99998, "EMA decay per image-normalised update, adjusted "
                                   "as torchvision does for --model-ema-steps, the global batch "
                                   "and the epochs", check=between(0, 1))
    seed: int = param(0, "seed for weights, data order and augmentation")
    print_freq: int = param(10, "log train metrics every N steps", "-p", check=at_least(1))
    device: str = param("auto", "device: auto (cuda if present), cpu, cuda, cuda:N")
    amp: str = param("auto", "mixed precision: auto = bf16 on CUDA and on a CPU with bf16 "
                     "instructions (AVX512-BF16, AMX), off on other CPUs; fp16 adds "
                     "loss scaling, whose overflow check stays on the device (fused optimizer "
                     "step), so neither waits for the GPU each step",
                     choices=("auto", "bf16", "fp16", "off"))
    channels_last: bool = param(True, "channels_last memory format on CUDA, and with bf16 on a "
                                "CPU")
    dtype: str = param("float32", "parameter dtype; float64 is for numerical checks",
                       choices=("float32", "float64"))
    compile: str = param("auto", "torch.compile the model: auto = on CUDA only (the first "
                         "step's compile time is logged), on, off",
                         choices=("auto", "on", "off"))
    compile_backend: str = param("inductor", "torch.compile backend (aot_eager: no code "
                                 "generation, for quick checks)")
    cudnn_benchmark: bool = param(True, "let cuDNN time its algorithms once per input size "
                                  "(CUDA)")
    tf32: bool = param(True, "TF32 tensor cores for float32 matmuls and convolutions (CUDA); "
                       "--no-tf32 for full float32 precision")


@dataclass(kw_only=True)
class ParallelConfig:
    gpus: int = param(0, "train on this many GPUs (cuda:0..N-1), one worker process each",
                      check=at_least(0))
    devices: list[str] = param(
        [], "explicit worker devices, repeats allowed: cuda:0,cuda:1 or cpu,cpu")
    # How the replicas run; the sync below is how they agree.
    replicas_as: str = param(
        "auto", "replicas as processes (one worker process per device, plus the parameter "
        "server's) or threads (one thread per device in this process, the parameter server a "
        "thread too: nothing is pickled; no compile, no all-reduce, no --max-restarts); auto "
        "= processes from bin/driver.py, threads from Python (app.train)",
        choices=("auto", "processes", "threads"))
    sync: str = param(
        "auto", "gradient sync: ps = parameter server (one machine), allreduce = "
        "torch.distributed DDP (also under torchrun); auto = ps, or allreduce under torchrun",
        choices=("auto", "ps", "allreduce"))  # app/parallel/plans.py SYNC_MODES
    bucket_mb: float = param(25.0, "gradient bucket size in MB (ps and allreduce)",
                             check=positive())
    check_every: int = param(200, "compare replica weight checksums every N steps",
                             check=at_least(1))
    sync_timeout: float = param(
        1800.0, "give up when a live peer has not answered for this long (seconds)",
        check=positive())


@dataclass(kw_only=True)
class RunConfig:
    # --name alone would not say whose name: the flag carries the section.
    name: str = param("", "run name; outputs go to OUTPUT_DIR/NAME (default: dataset-arch-time)",
                      flag="--run-name")
    output_dir: str = param("runs", "folder that holds the run folders")
    resume: str = param("", "checkpoint to resume from, or `auto` = last.pt of this run")
    evaluate: bool = param(False, "only evaluate the model (from --resume) on the val set", "-e")
    use_ema: bool = param(False, "with -e: evaluate the checkpoint's EMA weights")
    # A failure costs the steps since the newest checkpoint: at most this long (or an epoch).
    checkpoint_interval: float = param(
        30.0, "also save a checkpoint every this many minutes (mid-epoch; 0 = epoch ends only)",
        check=at_least(0))
    keep_checkpoints: int = param(3, "keep the newest N step-*.pt checkpoints (last.pt and "
                                  "best.pt are names of kept files)", check=at_least(1))
    max_restarts: int = param(
        0, "after a worker or the parameter server dies, stop every process and start them "
        "again from the newest checkpoint, at most this many times (under torchrun: use "
        "torchrun --max-restarts)", check=at_least(0))
    stop_timeout: float = param(
        120.0, "after SIGTERM/SIGINT, wait this many seconds for the checkpoint before killing "
        "the workers (a second signal kills at once)", check=at_least(0))


@dataclass(kw_only=True)
class LoggingConfig:
    loggers: list[str] = param(
        ["console"], "comma-separated loggers: console, tensorboard, wandb (metrics.jsonl and "
        "curves.png are always written)", "--logger",
        choices=("console", "tensorboard", "wandb"))  # app/loggers LOGGERS
    wandb_project: str = param("", "wandb project (default: $WANDB_PROJECT, else imagenet-dp)")
    wandb_entity: str = param("", "wandb entity, a user or team (default: $WANDB_ENTITY)")
    wandb_mode: str = param("", "wandb mode (default: $WANDB_MODE, else online)",
                            choices=("", "online", "offline", "disabled"))
    wandb_tags: list[str] = param([], "comma-separated wandb tags (default: $WANDB_TAGS)")
    log_samples: bool = param(False, "record which train images every batch of every worker "
                              "was made of, in samples/rank-R.jsonl in the run folder (a short "
                              "line per batch and worker; each start in samples/starts.jsonl)")
    save_weights_every: int = param(
        0, "log the newest checkpoint as a wandb artifact every N epochs; 0 = never",
        check=at_least(0))


@dataclass(kw_only=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))
RENAMED = {"parallel.timeout_s": "parallel.sync_timeout"}  # config files of earlier versions
