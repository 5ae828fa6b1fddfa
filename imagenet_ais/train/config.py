"""What a training run is asked to do: ``TrainConfig`` (train.py's options and their defaults)
and what follows from it alone."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.shard_loader import MAX_IMAGE_SIZE
from imagenet_ais.storage import check_location


@dataclass
class TrainConfig:
    data: str | None = None  # a shard location holding manifest.json (or --synthetic); a mixture's first
    mix: tuple[str, ...] = ()  # several shard locations mixed, each "LOCATION[:WEIGHT]" (loader/mixture.py)
    val_data: str | None = None  # the location to validate on (None: data)
    recipe: str | None = None  # a name of RECIPES: its settings for the options not given
    output: str = "runs/train"
    arch: str = "resnet50"
    epochs: int = 90
    batch_size: int = 256
    lr: float = 0.1  # for a global batch of 256, scaled linearly
    warmup_epochs: float = 5.0
    opt: str = "sgd"  # one of OPTIMIZERS
    lr_scheduler: str = "cosine"  # after the warmup, one of SCHEDULES
    lr_step_size: int = 30  # --lr-scheduler step: epochs between drops
    lr_gamma: float = 0.1  # --lr-scheduler step: each drop's factor
    momentum: float = 0.9
    weight_decay: float = 1e-4
    norm_weight_decay: float = 0.0  # of norm layers' parameters and biases (every 1-d parameter)
    label_smoothing: float = 0.1
    mixup_alpha: float = 0.0  # > 0: Mixup on the device batches (mixup.py)
    cutmix_alpha: float = 0.0  # > 0: CutMix; with both, one of the two per batch
    auto_augment: str | None = None  # a policy of augment.POLICIES, per training sample after its crop
    random_erase: float = 0.0  # probability of erasing a box of a training sample (augment.py)
    model_ema: bool = False  # keep an exponential moving average of the weights, validated and saved too
    model_ema_steps: int = 32  # steps between EMA updates
    model_ema_decay: float = 0.99998  # per image of a 256-batch epoch scale, adjusted as torchvision's recipe does
    model_ema_best: bool = False  # best.pt chosen on the EMA's top-1 rather than the model's
    clip_grad_norm: float | None = None  # clip the gradients' global L2 norm to this
    sync_bn: bool = False  # BatchNorm statistics over all ranks (GPUs)
    weights: str | None = None  # start from this state dict or checkpoint file (a --resume checkpoint wins)
    test_only: bool = False  # only validate the model (--weights or --resume) on the val split, then stop
    workers: int | None = None  # None = auto: the node's CPUs per local rank (distributed.auto_workers)
    image_size: int = 224
    progressive: str | None = None  # "START:END": train size grows over epochs (steps of 32)
    val_size: int | None = None  # default: END with --progressive, else image_size
    val_resize_size: int | None = None  # validation resizes the short side to this, then takes the centre val_size
    amp: str = "auto"  # auto = bf16 on GPU, off on CPU
    channels_last: bool | None = None  # None = on for GPU
    compile: bool | None = None  # None = on for GPU (off with --dp decent)
    compile_mode: str | None = None  # torch.compile mode; None = reduce-overhead (CUDA graphs) on GPU
    decode: str = "auto"  # "gpu": nvJPEG on the device (device_decode.py); "dali": dali_decode.py; auto = gpu on CUDA
    cpu_share: float | str = "auto"  # with gpu/dali, of training's samples cropped in the workers (cpu_share.py)
    dp: str = "ddp"  # or "decent": decentralized data parallel (decentralized.py)
    topology: str = "ring"  # --dp decent: who mixes with whom at each step
    seed: int = 0
    resume: str | None = None
    max_steps: int | None = None
    synthetic: bool = False
    epoch_mode: str = "resampled"
    epoch_size: int | None = None  # resampled: samples per epoch, whatever the manifest holds (None: its count)
    shuffle_buffer: int = 2000
    data_timeout: float = 600.0  # seconds a step may wait for a batch before the run stops (exit 4)
    # seconds a rank may wait for the others at one place (a step, a gather) before all stop (exit 6); 0: no bound
    collective_timeout: float = 600.0
    max_bad: float = 0.01  # of an epoch's samples, skipped or padded, before the run stops
    log_every: int = 20
    log_keys: bool = False
    trackers: tuple[str, ...] = ("tensorboard",)  # where records go besides metrics.jsonl (trackers.TRACKERS)
    upload: str | None = None  # gs://, s3://, ais:// or a directory: checkpoints, metrics and log go here too
    checkpoint_every: int | None = None  # steps, besides every epoch end
    keep_last: int = 3  # step checkpoints kept in --output
    upload_retry_seconds: float = 120.0
    flush_timeout: float = 600.0  # at exit, wait this long for pending uploads
    cache_dir: str | None = None  # keep remote shards here (one cache per node, shared by its ranks)
    cache_size: int | None = None  # bytes the cache may hold; None = no bound
    # where settings came from: "option" (given to train.py), "launcher" (./run's own defaults,
    # which a recipe overrides) or "recipe NAME"; a value other than the default counts as given
    sources: dict[str, str] = dataclasses.field(default_factory=dict)


# sgd: with Nesterov momentum (plain where --momentum is 0); rmsprop with torchvision's settings.
# (LAMB and LARS are not in torch.optim.)
TIMM_OPTIMIZERS = ("lamb", "lars")  # timm's (the timm extra)
OPTIMIZERS = ("sgd", "adamw", "rmsprop", *TIMM_OPTIMIZERS)
# cosine to zero, step (× --lr-gamma every --lr-step-size epochs), onecycle (torch's OneCycleLR
# shape: a cosine rise over the warmup from 1/25 of the peak, then a cosine fall to 1/250,000)
SCHEDULES = ("cosine", "step", "onecycle")
SCHEDULE_NAMES = {"cosineannealinglr": "cosine", "steplr": "step", "onecyclelr": "onecycle"}  # torchvision's, torch's

RECIPES: dict[str, dict[str, Any]] = {
    # FFCV's ResNet-50 settings (its 16-88 epoch configs): 1.7 at a global batch of 1,024, peak at
    # epoch 2, low resolution first (160 -> 192 px), validation at 256, label smoothing, no mixing
    "fast": {
        "epochs": 16, "lr": 0.425, "warmup_epochs": 2.0, "label_smoothing": 0.1, "progressive": "160:192",
        "val_size": 256,
    },
    # torchvision's IMAGENET1K_V2 ResNet-50 recipe (80.9% top-1): LR 0.5 at 1,024, train at 176 px,
    # validate at 224 of 232; its repeated-augmentation sampler is not here
    "v2": {
        "epochs": 600, "lr": 0.125, "warmup_epochs": 5.0, "weight_decay": 2e-5, "label_smoothing": 0.1,
        "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "auto_augment": "ta_wide", "random_erase": 0.1, "model_ema": True,
        "model_ema_steps": 32, "model_ema_decay": 0.99998, "image_size": 176, "val_size": 224, "val_resize_size": 232,
    },
}  # fmt: skip


def check(cfg: TrainConfig) -> None:
    """Refuses, in one line, settings no run can train with (train.py's options and TrainConfig alike)."""
    if not cfg.output:
        raise ConfigError("--output '': name a folder for the run's checkpoints, metrics and logs")
    for location in filter(None, (cfg.data, *cfg.mix, cfg.val_data)):
        check_location(location)  # (before config.json and the log repeat it)
    if cfg.test_only and not (cfg.weights or cfg.resume):
        raise ConfigError("--test-only: nothing to test; give --weights or --resume (a checkpoint)")
    numbers = ("lr", "weight_decay", "norm_weight_decay", "momentum", "lr_gamma", "upload_retry_seconds")
    for name in (*numbers, "flush_timeout", "warmup_epochs"):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: give a finite number, 0 or more")
    if cfg.opt not in OPTIMIZERS:
        raise ConfigError(f"--opt {cfg.opt!r}: one of {', '.join(OPTIMIZERS)} (lamb and lars: timm's)")
    if cfg.lr_scheduler not in SCHEDULES:
        raise ConfigError(f"--lr-scheduler {cfg.lr_scheduler!r}: one of {', '.join(SCHEDULES)}")
    if cfg.lr_step_size < 1:
        raise ConfigError(f"--lr-step-size {cfg.lr_step_size}: give a number of epochs, 1 or more")


def _changed(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg`` other than train.py's defaults (``sources`` is no setting)."""
    defaults = TrainConfig()
    return {
        f.name: value
        for f in dataclasses.fields(cfg)
        if f.name != "sources" and (value := getattr(cfg, f.name)) != getattr(defaults, f.name)
    }


def given(cfg: TrainConfig) -> set[str]:
    """The settings the user chose: options given, and values other than the defaults, except a
    launcher's own defaults."""
    chosen = {name for name, source in cfg.sources.items() if source == "option"}
    return chosen | {name for name in _changed(cfg) if name not in cfg.sources}


def with_recipe(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its ``--recipe``'s settings for what the user did not choose (a recipe's
    ``--progressive`` gives way to a chosen ``--image-size``, and its image size to a chosen
    ``--progressive``); ``sources`` says which came from it."""
    chosen = given(cfg)
    if {"image_size", "progressive"} <= chosen and cfg.progressive:
        raise ConfigError(
            f"--image-size {cfg.image_size} with --progressive {cfg.progressive}: the sizes come from START:END; "
            "leave one out"
        )
    if cfg.recipe is None:
        return cfg
    if cfg.recipe not in RECIPES:
        raise ConfigError(f"--recipe {cfg.recipe!r}: one of {', '.join(RECIPES)}")
    sizes = {"image_size", "progressive"}
    settings = {k: v for k, v in RECIPES[cfg.recipe].items() if k not in chosen and not (k in sizes and sizes & chosen)}
    sources = {**cfg.sources, **dict.fromkeys(settings, f"recipe {cfg.recipe}")}
    return dataclasses.replace(cfg, **settings, sources=sources)


def differences(cfg: TrainConfig) -> dict[str, list[str]]:
    """What this run sets other than train.py's defaults, by where it came from: {"recipe fast":
    ["epochs=16", ...], "option": [...], "launcher": [...], "set": [...] (from Python)}."""
    by_source: dict[str, list[str]] = {}
    for name, value in _changed(cfg).items():
        by_source.setdefault(cfg.sources.get(name, "set"), []).append(f"{name}={value}")
    return by_source


def image_sizes(cfg: TrainConfig) -> tuple[list[int], int]:
    """Training image size per epoch, and the validation size.

    With ``--progressive START:END`` the size grows linearly over the epochs from START to
    END, rounded down to steps of 32 from START, and the last epoch trains at END (the
    low-resolution-first recipe of "ImageNet in 18 minutes", fast.ai and FFCV).
    """
    if not cfg.progressive:
        return [cfg.image_size] * cfg.epochs, cfg.val_size or cfg.image_size
    start_end = cfg.progressive.split(":")
    if (
        len(start_end) != 2
        or not all(p.isascii() and p.isdigit() for p in start_end)
        or not 16 <= int(start_end[0]) <= int(start_end[1]) <= MAX_IMAGE_SIZE
    ):
        raise ConfigError(
            f"--progressive {cfg.progressive!r}: give START:END with 16 <= START <= END <= {MAX_IMAGE_SIZE}, "
            "e.g. 160:224"
        )
    start, end = map(int, start_end)
    steps = max(1, cfg.epochs - 1)
    sizes = [start + (end - start) * e // steps // 32 * 32 for e in range(cfg.epochs)]
    if cfg.epochs > 1:
        sizes[-1] = end
    return sizes, cfg.val_size or end
