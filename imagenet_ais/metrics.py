"""Run metrics: JSON lines (metrics.jsonl) and TensorBoard event files, side by side in the run
directory, plus GPU utilisation and memory samples where there is a GPU."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

METRICS = "metrics.jsonl"


class MetricsLog:
    """One record per log interval or validation; resumed runs continue both logs.

    Every number of a record also goes to TensorBoard as ``<kind>/<name>`` at its step. A
    resumed run drops the records past the step it resumes from, in both logs, so the steps
    retrained after a crash are not counted twice. ``report`` (e.g. Ray Train's) gets every
    record on every rank, files or not.
    """

    def __init__(self, output: Path | None, resume_step: int = 0, report: Callable[[dict], None] | None = None):
        if output and resume_step:
            _drop_records_after(output / METRICS, resume_step)
        self.file = (output / METRICS).open("a", buffering=1) if output else None
        self.board = SummaryWriter(str(output), purge_step=resume_step or None) if output else None
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
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
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
