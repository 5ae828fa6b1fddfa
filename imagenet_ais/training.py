"""The training loop: model, optimizer, schedule, steps, validation, metrics, checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from imagenet_ais import checkpoint, decentralized, distributed, keys_log, locks, upload
from imagenet_ais.data import SYNTHETIC_CLASSES, SyntheticLoader, TrainLoader, ValLoader
from imagenet_ais.data_health import DataHealth
from imagenet_ais.manifest import load_manifest
from imagenet_ais.metrics import LOG, METRICS, MetricsLog, Reporter, gpu_sample
from imagenet_ais.sampling import merge_positions
from imagenet_ais.storage import open_store
from imagenet_ais.stream import CacheSpec, LoaderSpec


@dataclass
class TrainConfig:
    data: str | None
    output: str
    arch: str = "resnet50"
    epochs: int = 90
    batch_size: int = 256
    lr: float = 0.1  # for a global batch of 256, scaled linearly
    warmup_epochs: float = 5.0
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    workers: int | None = None  # None = auto: the node's CPUs per local rank (distributed.auto_workers)
    image_size: int = 224
    progressive: str | None = None  # "START:END": train size grows over epochs (steps of 32)
    val_size: int | None = None  # default: END with --progressive, else image_size
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


EXIT_UPLOAD_FAILED = 3  # trained (or stopped cleanly), but some upload never made it: see stderr
EXIT_BAD_DATA = 4  # an epoch skipped or padded more than --max-bad of its samples (checkpoint saved)
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1 after saving (and uploading): resume with --resume auto


class StopSignal:
    """SIGTERM / SIGUSR1 (preemption, Slurm's warning): finish the step, save, upload, exit.

    Only a main thread can take signals; where training runs in another (a Ray Train worker),
    stopping is the framework's business and this does nothing.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        main = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGTERM, signal.SIGUSR1) if main else ()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in sigs}

    def _handle(self, signum: int, _frame: object) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def build_model(arch: str, num_classes: int) -> nn.Module:
    try:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    except ValueError as e:
        known = ", ".join(torchvision.models.list_models(module=torchvision.models))
        raise ValueError(f"--arch {arch!r} is not a torchvision classification model; one of: {known}") from e


def param_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on BatchNorm/LayerNorm parameters and biases (every 1-d parameter)."""
    decay = [p for p in params if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in params if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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


def lr_lambda(warmup: int, total: int, start: int = 0):
    """Linear warmup to the peak, then cosine to zero, per step; counting from ``start`` (a resume)."""

    def factor(step: int) -> float:
        step += start
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def autocast(cfg: TrainConfig, device: torch.device):
    amp = cfg.amp if cfg.amp != "auto" else ("bf16" if device.type == "cuda" else "off")
    if amp == "off":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


@torch.no_grad()
def validate(model: nn.Module, loader: ValLoader, cfg: TrainConfig, d: distributed.Dist) -> dict[str, float]:
    """Top-1/top-5 over the whole split: each rank scores its own disjoint share, then sums."""
    model.eval()
    correct1 = correct5 = seen = size = 0
    for x, y, _ in loader:
        size = x.shape[-1]
        with autocast(cfg, d.device):
            logits = model(x)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct1 += int((top[:, 0] == y).sum())
        correct5 += int((top == y[:, None]).any(dim=1).sum())
        seen += len(y)
    c1, c5, n, skipped = distributed.all_reduce_sum([correct1, correct5, seen, loader.dataset.skipped.value], d.device)
    model.train()
    top1, top5 = 100 * c1 / max(n, 1), 100 * c5 / max(n, 1)
    return {"top1": top1, "top5": top5, "samples": int(n), "skipped": int(skipped), "image_size": size}


def train(cfg: TrainConfig, report: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; ``report`` also gets every metrics record, on every rank."""
    d = distributed.setup()
    try:
        # rank 0 writes the output: a second run into it would mix checkpoints and event files
        with locks.lock_output(Path(cfg.output)) if d.main else nullcontext():
            return _train(cfg, d, report)
    finally:
        distributed.teardown()


def compile_mode(cfg: TrainConfig, cuda: bool) -> str:
    """CUDA graphs on a GPU: one launch per graph instead of one per kernel, so the step no longer
    waits on a Python thread that shares the GIL with the feed (bench/RESULTS.md, run P: 0.77 →
    0.92 of the ceiling on 2 H100s). On the CPU there is nothing to graph."""
    return cfg.compile_mode or ("reduce-overhead" if cuda else "default")


def _compiles(device: torch.device, say: Callable[..., None]) -> bool:
    """Whether torch.compile can work here by default: Inductor's Triton kernels need a GPU of
    compute capability 7.0+ and a C compiler at run time."""
    if torch.cuda.get_device_capability(device) < (7, 0):
        say("note: this GPU is older than compute capability 7.0: training eager (torch.compile needs 7.0+)")
        return False
    if not any(shutil.which(cc) for cc in (os.environ.get("CC", "cc"), "gcc", "clang")):
        say("note: no C compiler here (torch.compile needs one, e.g. apt-get install gcc): training eager")
        return False
    return True


def _loaders(
    cfg: TrainConfig,
    d: distributed.Dist,
    sizes: list[int],
    val_size: int,
    channels_last: bool,
    say: Callable[..., None],
) -> tuple[TrainLoader | SyntheticLoader, ValLoader | None, list[str], str]:
    """The training and validation loaders, the class names, and how the data is fed (for the
    run's first line)."""
    cuda = d.device.type == "cuda"
    val_loader: ValLoader | None = None
    if cfg.synthetic:
        classes = [str(i) for i in range(SYNTHETIC_CLASSES)]
        train_loader: TrainLoader | SyntheticLoader = SyntheticLoader(cfg.batch_size, sizes[0], d.device, channels_last)
        feeding = "synthetic data"
    else:
        if not cfg.data:
            raise ValueError("no --data given: point it at a shard location holding manifest.json, or use --synthetic")
        if cfg.cache_size is not None and not cfg.cache_dir:
            raise ValueError("--cache-size bounds --cache-dir: give --cache-dir too")
        store = open_store(cfg.data)
        manifest = load_manifest(store)
        classes = manifest.classes
        if cfg.decode == "gpu" and not cuda:
            say("note: --decode gpu without a GPU decodes in the training process, on the CPU", err=True)
        decode = cfg.decode if cfg.decode != "auto" else "gpu" if cuda else "cpu"
        workers = cfg.workers if cfg.workers is not None else distributed.auto_workers(d.device)
        cache = CacheSpec(cfg.cache_dir, cfg.cache_size) if cfg.cache_dir else None
        spec = LoaderSpec(d.world, d.rank, cfg.batch_size, cfg.seed, sizes[0], decode, len(classes), cache)
        train_loader = TrainLoader(
            manifest.split("train"),
            cfg.data,
            cfg.epoch_mode,
            spec,
            workers,
            cfg.shuffle_buffer,
            d.device,
            channels_last,
        )
        val_split = manifest.splits.get("val")
        if val_split and val_split.samples:
            val_spec = dataclasses.replace(spec, image_size=val_size)
            val_loader = ValLoader(val_split, cfg.data, val_spec, workers, d.device, channels_last)
        feeding = f"{decode} decode, {workers} workers per process"
    return train_loader, val_loader, classes, feeding


@dataclass
class Standing:
    """Where a run stands: what a checkpoint carries over besides the weights."""

    epoch: int = 0  # the epoch being trained
    step: int = 0  # optimizer steps taken, over all epochs
    first_step: int = 0  # the step of ``epoch`` the next pass starts at (> 0 after a mid-epoch resume)
    best_top1: float = 0.0
    last_val: dict[str, float] | None = None
    averaged_at: int | None = None  # --dp decent: the step of the last global average


@dataclass
class Run:
    """What one training run works with, built once by ``_train``."""

    cfg: TrainConfig
    d: distributed.Dist
    output: Path
    say: Callable[..., None]
    train_loader: TrainLoader | SyntheticLoader
    val_loader: ValLoader | None
    classes: list[str]
    health: DataHealth
    raw_model: nn.Module  # the weights, as saved
    model: nn.Module  # what steps: raw_model wrapped (DDP or --dp decent) and maybe compiled
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    scheduler: torch.optim.lr_scheduler.LambdaLR
    log: MetricsLog
    uploader: upload.Uploader | None
    stop: StopSignal
    decent: bool
    standing: Standing

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.d.world


def _train(cfg: TrainConfig, d: distributed.Dist, report: Callable[[dict], None] | None) -> dict[str, Any]:
    output = Path(cfg.output)
    output.mkdir(parents=True, exist_ok=True)
    if d.main:
        checkpoint.sweep_partials(output)
    random.seed(cfg.seed + d.rank)
    torch.manual_seed(cfg.seed + d.rank)
    cuda = d.device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    cl = cfg.channels_last if cfg.channels_last is not None else cuda
    sizes, val_size = image_sizes(cfg)
    say = Reporter(output / LOG if d.main else None).say

    train_loader, val_loader, classes, feeding = _loaders(cfg, d, sizes, val_size, cl, say)
    loaders = [loader for loader in (train_loader, val_loader) if isinstance(loader, TrainLoader | ValLoader)]
    health = DataHealth([loader.dataset.problems for loader in loaders], say, cfg.max_bad)

    raw_model = build_model(cfg.arch, len(classes)).to(d.device)
    if cl:
        raw_model = raw_model.to(memory_format=torch.channels_last)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * cfg.epochs
    decent = cfg.dp == "decent" and d.world > 1
    if cfg.dp == "decent" and not decent:
        say("note: --dp decent with one process trains as plain data parallel would", err=True)
    if decent and cfg.compile:
        raise ValueError("--dp decent does not work with --compile (its hooks re-point the parameters): drop one")
    compiled = cfg.compile if cfg.compile is not None else cuda and not decent and _compiles(d.device, say)
    mode = compile_mode(cfg, cuda)
    say(f"{cfg.arch} on {d.world} × {d.device.type}, " + feeding + (f", compiled ({mode})" if compiled else ", eager"))

    new_optimizer = functools.partial(make_optimizer, cfg=cfg, global_batch=cfg.batch_size * d.world, fused=cuda)
    optimizer = new_optimizer(list(raw_model.parameters()))  # --dp decent: one per bucket, inside its wrapper
    scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.amp == "fp16")
    standing = Standing()
    resumed = checkpoint.resume(cfg.resume, output, cfg.upload, (METRICS, LOG), d.local_rank == 0, say)
    if resumed:
        standing = _restore(*resumed, cfg, d, raw_model, None if decent else optimizer, scaler, classes, say)
        if standing.epoch < cfg.epochs:
            standing.first_step = continue_epoch(resumed[1], cfg, train_loader, d, say)
    if standing.epoch >= cfg.epochs:
        say(f"{output}: already trained {cfg.epochs} epochs; use a new --output or more --epochs")
        return {"step": standing.step, "val": standing.last_val, "complete": True, "exit_code": 0}

    # the schedule is a function of the epoch's step (so of how far training is, whatever the
    # topology), so a resumed run picks it up from its epoch and step
    warmup = min(total_steps, round(cfg.warmup_epochs * steps_per_epoch))
    schedule = lr_lambda(warmup, total_steps, start=standing.epoch * steps_per_epoch + standing.first_step)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model: nn.Module = raw_model
    if decent:
        model = decentralized.wrap(raw_model, new_optimizer, schedule, cfg.topology, scaler)
    elif d.world > 1:
        # gradients as views into DDP's buckets: no copy into and out of them each step
        model = DistributedDataParallel(
            raw_model, device_ids=[d.local_rank] if cuda else None, gradient_as_bucket_view=True
        )
    if compiled:
        # DDP compiled as one graph rather than split at its buckets to overlap the all-reduce
        # with the backward pass: faster over NVLink (4 H200s: 25,319 img/s against 24,832,
        # bench/RESULTS.md run S)
        torch._dynamo.config.optimize_ddp = False
        # static shapes: a new --progressive size gets its own graph, as fast as the first; by
        # default the second size turns on dynamic shapes, and ResNet-50 at 224 px then ran at
        # 3,800 img/s instead of 5,330 on an H100 (bench/RESULTS.md run T)
        model = torch.compile(model, mode=mode, dynamic=False)
    log = MetricsLog(output if d.main else None, resume_step=standing.step if cfg.resume else None, report=report)
    uploader = upload.Uploader(cfg.upload, cfg.upload_retry_seconds) if cfg.upload and d.main else None
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    run = Run(
        cfg, d, output, say, train_loader, val_loader, classes, health, raw_model, model,
        criterion, optimizer, scaler, scheduler, log, uploader, StopSignal(), decent, standing,
    )  # fmt: skip

    model.train()
    for epoch in range(standing.epoch, cfg.epochs):
        standing.epoch = epoch
        train_loader.set_epoch(epoch, sizes[epoch])
        stopped = train_epoch(run)
        if stopped:
            save(run, epoch, stopped.step_in_epoch)
            if stopped.signalled:
                say(f"stopped by a signal at step {standing.step}, checkpoint saved; continue with --resume auto")
                return finish(run, complete=False, exit_code=EXIT_PREEMPTED)
            say(f"stopped at step {standing.step} (--max-steps); continue with --resume auto")
            return finish(run, complete=False)
        improved = val_loader is not None and evaluate(run)
        standing.first_step = 0
        save(run, epoch + 1, 0, best=improved)
        if damaged := health.end_epoch(epoch, steps_per_epoch * run.global_batch):
            say(f"ERROR: {damaged}", err=True)
            return finish(run, complete=False, exit_code=EXIT_BAD_DATA)

    if last_val := standing.last_val:
        say(
            f"final validation top-1 {last_val['top1']:.2f}% (top-5 {last_val['top5']:.2f}%) "
            f"over {last_val['samples']} images; chance is {100 / len(classes):.2f}%"
        )
    return finish(run, complete=True)


def make_optimizer(
    params: list[torch.Tensor], cfg: TrainConfig, global_batch: int, fused: bool
) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        param_groups(params, cfg.weight_decay),
        lr=cfg.lr * global_batch / 256,
        momentum=cfg.momentum,
        nesterov=True,
        fused=fused,  # one kernel for the whole update instead of a few per tensor (on a GPU)
    )


def _restore(
    path: Path,
    state: dict[str, Any],
    cfg: TrainConfig,
    d: distributed.Dist,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler,
    classes: list[str],
    say: Callable[..., None],
) -> Standing:
    """Loads a checkpoint's weights, optimizer, scaler and RNG; where the run stood."""
    if state["arch"] != cfg.arch or state["classes"] != classes:
        raise ValueError(
            f"{path} was trained as {state['arch']} on {len(state['classes'])} classes, "
            f"not {cfg.arch} on {len(classes)}: use another --output or --resume"
        )
    model.load_state_dict(state["model"])
    if state["optimizer"] and optimizer:
        optimizer.load_state_dict(state["optimizer"])
    else:
        say("note: the optimizer's momentum starts afresh (--dp decent keeps one per rank, not checkpointed)")
    scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) == d.world:
        checkpoint.set_rng_state(state["rng"][d.rank])
    if cfg.log_keys and d.main and "keys_logged" in state:  # (older checkpoints recorded none)
        keys_log.cut_back(Path(cfg.output), state["epoch"], state["keys_logged"])
    say(f"resumed from {path}: epoch {state['epoch'] + 1}, step {state['step']}")
    return Standing(state["epoch"], state["step"], 0, state["best_top1"], state["last_val"])


@dataclass
class Stopped:
    """Why and where an epoch stopped before its end."""

    step_in_epoch: int  # steps of the epoch done
    signalled: bool  # SIGTERM/SIGUSR1 (else --max-steps)


def train_epoch(run: Run) -> Stopped | None:
    """Trains the rest of ``run.standing.epoch``; where it stopped early, if it did."""
    cfg, d, standing, loader = run.cfg, run.d, run.standing, run.train_loader
    epoch, steps = standing.epoch, len(loader)
    batches = iter(loader)
    keys_out = keys_log.open_log(run.output, epoch, d.rank) if cfg.log_keys else None
    progress = Progress(epoch, cfg.epochs, steps, standing.first_step, shown=d.main)
    window = Window()
    stopped = None
    for step_in_epoch in range(standing.first_step, steps):
        t0 = time.perf_counter()
        x, y, keys = next(batches)
        window.waited += time.perf_counter() - t0
        loss = train_step(run, x, y)
        standing.step += 1
        window.steps += 1
        window.losses.append(loss.detach())
        if keys_out:
            keys_out.write("".join(f"{k}\n" for k in keys))
        progress.update()
        last_of_epoch = step_in_epoch == steps - 1
        # Ranks agree on the stop step; with several, only at log steps and epoch ends (the
        # agreement is a collective, and per step it would stall the GPU queue).
        signalled = (d.world == 1 or standing.step % cfg.log_every == 0 or last_of_epoch) and distributed.any_rank(
            run.stop.received is not None, d.device
        )
        if signalled or (cfg.max_steps is not None and standing.step >= cfg.max_steps):
            stopped = Stopped(step_in_epoch + 1, signalled)
        if standing.step % cfg.log_every == 0 or last_of_epoch or stopped:
            lr = run.model.get_lr() if run.decent else run.scheduler.get_last_lr()[0]
            record, totals = window.record(loader, d, run.global_batch, epoch, standing.step, lr, x.shape[-1])
            run.log.write(**record)
            run.health.poll(totals)
            progress.show(record, step_in_epoch + 1)
            window = Window(start=window.end)  # windows tile the time: none of it goes unrecorded
        if stopped:
            break
        if cfg.checkpoint_every and standing.step % cfg.checkpoint_every == 0 and not last_of_epoch:
            save(run, epoch, step_in_epoch + 1)
    progress.close()
    if keys_out:
        keys_out.close()
    return stopped


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer step on a batch; its loss."""
    with autocast(run.cfg, run.d.device):
        loss = run.criterion(run.model(x), y)
    if run.decent:  # the wrapper's backward hooks step, zero and mix each bucket
        run.scaler.scale(loss).backward()
        return loss
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    return loss


def evaluate(run: Run) -> bool:
    """Validates at the end of an epoch, logs and says it; whether top-1 is the best so far."""
    standing = run.standing
    # decentralized ranks agree on one model first (the average); record how far apart they were
    agreement = average(run) if run.decent else {}
    val = standing.last_val = validate(run.raw_model, run.val_loader, run.cfg, run.d)
    run.log.write(kind="val", epoch=standing.epoch, step=standing.step, **val, **agreement)
    top = f"val top-1 {val['top1']:.2f}% top-5 {val['top5']:.2f}%"
    run.say(f"epoch {standing.epoch + 1}: {top} over {val['samples']} images")
    if val["top1"] <= standing.best_top1:
        return False
    standing.best_top1 = val["top1"]
    return True


def average(run: Run) -> dict[str, float]:
    """--dp decent: every rank takes the global average of the models; how far apart they were."""
    run.standing.averaged_at = run.standing.step
    return decentralized.consensus(run.model)


def save(run: Run, epoch: int, step_in_epoch: int, best: bool = False) -> None:
    """A checkpoint of the run at ``step_in_epoch`` of ``epoch`` (uploaded too, with the logs).

    Every rank's RNG and data position go in it: collectives, so all ranks call this."""
    cfg, d, standing, loader = run.cfg, run.d, run.standing, run.train_loader
    if run.decent and standing.averaged_at != standing.step:
        average(run)  # the model every rank continues from
    rng = distributed.gather_objects(checkpoint.rng_state())
    exact = isinstance(loader, TrainLoader) and cfg.epoch_mode == "exact" and step_in_epoch > 0
    positions = distributed.gather_objects(loader.position() if exact else None)
    if not d.main:
        return
    restored = loader.restored if isinstance(loader, TrainLoader) else None
    state = {
        "model": run.raw_model.state_dict(),
        "optimizer": None if run.decent else run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "epoch": epoch,
        "step": standing.step,
        "step_in_epoch": step_in_epoch,
        "steps_per_epoch": len(loader),
        "best_top1": standing.best_top1,
        "last_val": standing.last_val,
        "rng": rng,
        # the samples of the epoch trained so far, whichever rank trained them
        "data_position": merge_positions(epoch, [restored, *positions]) if exact else None,
        "plan": loader.plan() if isinstance(loader, TrainLoader) else None,
        "keys_logged": keys_log.sizes(run.output, epoch) if cfg.log_keys else {},
        "arch": cfg.arch,
        "classes": run.classes,
        "config": asdict(cfg),
    }
    # Saved again at the step of the checkpoint this run resumed from (an epoch it had stopped
    # at the very end of, now validated): the newer state replaces the older one, uploaded too.
    again = (run.output / checkpoint.name_for(standing.step)).exists()
    path = checkpoint.save(state, run.output, standing.step, cfg.keep_last)
    if best:
        checkpoint.link(path, checkpoint.BEST)
    if run.uploader:
        run.uploader.submit(path, checkpoint_step=standing.step, replace=again)
        for file in (run.output / METRICS, run.output / LOG, *run.output.glob("events.out.tfevents.*")):
            if file.exists():
                run.uploader.submit(file)


def finish(run: Run, complete: bool, exit_code: int = 0) -> dict[str, Any]:
    """Closes the run (signals, logs, pending uploads); its outcome."""
    cfg = run.cfg
    run.stop.restore()
    if isinstance(run.train_loader, TrainLoader):
        run.say(run.health.summary())
    run.log.close()
    if run.uploader:
        run.say(f"waiting up to {cfg.flush_timeout:.0f}s for uploads to {cfg.upload}")
        missing = run.uploader.flush(cfg.flush_timeout)
        if missing:
            where = f"{', '.join(missing)} (local copies in {run.output})"
            run.say(f"ERROR: never uploaded to {cfg.upload}: {where}", err=True)
            exit_code = EXIT_UPLOAD_FAILED
    return {"step": run.standing.step, "val": run.standing.last_val, "complete": complete, "exit_code": exit_code}


def continue_epoch(
    state: dict[str, Any], cfg: TrainConfig, loader: TrainLoader | SyntheticLoader, d: distributed.Dist, say: Callable
) -> int:
    """The step at which this run continues the epoch the checkpoint ``state`` stopped in (0:
    from its start), with ``loader`` set to train what that epoch has not. The world size,
    per-rank batch and workers may differ from the interrupted run's; where the epoch cannot
    be continued as it would have gone on, says so in one line and what it does instead."""
    epoch, step, steps = state["epoch"], state["step_in_epoch"], len(loader)
    if not step or isinstance(loader, SyntheticLoader):
        return min(step, steps)
    world, batch, mode = len(state["rng"]), state["config"]["batch_size"], state["config"]["epoch_mode"]
    moved = (world, batch) != (d.world, cfg.batch_size)
    stopped = f"epoch {epoch + 1} stopped at step {step} of {state['steps_per_epoch']} on {world} × {batch}"
    if state.get("plan", loader.plan()) != loader.plan():
        say(f"warning: {stopped} over other shards or another --seed: it starts over", err=True)
        return 0
    restart = f"{state['step']}"  # names the streams a resampled epoch draws from here on
    if cfg.epoch_mode == "exact":
        position = state["data_position"]
        if isinstance(position, list):  # written before positions were topology-free: one per rank
            position = merge_positions(epoch, position) if any(position) else None
        if mode != "exact" or not position:
            say(f"warning: {stopped} in {mode} mode, which keeps no record of its samples: it starts over", err=True)
            return 0
        first = loader.restore(epoch, restart, position)
        if moved:
            trained = sum(len(v) for v in position["delivered"].values())
            say(
                f"{stopped}: its {trained} samples trained are left out and the rest shared among "
                f"{d.world} × {cfg.batch_size}, {steps - first} steps (each sample of the epoch once)"
            )
        return first
    first = min(steps, round(step * steps / state["steps_per_epoch"]))  # as far through the epoch
    loader.restore(epoch, restart, step=first)
    if moved:
        say(
            f"{stopped}: resampled mode continues at step {first} of {steps} on {d.world} × {cfg.batch_size}, "
            "every worker drawing a fresh stream (none of the interrupted run's is replayed)"
        )
    return first


class Progress:
    """An epoch's progress on rank 0: a bar on a terminal; in a job log (NGC, Docker, Slurm),
    where bar frames would be a line per step, one plain line per metrics record instead."""

    def __init__(self, epoch: int, epochs: int, steps: int, first_step: int, shown: bool) -> None:
        self.epoch, self.epochs, self.steps = epoch, epochs, steps
        self.shown, self.live = shown, sys.stderr.isatty()  # tqdm draws on stderr
        self.bar = tqdm(
            total=steps,
            initial=first_step,
            disable=not (shown and self.live),
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="step",
            dynamic_ncols=True,
        )

    def update(self) -> None:
        self.bar.update(1)

    def show(self, record: dict[str, Any], step_in_epoch: int) -> None:
        if self.live:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", img_s=f"{record['img_per_s']:.0f}")
        elif self.shown:
            print(
                f"epoch {self.epoch + 1}/{self.epochs} step {step_in_epoch}/{self.steps} loss {record['loss']:.4f} "
                f"lr {record['lr']:.4g} img/s {record['img_per_s']:,.0f} data wait {record['data_wait']:.0%}",
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


class Window:
    """One metrics interval of the epoch loop: its steps, their losses, the time spent waiting for data."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.end = self.start
        self.steps, self.waited = 0, 0.0
        self.losses: list[torch.Tensor] = []

    def record(
        self,
        loader: TrainLoader | SyntheticLoader,
        d: distributed.Dist,
        global_batch: int,
        epoch: int,
        step: int,
        lr: float,
        image_size: int,
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """This window's ``kind: train`` metrics record, and the data counters in it (summed over ranks).

        The window ends once the GPU has done its steps (the loss sum waits for them): timed when
        the CPU had only queued them, a rate would count work the GPU had yet to do."""
        counters = loader.counters()
        loss_sum, *sums = distributed.all_reduce_sum(
            [float(torch.stack(self.losses).float().mean()), *counters.values()], d.device
        )
        self.end = time.perf_counter()
        elapsed = self.end - self.start
        totals = {k: int(v) for k, v in zip(counters, sums, strict=True)}
        record = {
            "kind": "train",
            "epoch": epoch,
            "step": step,
            "loss": loss_sum / d.world,
            "lr": lr,
            "img_per_s": self.steps * global_batch / elapsed,
            "image_size": image_size,
            **gpu_sample(d.device),
            "data_wait": self.waited / elapsed,
            # rank 0's feed threads: the one near 1 is what the step waits for
            **{f"busy_{k}": round(v / elapsed, 3) for k, v in loader.busy().items()},
            **totals,
        }
        return record, totals
