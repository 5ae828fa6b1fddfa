"""Where a run continues from: the checkpoint's weights, optimizer and RNG restored (checkpoint.py
finds and loads it), and the interrupted epoch continued as it would have gone on, on whatever
topology this run has."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from imagenet_ais import distributed
from imagenet_ais.errors import DataError
from imagenet_ais.loader import ShardLoader, StateMismatch
from imagenet_ais.loader.mixture import parse_source
from imagenet_ais.loader.sampling import merge_positions
from imagenet_ais.loader.synthetic import SyntheticLoader
from imagenet_ais.train import checkpoint, keys_log
from imagenet_ais.train.config import TrainConfig, given
from imagenet_ais.train.metrics import LOG, METRICS
from imagenet_ais.train.model import mismatches


@dataclass
class TrainState:
    """Where a run stands: what a checkpoint carries over besides the weights."""

    epoch: int = 0  # the epoch being trained
    step: int = 0  # optimizer steps taken, over all epochs
    first_step: int = 0  # the step of ``epoch`` the next pass starts at (> 0 after a mid-epoch resume)
    best_top1: float = 0.0
    last_val: dict[str, float] | None = None
    averaged_at: int | None = None  # --dp decent: the step of the last global average
    run_id: str = ""  # the run's id (upload.run_id), carried from checkpoint to checkpoint
    trackers: dict[str, str] = field(default_factory=dict)  # --tracker's runs (MLflow's, W&B's ids) to continue
    planned_epochs: int | None = None  # the --epochs of the checkpoint's run (its schedule's length)
    lr_before: float | None = None  # the learning rate the checkpoint's run would have stepped with next
    data_cost: dict[str, Any] = field(default_factory=dict)  # what its reads cost (data_cost.DataCost's arguments)


Found = tuple[Path, dict[str, Any]]  # a checkpoint's path and its state

# What this invocation or this machine decides; a resumed run takes every other setting from its
# checkpoint unless the command line names it (a preempted job restarted on another node type
# must not inherit the last one's workers, cache or decoder).
OF_THIS_INVOCATION = frozenset({
    "resume", "weights", "test_only", "max_steps", "output", "workers", "cache_dir", "cache_size", "compile",
    "compile_mode", "decode", "cpu_share", "channels_last", "data_timeout", "flush_timeout", "upload_retry_seconds",
    "collective_timeout",
})  # fmt: skip
# settings one option sets together (--data: data and mix), or that exclude each other (a named
# --image-size is no size of a --progressive taken from the checkpoint)
NAMED_TOGETHER = ({"data", "mix"}, {"image_size", "progressive"})
# named settings whose change from the checkpoint's has a note of its own (check_same_data, from_checkpoint, setup)
NOTED_APART = frozenset({"data", "mix", "epoch_size", "epochs"})


def find(cfg: TrainConfig, process: distributed.Process, echo: Callable[..., None]) -> Found | None:
    """The checkpoint --resume finds (downloaded where --upload holds a newer one), loaded and checked."""
    fetches = process.local_rank == 0  # one process per node downloads
    found = checkpoint.find_and_load(cfg.resume, Path(cfg.output), cfg.upload, (METRICS, LOG), fetches, echo)
    return (found[0], checkpoint.resumable(found[1], found[0])) if found else None


def with_settings_of(cfg: TrainConfig, found: Found, echo: Callable[..., None]) -> TrainConfig:
    """``cfg`` with the settings of the checkpoint ``found`` for those the command line did not
    name (a --recipe given names its settings); says which named ones differ from the checkpoint's."""
    path, saved = found[0], found[1]["config"]
    named = given(cfg) | {name for name, source in cfg.sources.items() if source.startswith("recipe ")}
    for linked in NAMED_TOGETHER:  # one named: the other is this run's too
        named |= linked if named & linked else set()
    settings = {f.name for f in dataclasses.fields(cfg)} - OF_THIS_INVOCATION - {"sources"}
    theirs: dict[str, Any] = {n: tuple(v) if isinstance(v, list) else v for n, v in saved.items() if n in settings}
    taken = {name: v for name, v in theirs.items() if name not in named and v != getattr(cfg, name)}
    if differ := [
        f"--{name.replace('_', '-')} {getattr(cfg, name)} (its run: {v})"
        for name, v in theirs.items()
        if name in named - NOTED_APART and v != getattr(cfg, name)
    ]:
        echo(f"note: {path} goes on with the settings it was trained with, but {', '.join(differ)}, as given")
    return dataclasses.replace(cfg, **taken, sources={**cfg.sources, **dict.fromkeys(taken, "checkpoint")})


def from_checkpoint(
    found: Found | None,
    cfg: TrainConfig,
    process: distributed.Process,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler,
    classes: list[str],
    loader: ShardLoader | SyntheticLoader,
    echo: Callable[..., None],
    ema: AveragedModel | None = None,
) -> TrainState:
    """Where the run starts: afresh, or from the checkpoint ``found`` (``find``), whose weights,
    optimizer, scaler, RNG (and --model-ema average) are loaded, with ``loader`` set to continue
    its epoch."""
    if not found:
        return TrainState()
    path, state = found
    check_fits(state, path, cfg.arch, cfg.opt, classes)
    check_same_data(state, path, cfg, loader.identity(), echo)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # torch lists every mismatch: thousands of characters
        raise DataError(f"{path}: its weights do not fit {cfg.arch} ({mismatches(e)})") from None
    lr_before = None
    if state["optimizer"] and optimizer:
        peaks = [group["lr"] for group in optimizer.param_groups]  # this run's, scaled to its global batch
        optimizer.load_state_dict(state["optimizer"])
        lr_before = optimizer.param_groups[0]["lr"]
        for group, peak in zip(optimizer.param_groups, peaks, strict=True):
            group["initial_lr"] = peak  # (the scheduler's base: the loaded one is the checkpoint's global batch's)
    else:
        echo("note: the optimizer's momentum starts afresh (--dp decent keeps one per rank, not checkpointed)")
    scaler.load_state_dict(state["scaler"])
    if ema is not None:
        if state.get("model_ema"):
            ema.load_state_dict(state["model_ema"])
        else:
            ema.module.load_state_dict(model.state_dict())
            echo("note: the checkpoint keeps no --model-ema average: it starts from the resumed weights")
    if len(state["rng"]) == process.world:
        checkpoint.set_rng_state(state["rng"][process.rank])
    if cfg.log_keys and process.main and "keys_logged" in state:  # (older checkpoints recorded none)
        keys_log.cut_back(Path(cfg.output), state["epoch"], state["keys_logged"])
    where = (
        f"epoch {state['epoch'] + 1}"
        if state["epoch"] < cfg.epochs
        else f"{state['epoch']} epochs trained, as many as --epochs {cfg.epochs} asks or more"
    )
    echo(f"resumed from {path}: {where}, step {state['step']}")  # (epochs count from 1 on the console)
    if (before := state["config"].get("epoch_size")) != cfg.epoch_size and not cfg.synthetic:
        size: dict[int | None, str] = {None: "the manifest's train samples"}
        echo(
            f"note: {path} trained epochs of {size.get(before, f'{before} samples')}, this run's are "
            f"{size.get(cfg.epoch_size, f'{cfg.epoch_size} samples')} (--epoch-size): it goes on from epoch "
            f"{state['epoch'] + 1}, as far through it as it was, and the schedule follows the new epochs"
        )
    train_state = TrainState(
        state["epoch"],
        state["step"],
        0,
        state["best_top1"],
        state["last_val"],
        run_id=state.get("run_id", ""),
        trackers=state.get("trackers", {}),
        planned_epochs=state["config"].get("epochs"),
        lr_before=lr_before,
        data_cost=_cost_carried(state.get("data_cost")),
    )
    if train_state.epoch < cfg.epochs:
        train_state.first_step = continue_epoch(state, cfg, loader, process, echo)
    return train_state


def _cost_carried(saved: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint's reads carry over (data_cost.DataCost.state; older checkpoints counted none)."""
    return {"carried": saved["run"], "epoch_start": saved["epoch_start"]} if saved else {}


def check_fits(state: dict[str, Any], path: Path, arch: str, opt: str, classes: list[str]) -> None:
    """One line where a checkpoint was trained as another model, with another optimizer or on other classes."""
    if state["arch"] != arch or len(state["classes"]) != len(classes):
        raise DataError(
            f"{path} was trained as {state['arch']} on {len(state['classes'])} classes, "
            f"not {arch} on {len(classes)}: give another --output for a new run (or --resume a checkpoint of "
            f"this model)"
        )
    if (theirs := state["config"].get("opt", "sgd")) != opt and state["optimizer"]:
        raise DataError(
            f"{path} was trained with --opt {theirs}, not {opt}: its optimizer state cannot carry over; give "
            f"--opt {theirs}, or start from its weights with --weights {path} and another --output"
        )
    if differ := [(a, b) for a, b in zip(state["classes"], classes, strict=True) if a != b]:
        (theirs, ours), more = differ[0], f" and {len(differ) - 1} more" if len(differ) > 1 else ""
        raise DataError(
            f"{path} was trained on other classes ({theirs!r} where the data has {ours!r}{more}): give another "
            "--output for a new run (or --resume a checkpoint trained on these classes)"
        )


def check_same_data(
    state: dict[str, Any], path: Path, cfg: TrainConfig, identity: str | None, echo: Callable[..., None]
) -> None:
    """A checkpoint trained on other shards elsewhere (same classes) continues only where
    ``--resume`` names it; the same shards read from another location (a copy, a preload) go on
    with a note, and so do shards changed in place (a data set that grew), with a warning."""
    theirs, where, ours = (
        state.get("data_identity"),
        training_data(state["config"]),
        training_data(dataclasses.asdict(cfg)),
    )
    if theirs is None or identity is None:  # (--synthetic, or a checkpoint older than the check)
        return
    if theirs == identity:
        if where != ours:
            echo(f"note: {path} was trained on the same shards (names, SHA-256s) at {where}; going on from {ours}")
        return
    if where == ours:
        echo(f"warning: the shards at {where} changed since {path} was trained on them: going on with them", err=True)
        return
    other = f"{path} was trained on other shards ({where}) than --data {ours} (their names or SHA-256s differ)"
    if cfg.resume == "auto":
        raise DataError(f"{other}: use another --output, or --resume {path} to go on from it with this data")
    echo(f"warning: {other}: going on from it, as --resume names it", err=True)


def training_data(config: dict[str, Any]) -> str:
    """The locations a run's settings (``TrainConfig``'s, or a checkpoint's) train on, a
    mixture's all of them (their weights aside: the same shards), as --data gives them."""
    return " ".join(parse_source(item).location for item in config.get("mix") or ()) or str(config.get("data"))


def continue_epoch(
    state: dict[str, Any],
    cfg: TrainConfig,
    loader: ShardLoader | SyntheticLoader,
    process: distributed.Process,
    echo: Callable,
) -> int:
    """The step at which this run continues the epoch the checkpoint ``state`` stopped in (0:
    from its start), with ``loader`` set to train what that epoch has not. The world size,
    per-rank batch and workers may differ from the interrupted run's; where the epoch cannot
    be continued as it would have gone on, says so in one line and what it does instead."""
    step, steps = state["step_in_epoch"], len(loader)
    if not step or isinstance(loader, SyntheticLoader):  # (--synthetic: every step is alike)
        return min(step, steps)
    try:
        loader.load_state_dict(loader_state(state, loader.plan()))
    except StateMismatch as e:
        echo(f"warning: {e}: it starts over", err=True)
        return 0
    stopped = loader.continued
    if stopped is None:  # (nothing to go on from)
        return 0
    if stopped.epoch != state["epoch"]:
        # stopped on its epoch's last step: the state is the next epoch's start, and this one's end is still to validate
        return steps
    first = loader.step
    if (stopped.world_size, stopped.batch_size) != (process.world, cfg.batch_size):
        if stopped.trained is not None:
            echo(
                f"{stopped}: its {stopped.trained} samples trained are left out and the rest shared among "
                f"{process.world} × {cfg.batch_size}, {steps - first} steps (each sample of the epoch once)"
            )
        else:
            echo(
                f"{stopped}: resampled mode continues at step {first} of {steps} on {process.world} × "
                f"{cfg.batch_size}, every worker drawing a fresh stream (none of the interrupted run's is replayed)"
            )
    return first


def loader_state(state: dict[str, Any], plan: str | None) -> dict[str, Any]:
    """The ShardLoader state a checkpoint keeps; one written before it kept that state whole
    holds its parts (an exact position then maybe one per rank; no plan: taken as this one)."""
    if state.get("data"):
        return state["data"]
    position = state.get("data_position")
    if isinstance(position, list):  # written before positions were topology-free: one per rank
        position = merge_positions(state["epoch"], position) if any(position) else None
    config = state["config"]
    return ShardLoader.state_of(
        state["epoch"],
        state["step_in_epoch"],
        state["steps_per_epoch"],
        config["epoch_mode"],
        state.get("plan", plan),
        position,
        len(state["rng"]),
        config["batch_size"],
    )
