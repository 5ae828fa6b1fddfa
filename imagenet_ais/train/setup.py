"""What one training run works with, built once before its first step: the output directory,
the loaders, the model and its optimizer (``Parts``), then, once the run knows where it resumes,
the schedule, the stepping model, logs, uploads and signal handling (``Run``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import signal
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from imagenet_ais import distributed
from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.augment import Augment
from imagenet_ais.loader.cpu_share import AUTO
from imagenet_ais.loader.engine import nominal_steps
from imagenet_ais.loader.failures import ShuffleWarning
from imagenet_ais.loader.mixture import parse_source
from imagenet_ais.loader.shard_loader import ShardLoader
from imagenet_ais.loader.synthetic import SYNTHETIC_CLASSES, SYNTHETIC_STEPS, SyntheticLoader
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.storage import open_store
from imagenet_ais.train import checkpoint, keys_log, model, upload
from imagenet_ais.train.collector import Collector
from imagenet_ais.train.config import TrainConfig
from imagenet_ais.train.data_cost import DataCost
from imagenet_ais.train.data_health import DataHealth
from imagenet_ais.train.ema import ModelEma, ema_decay
from imagenet_ais.train.metrics import MetricsLog, logs, voice
from imagenet_ais.train.mixup import Mixer, batch_mixer
from imagenet_ais.train.resume import TrainState
from imagenet_ais.train.slow_rank import EpochFigures
from imagenet_ais.train.trackers import open_trackers
from imagenet_ais.train.watchdog import Watchdog, watchable


class StopSignal:
    """SIGTERM / SIGUSR1 (preemption, Slurm's warning) / SIGINT (Ctrl-C): finish the step, save,
    upload, exit. A second Ctrl-C stops at once, unsaved (KeyboardInterrupt, as Python's own).

    Only a main thread can take signals; where training runs in another (a Ray Train worker),
    the framework's side sets ``requested`` instead, which counts as SIGTERM.
    """

    GRACE = 60.0  # seconds one wait for a batch may last after a signal with several ranks (they stop together)

    def __init__(self, world: int = 1, requested: threading.Event | None = None, says: bool = True) -> None:
        self._received: int | None = None
        self.world, self.requested, self.says = world, requested, says  # says: the rank that tells Ctrl-C's plan
        main = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) if main else ()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in sigs}

    @property
    def received(self) -> int | None:
        """The signal that asked the run to stop, if one did."""
        if self._received is None and self.requested is not None and self.requested.is_set():
            self._received = signal.SIGTERM
        return self._received

    def _handle(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            if self._received == signal.SIGINT:
                raise KeyboardInterrupt  # (the second Ctrl-C: at once)
            if self.says:  # (os.write: a print here could land inside another print's write)
                os.write(2, b"Ctrl-C: stopping after this step, with a checkpoint; again stops at once, unsaved\n")
        self._received = signum

    def stop_waiting(self, waited: float) -> bool:
        """Whether a wait for data that has lasted ``waited`` seconds ends now: signalled, and alone,
        or this wait past the grace (a rank whose data never comes cannot join the others'
        checkpoint; they would wait for it forever, while a short wait ends at the next agreement)."""
        if self.received is None:
            return False
        return self.world == 1 or waited > self.GRACE

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass
class Parts:
    """What a run is made of before it knows where it resumes."""

    cfg: TrainConfig
    process: distributed.Process
    output: Path
    echo: Callable[..., None]
    train_loader: ShardLoader | SyntheticLoader
    val_loader: ShardLoader | None
    classes: list[str]
    health: DataHealth
    raw_model: nn.Module  # the weights, as saved
    new_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    decent: bool  # --dp decent over several processes
    compiled: bool
    ema: ModelEma | None  # --model-ema

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.process.world

    @property
    def loaders(self) -> list[ShardLoader | SyntheticLoader]:
        """The train loader, and the val loader where there is one."""
        return [self.train_loader] if self.val_loader is None else [self.train_loader, self.val_loader]

    def close(self) -> None:
        """The loaders' workers and feed threads ended: a run leaves no process of its own behind."""
        for loader in self.loaders:
            if isinstance(loader, ShardLoader):
                loader.close()


@dataclass
class Run(Parts):
    """A run ready to step."""

    train_state: TrainState
    model: nn.Module  # what steps: raw_model wrapped (DDP or --dp decent) and maybe compiled
    criterion: nn.Module
    mixer: Mixer | None  # --mixup-alpha, --cutmix-alpha
    scheduler: torch.optim.lr_scheduler.LambdaLR
    log: MetricsLog
    uploader: upload.Uploader | None
    stop: StopSignal
    cost: DataCost  # what the data cost, per epoch and for the run
    figures: EpochFigures  # this rank's figures over the epoch, to find the rank that held the others back
    watchdog: Watchdog | None  # ends every rank where one never reaches the others (several ranks)
    nonfinite_steps: int = 0  # the last steps in a row whose loss was NaN or infinite (on any rank)
    validating: bool = False  # in validate_epoch's evaluations: what a loader's failure is said of
    collector: Collector = field(default_factory=Collector)  # what the process holds, frozen past the first steps


def prepare(cfg: TrainConfig, process: distributed.Process) -> Path:
    """The output directory (rid of what a killed run left mid-write), seeds and cuDNN set."""
    output = Path(cfg.output)
    fresh = cfg.resume is None and not cfg.test_only
    # rank 0's view: with node-local outputs the other ranks' are empty, and all must stop alike
    if fresh and (held := distributed.broadcast_object(held_run(output, cfg) if process.main else None)):
        raise ConfigError(held)
    output.mkdir(parents=True, exist_ok=True)
    if process.main:
        checkpoint.sweep_partials(output)
    random.seed(cfg.seed + process.rank)
    torch.manual_seed(cfg.seed + process.rank)
    if process.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    return output


def held_run(output: Path, cfg: TrainConfig) -> str | None:
    """Why a fresh run must not start here, or None: a run is there to continue, whose checkpoints
    it would overwrite, or whose uploaded metrics, log and ``latest.json`` it would replace."""
    if found := checkpoint.held(output):
        return f"{output} holds a run ({found}): continue it with --resume auto, or use another --output"
    if not cfg.upload:
        return None
    try:
        pointer = upload.latest(open_store(cfg.upload, retry_seconds=cfg.upload_retry_seconds))
    except upload.BadPointer as e:  # something is there: not to be replaced unseen
        return str(e)
    except Exception as e:  # each SDK has its own errors; training need not wait: uploads are retried anyway
        print(
            f"warning: {cfg.upload}: not checked for an earlier run's uploads ({type(e).__name__}: {e}): "
            "if it holds one, this run replaces its latest.json, metrics and log",
            file=sys.stderr,
        )
        return None
    if pointer:
        return (
            f"{cfg.upload} holds a run's uploads ({upload.POINTER} names {pointer.get('checkpoint')}): "
            "continue it with --resume auto, or use another --upload"
        )
    return None


def claimed(cfg: TrainConfig, run_id: str) -> str | None:
    """Why this run must not upload to --upload (another run's location), or None; claimed for
    this run now where it can be (else by its first upload)."""
    if not cfg.upload:
        return None
    try:
        upload.claim(open_store(cfg.upload, retry_seconds=cfg.upload_retry_seconds), run_id)
    except upload.Claimed as e:
        return str(e)
    except Exception as e:  # each SDK has its own errors; uploads claim it before they go anyway
        print(f"warning: {cfg.upload}: not claimed for this run yet ({type(e).__name__}: {e})", file=sys.stderr)
    return None


def loaders(
    cfg: TrainConfig,
    process: distributed.Process,
    sizes: list[int],
    val_size: int,
    channels_last: bool,
    echo: Callable[..., None],
) -> tuple[ShardLoader | SyntheticLoader, ShardLoader | None, list[str], str]:
    """The training and validation loaders, the class names, and how the data is fed (for the
    run's first line)."""
    if cfg.synthetic:
        classes = [str(i) for i in range(SYNTHETIC_CLASSES)]
        steps = nominal_steps(cfg.epoch_size, process.world, cfg.batch_size) if cfg.epoch_size else SYNTHETIC_STEPS
        synthetic = SyntheticLoader(cfg.batch_size, sizes[0], process.device, channels_last, steps)
        return synthetic, None, classes, "synthetic data"
    if not cfg.data:
        raise ConfigError("no --data given: point it at a shard location holding manifest.json, or use --synthetic")
    if cfg.decode in ("gpu", "dali") and process.device.type != "cuda":
        echo(f"note: --decode {cfg.decode} without a GPU decodes in the training process, on the CPU", err=True)
    val_at = cfg.val_data or cfg.data
    manifest = load_manifest(open_store(val_at))
    loader = functools.partial(
        ShardLoader, batch_size=cfg.batch_size, rank=process.rank, world_size=process.world,
        decode=cfg.decode, device=process.device, workers=cfg.workers, cache_dir=cfg.cache_dir,
        cache_size=cfg.cache_size, seed=cfg.seed, channels_last=channels_last, data_timeout=cfg.data_timeout,
    )  # fmt: skip
    mixture = [(s.location, s.weight) for s in map(parse_source, cfg.mix)]
    # each epoch gets its size (--progressive) from set_epoch; the workers' buffers hold the largest's crops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShuffleWarning)  # (said below, in one line)
        train_loader = loader(
            mixture or cfg.data, "train", epoch_mode=cfg.epoch_mode, epoch_size=cfg.epoch_size, image_size=max(sizes),
            shuffle_buffer=cfg.shuffle_buffer, augment=Augment(cfg.auto_augment, cfg.random_erase),
            cpu_share=cfg.cpu_share, manifest=None if mixture or val_at != cfg.data else manifest,
        )  # fmt: skip
    for line in train_loader.notes:
        echo(f"note: {line}", err=True)
    val_loader = None
    val_split = manifest.splits.get("val")
    if not (val_split and val_split.samples):
        echo(f"note: {val_at} has no val split: the run validates nothing and keeps no best.pt", err=True)
    else:  # (its labels mapped to training's classes, a mixture's merged ones)
        val_loader = loader(
            val_at, "val", image_size=val_size, val_resize_size=cfg.val_resize_size, manifest=manifest,
            classes=train_loader.classes,
        )  # fmt: skip
    workers = train_loader.workers
    per_process = f"{workers} worker{'' if workers == 1 else 's'} per process"
    if share := train_loader.cpu_share:  # (cpu_share.py)
        per_process += f" cropping {'a share of' if share == AUTO else f'{float(share):.0%} of'} the samples"
    fed = f"{train_loader.decode} decode, {per_process}"
    if mixture:
        fed += f", from {len(mixture)} sources mixed ({', '.join(f'{w:g}' for _, w in mixture)})"
    return train_loader, val_loader, train_loader.classes, fed


def build(
    cfg: TrainConfig,
    process: distributed.Process,
    output: Path,
    sizes: list[int],
    val_size: int,
    echo: Callable[..., None],
) -> Parts:
    """The loaders, the model and its optimizer; says what trains on what in the run's first line."""
    cuda = process.device.type == "cuda"
    channels_last = cfg.channels_last if cfg.channels_last is not None else cuda
    train_loader, val_loader, classes, feeding = loaders(cfg, process, sizes, val_size, channels_last, echo)
    problems = [loader.problems for loader in (train_loader, val_loader) if isinstance(loader, ShardLoader)]
    health = DataHealth(problems, echo, cfg.max_bad)
    raw_model = model.build_model(cfg.arch, len(classes))
    if cfg.weights:
        model.load_weights(raw_model, cfg.weights, cfg.arch)
    raw_model = model.sync_batchnorm(raw_model.to(process.device), cfg, process)
    if channels_last:
        raw_model = raw_model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # (documented)
    decent, compiled = model.parallelism(cfg, process, echo)
    if decent and cfg.clip_grad_norm:
        raise ConfigError("--clip-grad-norm with --dp decent: its wrapper steps inside backward; leave one out")
    global_batch = cfg.batch_size * process.world
    decay = ema_decay(cfg.model_ema_decay, cfg.model_ema_steps, global_batch, cfg.epochs)
    ema = ModelEma(raw_model, decay) if cfg.model_ema else None
    mode = f", compiled ({model.compile_mode(cfg, cuda)})" if compiled else ", eager"
    echo(f"{cfg.arch} on {process.world} × {process.device.type}, {feeding}{mode}")
    echo(
        f"learning rate {model.peak_lr(cfg, global_batch):g} at its peak: --lr {cfg.lr:g} is per "
        f"{model.LR_BATCH} images, scaled to the global batch of {global_batch}"
    )
    new_optimizer = functools.partial(model.make_optimizer, cfg=cfg, global_batch=global_batch, fused=cuda)
    optimizer = new_optimizer(list(raw_model.parameters()))  # --dp decent: one per bucket, inside its wrapper
    scaler = torch.amp.GradScaler(process.device.type, enabled=cfg.amp == "fp16")
    return Parts(
        cfg, process, output, echo, train_loader, val_loader, classes, health, raw_model,
        new_optimizer, optimizer, scaler, decent, compiled, ema,
    )  # fmt: skip


def watch(
    parts: Parts, train_state: TrainState, log: MetricsLog, uploader: upload.Uploader | None, cost: DataCost
) -> Watchdog | None:
    """With several ranks and a --collective-timeout, the watchdog that ends them all where one
    never reaches the others (watchdog.py); before a process ends so, its log and trackers are
    closed (the run failed, its ``run`` record written) and rank 0 uploads its logs."""
    cfg, process = parts.cfg, parts.process
    if process.world == 1:
        return None
    # rank 0's setting on every rank (nodes started with others would not meet at the same calls)
    timeout, token = distributed.broadcast_object((cfg.collective_timeout, uuid.uuid4().hex))
    if not timeout:
        return None
    if not watchable():
        parts.echo(
            "note: no rendezvous store to watch the ranks by (MASTER_ADDR, MASTER_PORT unset): a rank that never "
            "reaches the others ends the run at the collective library's own timeout",
            err=True,
        )
        return None
    say = voice(parts.echo, process.rank)

    def last_words(seconds: float) -> None:
        step = train_state.step
        log.write(**cost.record("failed", train_state.epoch + 1, step))
        log.close("failed", step=step)
        if uploader:
            for file in logs(parts.output):
                uploader.submit(file)
            uploader.flush(seconds)

    return Watchdog(process, timeout, token, say, last_words, parts.train_loader.in_reading)


FEW_STEPS = 10  # an epoch shorter than this is said: train.py's defaults (batch 256) on a small data set


def few_steps(samples: int, steps: int, batch: int, world: int) -> str | None:
    """The line that says epochs of ``steps`` are too short to learn from, with a batch size that fits."""
    if steps >= FEW_STEPS:
        return None
    fit = 2 ** max(0, math.floor(math.log2(max(1.0, samples / (FEW_STEPS * world)))))
    ranks = f" × {world} ranks" if world > 1 else ""
    larger = f"; the batch is larger than the {samples} samples" if batch * world > samples else ""
    # (with fewer samples than FEW_STEPS batches of one, only a longer resampled epoch helps)
    better = f"--batch-size {fit}" if fit < batch and samples >= FEW_STEPS * world else "more samples or --epoch-size"
    return (
        f"warning: an epoch is {steps} step{'s' * (steps != 1)} of {batch * world} images (--batch-size {batch}{ranks}"
        f"{larger}): too few to learn from; for these {samples} samples try {better}, and see --help for a quick "
        "CPU run"
    )


def schedule_change(cfg: TrainConfig, train_state: TrainState, lr_next: float) -> str | None:
    """The line that says what an --epochs other than the resumed checkpoint's run planned does
    to the schedule (a cosine stretched over more epochs climbs back up)."""
    planned = train_state.planned_epochs
    if planned is None or planned == cfg.epochs:
        return None
    theirs = f" ({train_state.lr_before:.3g} in its {planned})" if train_state.lr_before is not None else ""
    return (
        f"note: --epochs {cfg.epochs} where the checkpoint's run planned {planned}: the {cfg.lr_scheduler} schedule "
        f"now spans {cfg.epochs} epochs, so the next step's learning rate is {lr_next:.3g}{theirs}"
    )


def assemble(
    parts: Parts,
    train_state: TrainState,
    report: Callable[[dict], None] | None,
    stop_requested: threading.Event | None = None,
) -> Run:
    """The run, continuing where ``train_state`` says: its schedule, stepping model, logs,
    uploads; ``stop_requested`` set stops it as SIGTERM does."""
    cfg, process = parts.cfg, parts.process
    if process.main:
        train_state.run_id = upload.run_id(parts.output, train_state.run_id)
    # before the logs are opened: a run refused here changes none of them
    if refused := distributed.broadcast_object(claimed(cfg, train_state.run_id) if process.main else None):
        raise upload.Claimed(refused)
    steps_per_epoch = len(parts.train_loader)
    if isinstance(parts.train_loader, ShardLoader) and (
        short := few_steps(cfg.epoch_size or parts.train_loader.samples, steps_per_epoch, cfg.batch_size, process.world)
    ):
        parts.echo(short, err=True)
    total_steps = steps_per_epoch * cfg.epochs
    # the schedule is a function of the epoch's step (so of how far training is, whatever the
    # topology), so a resumed run picks it up from its epoch and step
    warmup = min(total_steps, round(cfg.warmup_epochs * steps_per_epoch))
    if warmup and warmup == total_steps:
        parts.echo(
            f"warning: --warmup-epochs {cfg.warmup_epochs:g} covers all {cfg.epochs} epochs: the learning rate reaches "
            f"its peak {model.peak_lr(cfg, parts.global_batch):g} only at the last step and never decays; "
            f"give fewer (e.g. --warmup-epochs {cfg.epochs / 4:g})",
            err=True,
        )
    start = train_state.epoch * steps_per_epoch + train_state.first_step
    schedule = model.lr_lambda(cfg, warmup, total_steps, steps_per_epoch, start)
    scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, schedule)
    if stretched := schedule_change(cfg, train_state, parts.optimizer.param_groups[0]["lr"]):
        parts.echo(stretched)
    stepping = model.wrap(
        parts.raw_model, cfg, process, parts.decent, parts.compiled, parts.new_optimizer, schedule, parts.scaler
    )
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "sources"}
    trackers = (
        open_trackers(cfg.trackers, parts.output, settings, train_state.step, train_state.trackers)
        if process.main
        else []
    )
    for tracker in trackers:
        parts.echo(tracker.where)
    log = MetricsLog(parts.output if process.main else None, step=train_state.step, report=report, trackers=trackers)
    if cfg.log_keys and process.main and train_state.step == 0:  # an attempt that died before its first checkpoint
        keys_log.cut_back(parts.output, 0, {})
    uploader = (
        upload.Uploader(cfg.upload, train_state.run_id, parts.output, cfg.upload_retry_seconds)
        if cfg.upload and process.main
        else None
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    stop = StopSignal(process.world, stop_requested, says=process.main)
    cost = DataCost(parts.loaders, **train_state.data_cost, step=train_state.step)
    watchdog = watch(parts, train_state, log, uploader, cost)
    if isinstance(parts.train_loader, ShardLoader):
        parts.train_loader.stop_waiting_when(stop.stop_waiting)
    return Run(
        **vars(parts), train_state=train_state, model=stepping, criterion=criterion,
        mixer=batch_mixer(cfg.mixup_alpha, cfg.cutmix_alpha, len(parts.classes)), scheduler=scheduler,
        log=log, uploader=uploader, stop=stop, figures=EpochFigures(parts.train_loader), watchdog=watchdog,
        cost=cost,
    )  # fmt: skip
