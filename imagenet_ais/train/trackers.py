"""``--tracker``: where a run's records go besides metrics.jsonl: TensorBoard event files in
--output (always, unless ``--tracker none``), MLflow, Weights & Biases (repeatable).

Each gets, from rank 0, the run's settings at its start, every training record (each
``--log-every`` steps) and validation record as ``<kind>/<name>`` at its step, and the outcome at
the end. MLflow and W&B are imported only when asked for: each is an extra (``./run venv --extra
mlflow,wandb``; an install that fails to import says why). MLflow's store is
MLFLOW_TRACKING_URI, else a sqlite file in --output (never the current directory's). A resumed
run continues the same MLflow or W&B run: their ids are kept in the checkpoint. Where a tracker
fails during the run, it says so once and the run goes on without it. Each says at the start
where its runs are and how to look at them (``where``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from imagenet_ais.errors import ConfigError, first_line, needs_extra

PER_RANK_TAGS = 16  # ranks up to which each has its own tags in MLflow and W&B too (rank_figures)
RANK_DIGITS = 3  # a tag's rank, zero-padded to sort: the same tag for a run resumed on more ranks
TRACKERS = ("tensorboard", "mlflow", "wandb", "none")  # none: metrics.jsonl alone
PROJECT = "imagenet-ais"  # MLflow's experiment and W&B's project, unless MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT


class Tracker(Protocol):
    name: str
    run_id: str  # what a resumed run continues ("" for TensorBoard: its files are the run's)
    where: str  # where its runs are and how to look at them, for the run's first lines
    every_rank: bool  # each rank's figures, however many ranks (else their spread beyond PER_RANK_TAGS)

    def log(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, status: str, values: dict[str, float], step: int) -> None: ...


def runnable(command: str) -> str:
    """``command`` as a shell runs it: its name where PATH finds it, else its path beside this
    interpreter (a venv's tools are in its bin folder, which PATH often lacks)."""
    beside = Path(sys.executable).parent / command
    return str(beside) if not shutil.which(command) and beside.exists() else command


def numbers(record: dict[str, Any], every_rank: bool = True) -> dict[str, float]:
    """A metrics record's numbers as ``<kind>/<name>`` (step and epoch are where, not what), and
    its ranks' figures (``ranks``, with several ranks: rank_figures)."""
    ranks = record.get("ranks", []) if record["kind"] == "train" else []
    return {
        **{
            f"{record['kind']}/{name}": float(value)
            for name, value in record.items()
            if _number(value) and name not in ("step", "epoch")
        },
        **(rank_figures(ranks, every_rank) if len(ranks) > 1 else {}),
    }


def rank_figures(ranks: list[dict[str, Any]], every_rank: bool) -> dict[str, float]:
    """Each rank's own figures as ``ranks/<name>/<rank>`` (one panel group, filtered by name);
    unless ``every_rank``, only up to PER_RANK_TAGS ranks, and beyond, each figure's spread:
    ``ranks/<name>/`` min, median and max, with the ranks that have the min and the max
    (``min_rank``, ``max_rank``). A tag per rank and figure at every record is thousands at a few
    hundred ranks: too many for MLflow's and W&B's quotas. metrics.jsonl keeps every rank's."""
    digits = max(RANK_DIGITS, len(str(len(ranks) - 1)))
    values: dict[str, list[tuple[float, int]]] = {}  # each figure's (value, rank), where a number
    for rank, figures in enumerate(ranks):
        for name, value in figures.items():
            if _number(value):
                values.setdefault(name, []).append((float(value), rank))
    if every_rank or len(ranks) <= PER_RANK_TAGS:
        return {f"ranks/{name}/{rank:0{digits}d}": v for name, pairs in values.items() for v, rank in pairs}
    spread: dict[str, float] = {}
    for name, pairs in values.items():
        (low, low_rank), (high, high_rank) = min(pairs), max(pairs)
        spread |= {
            f"ranks/{name}/min": low,
            f"ranks/{name}/median": statistics.median(v for v, _ in pairs),
            f"ranks/{name}/max": high,
            f"ranks/{name}/min_rank": float(low_rank),
            f"ranks/{name}/max_rank": float(high_rank),
        }
    return spread


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class TensorBoard:
    name, run_id = "tensorboard", ""
    every_rank = True  # (local files: a tag per rank and figure costs only their size)

    def __init__(self, output: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard purges events at or after purge_step; the record at the resume step stays
        self.board = SummaryWriter(str(output), purge_step=step + 1 if step else None)
        self.where = f"TensorBoard: event files in {output} ({runnable('tensorboard')} --logdir {output})"

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.board.add_scalar(name, value, step)
        self.board.flush()

    def finish(self, status: str, values: dict[str, float], step: int) -> None:
        self.board.close()


# MLflow's own defaults wait 120 s for each of 7 tries: a server that takes connections and never
# answers held the run for over 5 minutes without a word. Set while the run lasts, where the
# environment does not say otherwise.
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


class MLflow:
    """A run of MLflow's client (MLFLOW_TRACKING_URI, else OUTPUT/mlflow.db): no global active
    run is set in this process."""

    name = "mlflow"
    every_rank = False

    def __init__(self, settings: dict[str, Any], title: str, run_id: str, output: Path):
        with needs_extra("mlflow", "--tracker mlflow"):
            from mlflow import MlflowClient
            from mlflow.entities import Param
        self.bounded = [key for key in MLFLOW_BOUNDS if key not in os.environ]
        os.environ.update({key: MLFLOW_BOUNDS[key] for key in self.bounded})
        own = Path(output).resolve()  # the store's folder unless MLFLOW_TRACKING_URI names one
        given = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = given or f"sqlite:///{own / 'mlflow.db'}"
        self.where = f"MLflow: runs in {self.uri} ({runnable('mlflow')} ui --backend-store-uri {self.uri})"
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            if not run_id:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
                found = self.client.get_experiment_by_name(experiment)
                artifacts = None if given else (own / "mlruns").as_uri()
                ident = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
                run_id = self.client.create_run(ident, run_name=title).info.run_id
                params = [Param(k, str(v)[:500]) for k, v in settings.items()]
                self.client.log_batch(run_id, params=params)
            else:
                self.client.update_run(run_id, status="RUNNING")
        except Exception as e:  # the store's own errors: one line, before anything trains
            self._unbound()
            # runs started before the store moved into --output kept their MLflow run in ./mlflow.db
            earlier = "" if given or not run_id else "; a run begun in ./mlflow.db: MLFLOW_TRACKING_URI=sqlite:///PATH"
            raise ConfigError(f"--tracker mlflow: {_first_line(e)} (tracking URI {self.uri}{earlier})") from None
        self.run_id = run_id

    def _unbound(self) -> None:
        for key in self.bounded:
            os.environ.pop(key, None)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, status: str, values: dict[str, float], step: int) -> None:
        try:
            if values:
                self.log(values, step)
            self.client.set_terminated(self.run_id, {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED"))
        finally:
            self._unbound()


class Wandb:
    """A W&B run (WANDB_MODE=offline keeps it in OUTPUT/wandb for ``wandb sync``)."""

    name = "wandb"
    every_rank = False

    def __init__(self, settings: dict[str, Any], title: str, run_id: str, output: Path):
        with needs_extra("wandb", "--tracker wandb"):
            import wandb
        project = os.environ.get("WANDB_PROJECT", PROJECT)
        try:
            self.run = wandb.init(
                project=project, name=title, id=run_id or None, resume="allow" if run_id else None,
                config=settings, dir=str(output),
            )  # fmt: skip
        except Exception as e:  # no API key, no server: one line, before anything trains
            login = f"{runnable('wandb')} login"
            raise ConfigError(f"--tracker wandb: {_first_line(e)} ({login}, or WANDB_MODE=offline)") from None
        self.run_id = self.run.id
        offline = os.environ.get("WANDB_MODE") == "offline"
        self.where = (
            f"W&B: offline run {self.run_id} in {output}/wandb ({runnable('wandb')} sync uploads it)"
            if offline
            else f"W&B: {self.run.url or f'run {self.run_id} of project {project}'}"
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, status: str, values: dict[str, float], step: int) -> None:
        self.run.summary.update(values)
        self.run.finish(exit_code=0 if status == "finished" else 1)


def open_trackers(
    names: tuple[str, ...], output: Path, settings: dict[str, Any], step: int, resumed: dict[str, str]
) -> list[Tracker]:
    """The trackers ``names`` asks for, TensorBoard's beside them unless "none", continuing the
    runs ``resumed`` names (from the checkpoint)."""
    if unknown := [n for n in names if n not in TRACKERS]:
        raise ConfigError(f"--tracker {unknown[0]!r}: one of {', '.join(TRACKERS)}")
    if "none" in names:
        if set(names) != {"none"}:
            raise ConfigError("--tracker none with another tracker: give one or the other")
        return []
    opened: list[Tracker] = []
    try:
        # TensorBoard last: a tracker that cannot start then leaves no event file in --output
        for name in [*(n for n in dict.fromkeys(names) if n != "tensorboard"), "tensorboard"]:
            if name == "tensorboard":
                opened.append(TensorBoard(output, step))
            elif name == "mlflow":
                opened.append(MLflow(settings, output.name, resumed.get(name, ""), output))
            else:
                opened.append(Wandb(settings, output.name, resumed.get(name, ""), output))
    except BaseException:
        for tracker in opened:
            tracker.finish("failed", {}, step)
        raise
    return opened


def warn_once(tracker: Tracker, e: Exception) -> None:
    print(
        f"WARNING: --tracker {tracker.name} failed ({type(e).__name__}: {_first_line(e)}); the run goes on "
        "without it (metrics.jsonl has every record)",
        file=sys.stderr,
        flush=True,
    )


def _first_line(e: BaseException) -> str:
    return (first_line(e) or type(e).__name__)[:200]
