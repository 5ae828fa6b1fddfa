#!/usr/bin/env python3
"""Train on a Ray cluster through Ray Train's TorchTrainer: ``./run ray`` calls this.

    tools/ray_train.py [--address auto|HOST:PORT] [--num-workers N] [--gpu] -- TRAIN.PY OPTIONS

Each Ray worker runs the same training as train.py (data pipeline, checkpoints, uploads), one
worker per GPU with --gpu, else N CPU workers over gloo; every metrics record is also
reported to Ray. Without --address (or RAY_ADDRESS) it starts a private local cluster and
stops it at the end; a cluster it connects to is left running. A cluster with token
authentication (Ray's default since 2.59) needs its token here: RAY_AUTH_TOKEN, a file at
RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token; any of them turns on RAY_AUTH_MODE=token. A lost
worker restarts the group (--max-failures times), which continues from the last checkpoint.
The workers get the
``imagenet_ais`` package shipped by Ray; its dependencies (requirements.txt) must be installed
on the cluster's nodes, and --data and --output must be reachable from all of them.

SIGTERM or SIGUSR1 to this driver stops the run as they stop train.py: the driver leaves
STOP_FILE in --output, where every worker looks each second (Ray runs training in a thread,
which cannot take signals); the workers save together and end, and the driver exits 75 once
they have saved (1 if they could not). SIGINT (Ctrl-C) is Ray Train's own: it aborts the run,
which continues from its last checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import click
import torch

import imagenet_ais
from imagenet_ais.cli import train as train_cli
from imagenet_ais.errors import EXIT_PREEMPTED, first_line
from imagenet_ais.loader.mixture import parse_source
from imagenet_ais.train import setup
from imagenet_ais.train.watchdog import FIRST

STOP_FILE = ".ray-stop"  # the driver's word to its workers, in --output (which all of them reach)


def token_available() -> bool:
    """A Ray auth token in the places Ray looks: the environment, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


def listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError):
        return False
    return True


def connect_refused(address: str) -> click.ClickException:
    """Ray says only 'Failed to connect' when a cluster refuses the token: tell the likely cause apart."""
    if address != "auto" and not listening(address):
        return click.ClickException(f"no Ray cluster answers at {address}: check RAY_ADDRESS (the head's GCS port)")
    if not token_available():
        return click.ClickException(
            f"the Ray cluster at {address} refused the connection, most likely for authentication (token auth is "
            "Ray's default since 2.59): set RAY_AUTH_TOKEN_PATH to a file holding the cluster's token "
            "(~/.ray/auth_token on its head) or RAY_AUTH_TOKEN to the token"
        )
    return click.ClickException(
        f"the Ray cluster at {address} refused the connection: is the token in RAY_AUTH_TOKEN / "
        "RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token the cluster's own, and is RAY_AUTH_MODE not 'disabled'?"
    )


def worker(config: dict) -> None:
    import ray.train

    from imagenet_ais.train.config import TrainConfig
    from imagenet_ais.train.loop import train

    cfg = TrainConfig(**config)
    stop, done = threading.Event(), threading.Event()
    threading.Thread(target=_watch, args=(Path(cfg.output, STOP_FILE), stop, done), daemon=True).start()
    try:
        outcome = train(cfg, report=ray.train.report, stop=stop)
    finally:
        done.set()
    if outcome["exit_code"] not in (0, EXIT_PREEMPTED):
        raise RuntimeError(f"training ended with status {outcome['exit_code']} (see {cfg.output}/train.log)")


def _watch(path: Path, stop: threading.Event, done: threading.Event) -> None:
    """Sets ``stop`` once the driver has left ``path`` (it was signalled), until ``done``."""
    while not done.wait(1.0):
        if path.exists():
            stop.set()
            return


class Stopping:
    """The driver's signal handlers while the run lasts: the first signal leaves the stop file."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # (SIGINT: Ray Train's fit() takes it, to abort)

    def __init__(self, output: Path):
        self.path = output / STOP_FILE
        self.at: float | None = None  # when the first signal came
        self.path.unlink(missing_ok=True)  # an earlier run's: this one must not stop at once
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.at is None:
            self.at = time.time()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
            click.echo(f"{signal.Signals(signum).name}: the workers save and stop (Ctrl-C aborts)", err=True)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.path.unlink(missing_ok=True)

    def saved(self) -> bool:
        """Whether the workers saved after the signal."""
        last = self.path.parent / "last.pt"
        return self.at is not None and last.exists() and last.stat().st_mtime >= self.at


def finished(output: Path, epochs: int) -> bool:
    """Whether the run in ``output`` has trained all its epochs (a signal may come after its end)."""
    last = output / "last.pt"
    return last.exists() and torch.load(last, map_location="cpu", weights_only=True)["epoch"] >= epochs


def _resolved(location: str | None) -> str | None:
    """A directory as an absolute path (the workers' current directory is Ray's); a URL as it is."""
    return str(Path(location).resolve()) if location and "://" not in location else location


@click.command(context_settings={"show_default": True})
@click.option("--address", envvar="RAY_ADDRESS", help="Ray cluster to use; none: a private local one")
@click.option("--num-workers", default=2, type=click.IntRange(min=1), help="training processes (GPUs with --gpu)")
@click.option("--gpu/--cpu", default=False, help="one GPU per worker (NCCL), or CPU workers (gloo)")
@click.option("--cpus-per-worker", default=1.0, type=click.FloatRange(min=0), help="CPUs Ray reserves per worker")
@click.option(
    "--max-failures",
    default=3,
    type=click.IntRange(min=0),
    help="restarts of the worker group after a lost worker; each continues from the last checkpoint",
)
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def main(
    address: str | None,
    num_workers: int,
    gpu: bool,
    cpus_per_worker: float,
    max_failures: int,
    train_args: tuple[str, ...],
) -> None:
    cfg = train_cli.parse(list(train_args))
    # the workers' current directory is Ray's, not this one
    cfg.output = str(Path(cfg.output).resolve())
    cfg.data, cfg.val_data = _resolved(cfg.data), _resolved(cfg.val_data)
    cfg.mix = tuple(f"{_resolved(s.location)}:{s.weight!r}" for s in map(parse_source, cfg.mix))
    if max_failures and cfg.resume is None:
        # a restarted group must continue, not start over: that needs --resume auto, which is a
        # fresh start only where neither --output nor --upload holds a run yet
        if held := setup.held_run(Path(cfg.output), cfg):
            raise click.ClickException(held)
        cfg.resume = "auto"
    if address and "RAY_AUTH_MODE" not in os.environ and token_available():
        os.environ["RAY_AUTH_MODE"] = "token"  # Ray itself does not use a token it finds when connecting

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    try:
        ray.init(address=address or "local", runtime_env={"py_modules": [str(Path(imagenet_ais.__file__).parent)]})
    except ConnectionError:
        raise connect_refused(address or "local") from None
    try:
        trainer = TorchTrainer(
            worker,
            train_loop_config=asdict(cfg),
            # the group's own timeout past --collective-timeout, as train.py's (Ray sets the group up)
            torch_config=TorchConfig(timeout_s=int(cfg.collective_timeout + FIRST)) if cfg.collective_timeout else None,
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=gpu, resources_per_worker={"CPU": cpus_per_worker}
            ),
            run_config=RunConfig(
                name="ray",
                storage_path=str(Path(cfg.output, "ray")),
                failure_config=FailureConfig(max_failures=max_failures),
            ),
        )
        stopping = Stopping(Path(cfg.output))
        try:
            trainer.fit()
        except TrainingFailedError as e:  # a worker's failure, retried --max-failures times
            first = first_line(e) or type(e).__name__
            raise click.ClickException(f"Ray training failed: {first} (see {cfg.output}/train.log)") from None
        finally:
            stopping.restore()
    finally:
        ray.shutdown()  # a private cluster stops here; a connected one is only left
    if stopping.at is not None and not finished(Path(cfg.output), cfg.epochs):
        if not stopping.saved():
            raise click.ClickException(f"stopped by a signal, but no checkpoint was saved after it in {cfg.output}")
        click.echo(f"stopped by a signal, checkpoint saved in {cfg.output}: continue with the same command")
        sys.exit(EXIT_PREEMPTED)
    click.echo(f"done: metrics in {Path(cfg.output, 'metrics.jsonl')}, checkpoints in {cfg.output}")


if __name__ == "__main__":
    main()
