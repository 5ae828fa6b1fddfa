"""Run metrics: JSON lines (metrics.jsonl) and TensorBoard event files, side by side in the run
directory, plus GPU utilisation and memory samples where there is a GPU."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

METRICS = "metrics.jsonl"
LOG = "train.log"  # rank 0's messages


class MetricsLog:
    """One record per log interval or validation; resumed runs continue both logs.

    Every number of a record also goes to TensorBoard as ``<kind>/<name>`` at its step. A
    run that resumes (``resume_step``: the step it continues from, 0 when --resume found no
    checkpoint yet) drops the records past that step, in both logs, so the steps retrained
    after a crash are not counted twice. ``report`` (e.g. Ray Train's) gets every record on
    every rank, files or not.
    """

    def __init__(
        self, output: Path | None, resume_step: int | None = None, report: Callable[[dict], None] | None = None
    ):
        if output and resume_step is not None:
            _drop_records_after(output / METRICS, resume_step)
        self.file = (output / METRICS).open("a", buffering=1) if output else None
        # TensorBoard purges events at or after purge_step; the record at the resume step stays
        purge = None if resume_step is None else resume_step + 1
        self.board = SummaryWriter(str(output), purge_step=purge) if output else None
        self.report = report

    def write(self, **record: Any) -> None:
        if self.report:
            self.report(record)
        if not self.file or not self.board:
            return
        self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        for name, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and name not in ("step", "epoch"):
                self.board.add_scalar(f"{record['kind']}/{name}", value, record["step"])
        self.board.flush()

    def close(self) -> None:
        if self.file and self.board:
            self.file.close()
            self.board.close()


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


def gpu_sample(device: torch.device) -> dict[str, float]:
    """GPU utilisation (%, over the driver's last sample period) and peak memory (GiB); {} on CPU."""
    if device.type != "cuda":
        return {}
    sample = {"gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}
    with contextlib.suppress(Exception):  # NVML missing, or refused in a container: memory only
        sample["gpu_util"] = float(torch.cuda.utilization(device))
    return sample


class Reporter:
    """Rank 0's messages, on the console and in ``train.log``."""

    def __init__(self, path: Path | None):
        self.path = path

    def say(self, message: str, err: bool = False) -> None:
        if self.path:
            print(message, file=sys.stderr if err else sys.stdout, flush=True)
            # opened for each line: a resume that fetches the uploaded log replaces the file
            with self.path.open("a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
