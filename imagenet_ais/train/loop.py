"""The training loop: epochs of steps, validation, checkpoints, and how a run ends.

``train`` → ``_train``: the run is built (setup.py), resumed (resume.py), then each epoch is
``train_one_epoch`` (``train_step`` per batch), ``validate_epoch`` (``evaluate`` on the val split)
and ``save``; ``finish`` closes it.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from imagenet_ais import distributed
from imagenet_ais.errors import (
    EXIT_BAD_DATA,
    EXIT_DIVERGED,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    EXIT_RANKS_LOST,
    EXIT_UPLOAD_FAILED,
    EXIT_WORKER_DIED,
    ConfigError,
    DataError,
)
from imagenet_ais.loader import Interrupted, UnreadableData, WorkerDied
from imagenet_ais.loader.shard_loader import ShardLoader
from imagenet_ais.storage import locks
from imagenet_ais.train import (
    checkpoint,
    data_cost,
    decentralized,
    keys_log,
    out_of_memory,
    resume,
    setup,
    upload,
    watchdog,
)
from imagenet_ais.train.config import TrainConfig, check, differences, image_sizes, with_recipe
from imagenet_ais.train.data_health import DataHealth
from imagenet_ais.train.ema import ModelEma
from imagenet_ais.train.metrics import CLASSES, CONFIG, LOG, TOP5_CLASSES, Reporter, accuracy, logs, voice
from imagenet_ais.train.model import autocast, check_arch
from imagenet_ais.train.progress import Progress, Window
from imagenet_ais.train.resume import TrainState
from imagenet_ais.train.setup import Parts, Run
from imagenet_ais.train.slow_rank import slowest

NONFINITE_STEPS = 10  # steps of a NaN or infinite loss before the run ends as diverged


class Diverged(Exception):
    """The weights hold NaN or infinity: never saved over the last finite checkpoint."""


@dataclass
class Stopped:
    """Why and where an epoch stopped before its end."""

    step_in_epoch: int  # steps of the epoch done
    signalled: bool  # SIGTERM/SIGUSR1 (else --max-steps)
    unsaved: bool = False  # signalled while this rank's data never came: the ranks cannot save together
    diverged: bool = False  # the loss stopped being finite: its weights are not worth a checkpoint


def train(
    cfg: TrainConfig, report: Callable[[dict], None] | None = None, stop: threading.Event | None = None
) -> dict[str, Any]:
    """Train as ``cfg`` says; ``report`` also gets every metrics record, on every rank. Setting
    ``stop`` stops the run as SIGTERM does (saved, uploaded, exit code 75): for a framework that
    runs training in a thread, which cannot take signals."""
    cfg = with_recipe(cfg)
    check(cfg)  # before anything is made
    check_arch(cfg.arch)
    output = Path(cfg.output)
    made = not output.exists()
    try:
        # DDP compiled as one graph rather than split at its buckets to overlap the all-reduce with
        # the backward pass: faster over NVLink (4 H200s: 25,319 img/s against 24,832, RESULTS run S)
        # Rank 0 writes the output: a second run into it would mix checkpoints and event files.
        # the group's own timeout past --collective-timeout: the watchdog's one line comes first
        timeout = cfg.collective_timeout + watchdog.FIRST if cfg.collective_timeout else None
        with (
            distributed.joined(timeout) as process,
            torch._dynamo.config.patch(optimize_ddp=False),
            checkpoint.rng_kept(),  # the caller's random state: a run seeds its own
            locks.lock_output(output) if process.main else nullcontext(),
        ):
            return _train(cfg, process, report, stop)
    except BaseException:
        if made and {p.name for p in output.glob("*")} <= {locks.TRAIN_LOCK, LOG, CONFIG, CLASSES, upload.CLAIM}:
            shutil.rmtree(output, ignore_errors=True)  # a start that failed leaves no folder it made
        raise


def _train(
    cfg: TrainConfig,
    process: distributed.Process,
    report: Callable[[dict], None] | None,
    stop: threading.Event | None,
) -> dict[str, Any]:
    output = setup.prepare(cfg, process)
    echo = Reporter(output / LOG if process.main else None).echo
    found = resume.find(cfg, process, echo)
    if found:
        cfg = resume.with_settings_of(cfg, found, echo)
        check(cfg)
    if process.main:
        for source, settings in differences(cfg).items():
            echo(f"{source}: {', '.join(settings)}")
    sizes, val_size = image_sizes(cfg)
    with out_of_memory.told(cfg, process.device):  # (the settings the run trains with, a checkpoint's included)
        parts = setup.build(cfg, process, output, sizes, val_size, echo)
        try:
            return _resume_and_train(parts, found, sizes, report, stop)
        finally:
            parts.close()


def _resume_and_train(
    parts: Parts,
    found: resume.Found | None,
    sizes: list[int],
    report: Callable[[dict], None] | None,
    stop: threading.Event | None,
) -> dict[str, Any]:
    """The run made of ``parts``, from where its checkpoint ``found`` (if any) stands to its end."""
    cfg, process, output, echo = parts.cfg, parts.process, parts.output, parts.echo
    optimizer = None if parts.decent else parts.optimizer
    loader, ema = parts.train_loader, parts.ema
    train_state = resume.from_checkpoint(
        found, cfg, process, parts.raw_model, optimizer, parts.scaler, parts.classes, loader, echo, ema
    )
    if process.main:  # once the checkpoint fits: a start refused leaves the run's own
        (output / CONFIG).write_text(json.dumps(asdict(cfg), indent=1) + "\n")
        # the label of each output, by index (a mixture's merged list: loader/mixture.py)
        (output / CLASSES).write_text(json.dumps(parts.classes, indent=1) + "\n")
    previous = train_state.last_val or {}  # until the next validation
    parts.health.val_missing = int(previous.get("missing", 0))
    parts.health.val_listed = int(previous.get("samples", 0)) + parts.health.val_missing
    if cfg.test_only:
        return test_only(parts, train_state)
    if train_state.epoch >= cfg.epochs:
        echo(
            f"{output}: its run has trained {train_state.epoch} epochs, --epochs {cfg.epochs} asks no more: give more "
            "--epochs to go on, or a new --output for a new run"
        )
        exit_code = catch_up(cfg, output, train_state, echo) if process.main else 0
        return {"step": train_state.step, "val": train_state.last_val, "complete": True, "exit_code": exit_code}
    run = setup.assemble(parts, train_state, report, stop)
    try:
        return epochs(run, sizes)
    finally:
        run.collector.release()  # (first: it cannot fail)
        run.stop.restore()  # the caller's signal handlers back, however the run ended
        if run.watchdog:
            run.watchdog.close()
        if run.uploader:
            run.uploader.close()


def epochs(run: Run, sizes: list[int]) -> dict[str, Any]:
    """The run's epochs from where it stands, each validated and saved; its outcome."""
    cfg, train_state, echo = run.cfg, run.train_state, run.echo
    run.model.train()
    for epoch in range(train_state.epoch, cfg.epochs):
        train_state.epoch = epoch
        run.train_loader.set_epoch(epoch, sizes[epoch])
        try:
            if stopped := train_one_epoch(run):
                return stop(run, stopped)
            improved = validate_epoch(run)
            epoch_ended(run)
            train_state.first_step = 0
            save(run, epoch + 1, 0, best=improved)
        except UnreadableData as e:  # nothing left to read: waiting would be for ever
            return loader_failed(run, e, EXIT_BAD_DATA)
        except WorkerDied as e:  # its batches will never come
            return loader_failed(run, e, EXIT_WORKER_DIED)
        except Diverged:  # a checkpoint was due, of weights gone NaN before the loss could stop the run
            return diverged(run, f"the weights hold NaN or infinity at step {train_state.step}")
        except Exception as e:
            if oom := out_of_memory.behind(e):  # closed as any failed run is: its uploads made, its checkpoints named
                return ran_out_of_memory(run, out_of_memory.said(cfg, run.process.device, oom, epoch))
            if isinstance(e, RuntimeError) and run.watchdog and run.watchdog.lost(e):  # a rank died?
                return finish(run, complete=False, exit_code=EXIT_RANKS_LOST)
            raise
        if damaged := run.health.end_epoch(epoch, len(run.train_loader) * run.global_batch):
            echo(f"ERROR: {damaged}", err=True)
            return finish(run, complete=False, exit_code=EXIT_BAD_DATA)
    if last_val := train_state.last_val:
        echo(
            f"final validation {accuracy(last_val)} over {last_val['samples']} images; "
            f"chance is {100 / len(run.classes):.2f}%"
        )
    return finish(run, complete=True)


def loader_failed(run: Run, error: Exception, exit_code: int) -> dict[str, Any]:
    """Ends a run whose loader cannot go on (the training one's, or in validation the val one's);
    this rank names what its workers could not read too."""
    # (the training data's counters: validation's are not among them)
    run.health.failing({} if run.validating else run.train_loader.counters(), voice(run.echo, run.process.rank))
    what = f"its data loader failed at {failing_at(run)} ({type(error).__name__})"
    return failed_alone(run, str(error), what, exit_code, for_data=not run.validating)


def ran_out_of_memory(run: Run, line: str) -> dict[str, Any]:
    """Ends a run whose GPU ran out of memory (out_of_memory.said's ``line``)."""
    return failed_alone(run, line, f"out of GPU memory at {failing_at(run)}", EXIT_OUT_OF_MEMORY)


def failing_at(run: Run) -> str:
    """Where a failure of this rank's own came: the step it was at, or the validation."""
    train_state = run.train_state
    return f"validation after epoch {train_state.epoch + 1}" if run.validating else f"step {train_state.step + 1}"


def failed_alone(run: Run, line: str, what: str, exit_code: int, for_data: bool = False) -> dict[str, Any]:
    """Ends a run on a failure of this rank's own, said whichever rank it is: the others may never
    reach another collective, and end at once naming this one as ended at ``what`` (``for_data``:
    with the shards its workers were reading)."""
    voice(run.echo, run.process.rank)(f"ERROR: {line}")
    if run.watchdog:
        run.watchdog.last(what, for_data)
    return finish(run, complete=False, exit_code=exit_code)


def stop(run: Run, stopped: Stopped) -> dict[str, Any]:
    """Ends a run whose epoch stopped before its end: saved where it stopped, to be continued."""
    train_state = run.train_state
    if stopped.diverged:
        return diverged(run, f"the loss was NaN or infinite for the last {run.nonfinite_steps} steps")
    if stopped.unsaved:
        run.echo(
            f"stopped by a signal at step {train_state.step} while waiting for data that never came: no checkpoint "
            "could be saved with the other ranks; continue with --resume auto from the last one",
            err=True,
        )
        return finish(run, complete=False, exit_code=EXIT_PREEMPTED)
    save(run, train_state.epoch, stopped.step_in_epoch)
    if stopped.signalled:
        received = signal.Signals(run.stop.received or signal.SIGTERM)
        by = "SIGINT, Ctrl-C" if received == signal.SIGINT else received.name
        run.echo(
            f"stopped by a signal ({by}) at step {train_state.step}, checkpoint saved; continue with --resume auto"
        )
        return finish(run, complete=False, exit_code=EXIT_PREEMPTED)
    run.echo(f"stopped at step {train_state.step} (--max-steps); continue with --resume auto")
    return finish(run, complete=False)


def diverged(run: Run, what: str) -> dict[str, Any]:
    """Ends a run whose training diverged, with nothing saved past its last finite checkpoint."""
    run.echo(
        f"ERROR: {what}, up to step {run.train_state.step}: the run diverged (too high an --lr, or weights that "
        "hold NaN); nothing was saved past the last finite checkpoint: continue from it with a lower --lr",
        err=True,
    )
    return finish(run, complete=False, exit_code=EXIT_DIVERGED)


def train_one_epoch(run: Run) -> Stopped | None:
    """Trains the rest of ``run.train_state.epoch``; where it stopped early, if it did."""
    cfg, process, train_state, loader = run.cfg, run.process, run.train_state, run.train_loader
    epoch, steps = train_state.epoch, len(loader)
    batches = iter(loader)
    keys_out = keys_log.open_log(run.output, epoch, process.rank) if cfg.log_keys else None
    progress = Progress(epoch, cfg.epochs, steps, train_state.first_step, shown=process.main)
    window = Window(process.device, loader)
    run.figures.start()
    stopped = None
    for step_in_epoch in range(train_state.first_step, steps):
        t0 = time.perf_counter()
        at(run, f"waiting for data for step {train_state.step + 1}", meeting=False, for_data=True)
        try:
            x, y, keys = next(batches)
        except Interrupted:  # signalled while waiting for data (alone, or the others would not wait)
            stopped = Stopped(step_in_epoch, signalled=True, unsaved=process.world > 1)
            break
        window.waited += time.perf_counter() - t0
        at(run, f"training step {train_state.step + 1}")
        window.clock.mark()
        lr = float(run.scheduler.get_last_lr()[0])  # this step's (the scheduler steps after it)
        loss = train_step(run, x, y, window.clock.forwarded)
        train_state.step += 1
        if run.ema and train_state.step % cfg.model_ema_steps == 0:
            update_ema(run, run.ema)
        window.steps += 1
        window.losses.append(loss.detach())
        if keys_out:
            keys_out.write("".join(f"{k}\n" for k in keys))
        progress.update()
        last_of_epoch = step_in_epoch == steps - 1
        # Ranks agree on the stop step; with several, only at log steps and epoch ends (the
        # agreement is a collective, and per step it would stall the GPU queue).
        signalled = (
            process.world == 1 or train_state.step % cfg.log_every == 0 or last_of_epoch
        ) and distributed.any_rank(run.stop.received is not None, process.device)
        if signalled or (cfg.max_steps is not None and train_state.step >= cfg.max_steps):
            stopped = Stopped(step_in_epoch + 1, signalled)
        if train_state.step % cfg.log_every == 0 or last_of_epoch or stopped:
            lr = decentralized.lr(run.model) if run.decent else lr  # (decent-dp's: what it steps with next)
            record, totals = window.record(loader, process, run.global_batch, epoch, train_state.step, lr, x.shape[-1])
            run.figures.add(window.end - window.start, window.steps, record["ranks"][process.rank])
            tail = record["nonfinite_tail"]
            run.nonfinite_steps = run.nonfinite_steps + tail if tail == window.steps else tail
            if run.nonfinite_steps >= NONFINITE_STEPS:
                stopped = Stopped(step_in_epoch + 1, signalled=False, diverged=True)
            run.log.write(**record)
            run.health.poll(totals)
            progress.show(record, step_in_epoch + 1)
            if not stopped:  # (a run about to save and end has no use for it)
                run.collector.settle()  # after the record: its pause is timed in the next window
            # windows tile the time and the reads: none of them goes unrecorded
            window = Window(process.device, loader, start=window.end, read=window.read_end)
        if stopped:
            break
        if cfg.checkpoint_every and train_state.step % cfg.checkpoint_every == 0 and not last_of_epoch:
            save(run, epoch, step_in_epoch + 1)
    progress.close()
    if keys_out:
        keys_out.close()
    return stopped


def epoch_ended(run: Run) -> None:
    """At an epoch's end, on every rank (collectives): what its data cost, and with several ranks
    the one that held the others back; logged (a ``report`` hears it on every rank), said by rank 0."""
    epoch = run.train_state.epoch + 1
    at(run, f"the end of epoch {epoch}")
    gathered = distributed.gather_objects((run.cost.mine(), run.figures.mine()))  # (one small gather an epoch)
    cost = run.cost.end_epoch((c for c, _ in gathered), run.train_state.step)
    ranks = [figures for _, figures in gathered]
    held_back = slowest(epoch, ranks) if len(ranks) > 1 else None
    run.log.write(
        kind="epoch", epoch=epoch, step=run.train_state.step, **data_cost.totals(cost), data=cost, ranks=ranks,
        **({"held_back": held_back} if held_back else {}),
    )  # fmt: skip
    if cost:
        run.echo(f"epoch {epoch} data: {data_cost.described(cost)}")
    if held_back:
        run.echo(held_back)


def at(run: Run, what: str, meeting: bool = True, for_data: bool = False) -> None:
    """Where this rank is (for the watchdog: a rank stuck somewhere is named with it); ``meeting``:
    it may wait for the other ranks there; ``for_data``: it waits for its next batch."""
    if run.watchdog:
        run.watchdog.now(what, meeting, for_data)


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, forwarded: Callable[[], None]) -> torch.Tensor:
    """One optimizer step on a batch; its loss. ``forwarded`` is called once the forward pass is queued."""
    if run.mixer:
        x, y = run.mixer(x, y)  # y: class probabilities from here on
    with autocast(run.cfg, run.process.device):
        loss = run.criterion(run.model(x), y)
    forwarded()
    if run.decent:  # the wrapper's backward hooks step, zero and mix each bucket
        run.scaler.scale(loss).backward()
        return loss
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    if run.cfg.clip_grad_norm:
        run.scaler.unscale_(run.optimizer)  # the norm of the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.cfg.clip_grad_norm)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    return loss


def update_ema(run: Run, ema: ModelEma) -> None:
    """--model-ema: the average takes a step towards the weights; during the warmup epochs it
    only follows them (the early weights are not worth remembering), as torchvision's recipe."""
    ema.update_parameters(run.raw_model)
    if run.train_state.epoch < run.cfg.warmup_epochs:
        ema.n_averaged.fill_(0)


def test_only(parts: Parts, train_state: TrainState) -> dict[str, Any]:
    """--test-only: validates the model as loaded (and its EMA, if kept), says it, trains nothing."""
    if not (parts.cfg.weights or train_state.step):
        raise ConfigError("--test-only: nothing to test; give --weights or --resume (a checkpoint)")
    if parts.val_loader is None:
        raise DataError(f"--test-only: {parts.cfg.val_data or parts.cfg.data} has no val split to evaluate on")
    val = evaluate(parts.raw_model, parts.val_loader, parts.cfg, parts.process)
    parts.echo(f"test: {accuracy(val, 4)} over {val['samples']} images")
    warn_if_partial(val, parts.health)
    if parts.ema and train_state.step:
        ema = evaluate(parts.ema.module, parts.val_loader, parts.cfg, parts.process)
        parts.echo(f"test, EMA weights: {accuracy(ema, 4)}")
    return {"step": train_state.step, "val": val, "complete": True, "exit_code": 0}


def validate_epoch(run: Run) -> bool:
    """Validates at the end of an epoch (if the run has a val split), logs and says it; whether
    top-1 is the best so far."""
    train_state, val_loader = run.train_state, run.val_loader
    if val_loader is None:
        return False
    at(run, f"validation after epoch {train_state.epoch + 1}")
    # decentralized ranks agree on one model first (the average); record how far apart they were
    agreement = average(run) if run.decent else {}
    if not run.decent:  # every rank's share scored with the statistics the checkpoint keeps: rank 0's
        for module in [run.raw_model] + ([run.ema.module] if run.ema else []):
            distributed.broadcast_buffers(module)
    run.validating = True  # (a loader failure from here is the val loader's)
    val = train_state.last_val = evaluate(run.raw_model, val_loader, run.cfg, run.process)
    top = f"val {accuracy(val)}"
    best_of = val["top1"]
    if run.ema:
        ema = evaluate(run.ema.module, val_loader, run.cfg, run.process)
        val = {**val, **{f"ema_{k}": ema[k] for k in ("top1", "top5") if k in ema}}
        top += f" (EMA {accuracy(ema)})"
        best_of = ema["top1"] if run.cfg.model_ema_best else best_of
    run.validating = False
    run.log.write(kind="val", epoch=train_state.epoch + 1, step=train_state.step, **val, **agreement)
    run.echo(f"epoch {train_state.epoch + 1}: {top} over {val['samples']} images")
    run.health.val_missing, run.health.val_listed = int(val["missing"]), int(val["samples"] + val["missing"])
    warn_if_partial(val, run.health)
    if best_of <= train_state.best_top1:
        return False
    train_state.best_top1 = best_of
    return True


def warn_if_partial(val: dict[str, Any], health: DataHealth) -> None:
    """Says so when a validation did not cover every image its manifest lists, naming the shards
    and samples it could not read first."""
    if not val["missing"]:
        return
    health.poll(health.totals, always=True)
    health.echo(
        f"warning: validation covered {val['samples']} of the {val['samples'] + val['missing']} images the "
        f"manifest lists ({val['missing']} could not be read, named above): its top-1 is over those only",
        err=True,
    )


def average(run: Run) -> dict[str, float]:
    """--dp decent: every rank takes the global average of the models; how far apart they were."""
    run.train_state.averaged_at = run.train_state.step
    return decentralized.consensus(run.model)


def save(run: Run, epoch: int, step_in_epoch: int, best: bool = False) -> None:
    """A checkpoint of the run at ``step_in_epoch`` of ``epoch`` (uploaded too, with the logs).

    Every rank's RNG and data position go in it: collectives, so all ranks call this."""
    cfg, process, train_state, loader = run.cfg, run.process, run.train_state, run.train_loader
    at(run, f"saving the checkpoint of step {train_state.step}")
    if run.decent and train_state.averaged_at != train_state.step:
        average(run)  # the model every rank continues from
    if distributed.any_rank(not finite(run.raw_model), process.device):
        raise Diverged
    rng = distributed.gather_objects(checkpoint.rng_state())
    run.cost.run_totals(train_state.step)
    # where the epochs stand, an exact one's samples trained by any rank (synthetic data has none)
    data = loader.state_dict() if isinstance(loader, ShardLoader) else None
    if not process.main:
        return
    state = {
        "model": run.raw_model.state_dict(),
        "model_ema": run.ema.state_dict() if run.ema else None,
        "optimizer": None if run.decent else run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "epoch": epoch,
        "step": train_state.step,
        "step_in_epoch": step_in_epoch,
        "steps_per_epoch": len(loader),
        "best_top1": train_state.best_top1,
        "run_id": train_state.run_id,
        "trackers": run.log.tracker_ids(),
        "last_val": train_state.last_val,
        "rng": rng,
        "data": data,
        "data_identity": loader.identity(),
        "data_cost": run.cost.state(),
        "keys_logged": keys_log.sizes(run.output, epoch) if cfg.log_keys else {},
        "arch": cfg.arch,
        "classes": run.classes,
        "config": asdict(cfg),
    }
    at(run, f"writing the checkpoint of step {train_state.step}", meeting=False)
    with run.watchdog.checkpoint_written() if run.watchdog else nullcontext():
        saved = checkpoint.save(state, run.output, train_state.step, cfg.keep_last)
    if best:
        checkpoint.link(saved.path, checkpoint.BEST)
    if run.uploader:
        run.uploader.submit(saved.path, checkpoint_step=train_state.step, replace=saved.replaced)
        for file in logs(run.output):
            run.uploader.submit(file)


def finite(module: nn.Module) -> bool:
    """Whether every floating-point weight and buffer of ``module`` is finite (one sync: at saves only)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def finish(run: Run, complete: bool, exit_code: int = 0) -> dict[str, Any]:
    """Closes the run (signals, logs, pending uploads); its outcome."""
    cfg = run.cfg
    if run.watchdog:  # no more collectives: rank 0's uploads may take longer than the timeout
        run.watchdog.close()
    run.stop.restore()
    step = run.train_state.step
    reads = run.cost.closing(run.process.world, step)
    if not cfg.synthetic:
        run.echo(run.health.summary(reads))
    last = run.train_state.last_val or {}
    status = "finished" if complete else "stopped" if exit_code in (0, EXIT_PREEMPTED) else "failed"
    # what the run read, over its attempts so far (those it resumed from too)
    run.log.write(**run.cost.record(status, run.train_state.epoch + 1, step))
    run.log.close(status, {f"final/{k}": last[k] for k in ("top1", "top5") if k in last}, step)
    missing = never_uploaded(run)
    if missing and exit_code in (0, EXIT_PREEMPTED):  # (one that failed otherwise, the other ranks too, keeps its)
        exit_code = EXIT_UPLOAD_FAILED
    if saved := [name for name in (checkpoint.LAST, checkpoint.BEST) if (run.output / name).is_file()]:
        # the run's last line: where to find what it made
        went_up = cfg.upload and not missing
        uploaded = f"; uploaded to {cfg.upload} (its {upload.POINTER} names the last)" if went_up else ""
        run.echo(f"checkpoints in {run.output}: {', '.join(saved)}{uploaded}")
    return {"step": run.train_state.step, "val": run.train_state.last_val, "complete": complete, "exit_code": exit_code}


def never_uploaded(run: Run) -> list[str]:
    """The uploads not made within --flush-timeout of waiting for them (said, if any)."""
    if not run.uploader:
        return []
    run.echo(f"waiting up to {run.cfg.flush_timeout:.0f}s for uploads to {run.cfg.upload}")
    if missing := run.uploader.flush(run.cfg.flush_timeout):
        where = f"{', '.join(missing)} (local copies in {run.output})"
        run.echo(f"ERROR: never uploaded to {run.cfg.upload}: {where}", err=True)
    return missing


def catch_up(cfg: TrainConfig, output: Path, train_state: TrainState, echo: Callable[..., None]) -> int:
    """A finished run's uploads, completed: what an earlier attempt could not upload (a full or
    unreachable location) goes up now. Its exit code: EXIT_UPLOAD_FAILED while some still cannot."""
    if not cfg.upload:
        return 0
    with upload.Uploader(cfg.upload, upload.run_id(output, train_state.run_id), output, cfg.upload_retry_seconds) as up:
        final = output / checkpoint.name_for(train_state.step)
        try:
            pointer = upload.latest(up.store)
            behind = [f for f in logs(output) if not up.store.matches(f.name, f)]
        except upload.BadPointer:
            raise
        except Exception as e:  # each SDK has its own errors
            failure = f"{type(e).__name__}: {e}"
            echo(f"ERROR: {cfg.upload} cannot be read ({failure}): its uploads may be incomplete", err=True)
            return EXIT_UPLOAD_FAILED
        if final.exists() and (pointer is None or pointer["step"] < train_state.step):
            up.submit(final, checkpoint_step=train_state.step)
        for file in behind:
            up.submit(file)
        if missing := up.flush(cfg.flush_timeout):
            echo(f"ERROR: never uploaded to {cfg.upload}: {', '.join(missing)} (local copies in {output})", err=True)
            return EXIT_UPLOAD_FAILED
        sent = [final.name] if up.pointer_step == train_state.step else []
    if sent := sent + [f.name for f in behind]:
        echo(f"uploaded to {cfg.upload} what was missing or behind there: {', '.join(sent)}")
    return 0


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, cfg: TrainConfig, process: distributed.Process) -> dict[str, float]:
    """Top-1 (and top-5, from TOP5_CLASSES classes) over the whole split: each rank scores its own
    disjoint share, then sums."""
    model.eval()
    correct = torch.zeros(
        2, dtype=torch.int64, device=process.device
    )  # top-1, top-5: counted on the device, no sync a batch
    seen = size = 0
    for x, y, _ in loader:
        size = x.shape[-1]
        with autocast(cfg, process.device):
            logits = model(x)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct += torch.stack([(top[:, 0] == y).sum(), (top == y[:, None]).any(dim=1).sum()])
        seen += len(y)
    correct1, correct5 = correct.tolist()
    c1, c5, n, skipped = distributed.all_reduce_sum(
        [correct1, correct5, seen, loader.counters()["skipped"]], process.device
    )
    model.train()
    top5 = {"top5": 100 * c5 / max(n, 1)} if len(loader.classes) >= TOP5_CLASSES else {}
    missing = loader.samples - int(n)  # the manifest's count: unread shards and skipped samples
    return {
        "top1": 100 * c1 / max(n, 1),
        **top5,
        "samples": int(n),
        "missing": missing,
        "skipped": int(skipped),
        "image_size": size,
    }
