"""Run metrics: JSON lines (metrics.jsonl) in the run directory, passed on to the --tracker's
(TensorBoard event files beside it by default), plus GPU samples where there is a GPU."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from imagenet_ais.train.trackers import Tracker, numbers, warn_once

METRICS = "metrics.jsonl"
LOG = "train.log"  # rank 0's messages
CLASSES = "classes.json"  # the class names, in the order of the model's outputs
CONFIG = "config.json"  # the settings of the run's last start (config.differences says where from)
TOP5_CLASSES = 6  # top-5 is measured from this many classes on: of 5 or fewer it is 100% whatever the model


def accuracy(scores: dict[str, Any], digits: int = 2) -> str:
    """A validation's "top-1 X% top-5 Y%" (top-5 where it was measured)."""
    said = f"top-1 {scores['top1']:.{digits}f}%"
    return f"{said} top-5 {scores['top5']:.{digits}f}%" if "top5" in scores else said


class MetricsLog:
    """One record per log interval or validation; resumed runs continue the log and the trackers.

    Every record also goes to each ``--tracker`` (trackers.py; TensorBoard's event files by
    default). A run that resumes at ``step`` drops the records past that step, so the steps
    retrained after a crash are not counted twice; one that starts at step 0 (afresh, or
    --resume finding no checkpoint yet) removes what an attempt that died before its first
    checkpoint left, event files included (TensorBoard's purge marks would leave raw readers
    two copies of its steps). ``report`` (e.g. Ray Train's) gets every record on every rank,
    files or not.
    """

    def __init__(
        self,
        output: Path | None,
        step: int = 0,
        report: Callable[[dict], None] | None = None,
        trackers: list[Tracker] | None = None,
    ):
        if output and step == 0:
            for leftover in (output / METRICS, *output.glob("events.out.tfevents.*")):
                leftover.unlink(missing_ok=True)
        elif output:
            _drop_records_after(output / METRICS, step)
        self.file = (output / METRICS).open("a", buffering=1) if output else None
        self.trackers = trackers or []
        self.report = report

    def write(self, **record: Any) -> None:
        if self.report:
            self.report(record)
        if not self.file:
            return
        self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        for tracker in list(self.trackers):
            try:
                tracker.log(numbers(record, tracker.every_rank), record["step"])
            except Exception as e:  # a tracker's server gone: the run goes on, metrics.jsonl has it all
                warn_once(tracker, e)
                self.trackers.remove(tracker)

    def tracker_ids(self) -> dict[str, str]:
        """The trackers' runs, for the checkpoint: a resumed run continues them."""
        return {t.name: t.run_id for t in self.trackers if t.run_id}

    def close(self, status: str = "finished", values: dict[str, float] | None = None, step: int = 0) -> None:
        """Ends the log and the trackers' runs: ``status`` finished, stopped or failed; ``values``
        (the final result) go to the trackers last."""
        for tracker in self.trackers:
            try:
                tracker.finish(status, values or {}, step)
            except Exception as e:
                warn_once(tracker, e)
        self.trackers = []
        if self.file:
            self.file.close()


def logs(output: Path) -> list[Path]:
    """The run's files that go up with each checkpoint."""
    return [f for f in (output / METRICS, output / LOG, *output.glob("events.out.tfevents.*")) if f.exists()]


def _drop_records_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    text = path.read_text(errors="replace")
    kept = []
    for line in text.splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the crash that made this a resume
    if "".join(kept) != text:
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(kept))
        partial.replace(path)


# NVML's clock-event reasons that slow a busy GPU down (a record's ``gpu_throttle`` holds these
# bits); idle, application clocks and sync boost are no slowdown. Figures taken while one of
# the last four was set are not the card's: one lent GPU at 91 °C ran at 1,230 MHz.
THROTTLE_REASONS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "power_brake",
}  # fmt: skip
SLOWDOWNS = 0x8 | 0x20 | 0x40 | 0x80


def gpu_sample(device: torch.device) -> dict[str, float]:
    """GPU utilisation (%, over the driver's last sample period), peak memory (GiB), SM clock
    (MHz), temperature (°C) and the throttle reasons in force (bits of THROTTLE_REASONS); {} on
    CPU, and NaN for what NVML cannot tell (missing, or refused in a container)."""
    if device.type != "cuda":
        return {}
    sample = {"gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}
    nan = float("nan")
    try:
        import pynvml  # nvidia-ml-py, as torch.cuda.utilization uses it

        handle = _nvml_handle(device.index if device.index is not None else torch.cuda.current_device())
        reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        return {
            **sample,
            "gpu_util": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "gpu_sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "gpu_temp_c": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "gpu_throttle": float(sum(bit for bit in THROTTLE_REASONS if reasons & bit)),
        }
    except Exception:  # no NVML here: memory only
        return {**sample, "gpu_util": nan, "gpu_sm_mhz": nan, "gpu_temp_c": nan, "gpu_throttle": nan}


@functools.cache
def _nvml_handle(index: int) -> Any:
    """NVML's handle of the CUDA device ``index`` (found by UUID: NVML numbers the GPUs its own way,
    ignoring CUDA_VISIBLE_DEVICES)."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")


def throttle_names(bits: float) -> list[str]:
    """The names of a record's ``gpu_throttle`` bits."""
    return [name for bit, name in THROTTLE_REASONS.items() if int(bits) & bit]


def rank_says(rank: int, message: str) -> None:
    """A message of a rank other than 0, for itself (on stderr, with its rank)."""
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)


def voice(echo: Callable[..., None], rank: int) -> Callable[[str], None]:
    """Where ``rank`` says a failure: rank 0 on its console and in its log (``echo``, on stderr),
    another rank on stderr with its rank (``rank_says``)."""
    return functools.partial(echo, err=True) if rank == 0 else functools.partial(rank_says, rank)


class Reporter:
    """Rank 0's messages, on the console and in ``train.log``."""

    def __init__(self, path: Path | None):
        self.path = path

    def echo(self, message: str, err: bool = False) -> None:
        if self.path:
            print(message, file=sys.stderr if err else sys.stdout, flush=True)
            # opened for each line: a resume that fetches the uploaded log replaces the file
            with self.path.open("a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
