"""What a training run is asked to do: ``TrainConfig`` (train.py's options and their defaults)
and what follows from it alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    data: str | None = None  # a shard location holding manifest.json (or --synthetic)
    output: str = "runs/train"
    arch: str = "resnet50"
    epochs: int = 90
    batch_size: int = 256
    lr: float = 0.1  # for a global batch of 256, scaled linearly
    warmup_epochs: float = 5.0
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    mixup_alpha: float = 0.0  # > 0: Mixup on the device batches (recipe.py)
    cutmix_alpha: float = 0.0  # > 0: CutMix; with both, one of the two per batch
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
    decode: str = "auto"  # "gpu": nvJPEG + crop/resize on the device (see transforms.py); auto = gpu on CUDA
    dp: str = "ddp"  # or "decent": decentralized data parallel (decentralized.py)
    topology: str = "ring"  # --dp decent: who mixes with whom at each step
    seed: int = 0
    resume: str | None = None
    max_steps: int | None = None
    synthetic: bool = False
    epoch_mode: str = "resampled"
    shuffle_buffer: int = 2000
    max_bad: float = 0.01  # of an epoch's samples, skipped or padded, before the run stops
    log_every: int = 20
    log_keys: bool = False
    upload: str | None = None  # gs://, ais:// or a directory: checkpoints, metrics and log go here too
    checkpoint_every: int | None = None  # steps, besides every epoch end
    keep_last: int = 3  # step checkpoints kept in --output
    upload_retry_seconds: float = 120.0
    flush_timeout: float = 600.0  # at exit, wait this long for pending uploads
    cache_dir: str | None = None  # keep remote shards here (one cache per node, shared by its ranks)
    cache_size: int | None = None  # bytes the cache may hold; None = no bound


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
        or not all(p.isdigit() for p in start_end)
        or not 16 <= int(start_end[0]) <= int(start_end[1])
    ):
        raise ValueError(f"--progressive {cfg.progressive!r}: give START:END with 16 <= START <= END, e.g. 160:224")
    start, end = map(int, start_end)
    steps = max(1, cfg.epochs - 1)
    sizes = [start + (end - start) * e // steps // 32 * 32 for e in range(cfg.epochs)]
    if cfg.epochs > 1:
        sizes[-1] = end
    return sizes, cfg.val_size or end
