"""What an epoch shows and records as it goes: the progress bar (or plain lines in a job log) and
the metrics window between two records."""

from __future__ import annotations

import itertools
import math
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from imagenet_ais import distributed
from imagenet_ais.loader.shard_loader import ShardLoader
from imagenet_ais.loader.synthetic import SyntheticLoader
from imagenet_ais.train import data_cost
from imagenet_ais.train.metrics import gpu_sample


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


class StepClock:
    """When each step of a window began, on the device's own timeline where there is a GPU (CUDA
    events on the training stream: the host only queues steps, and may run ahead of them)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.forwards: list[Any] = []  # when each step's forward pass ended

    def mark(self) -> None:
        self.marks.append(self._now())

    def forwarded(self) -> None:
        """The step's forward pass is done: its time is this rank's own work, no wait for the
        other ranks in it (DDP's all-reduce is in the backward pass; SyncBatchNorm's aside)."""
        self.forwards.append(self._now())

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def durations_ms(self) -> list[float]:
        """Each marked step's time to the next mark (the last one's to now); call once the device
        has done the steps."""
        self.mark()
        if self.cuda:
            self.marks[-1].synchronize()
        return [self._ms(a, b) for a, b in itertools.pairwise(self.marks)]

    def forward_ms(self) -> list[float]:
        """Each marked step's forward pass (after ``durations_ms``)."""
        return [self._ms(a, b) for a, b in zip(self.marks, self.forwards, strict=False)]

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)


class Window:
    """One metrics interval of the epoch loop: its steps, their losses and times, the time spent
    waiting for data, the bytes read (``read``: the loader's read totals at its start, as the
    window before it ended with them)."""

    def __init__(
        self,
        device: torch.device,
        loader: ShardLoader | SyntheticLoader,
        start: float | None = None,
        read: dict[str, int] | None = None,
    ) -> None:
        self.device = device
        self.start = time.perf_counter() if start is None else start
        self.end = self.start
        self.read_start = self.read_end = read if read is not None else data_cost.totals(loader.reads())
        self.steps, self.waited = 0, 0.0
        self.losses: list[torch.Tensor] = []
        self.clock = StepClock(device)

    def record(
        self,
        loader: ShardLoader | SyntheticLoader,
        process: distributed.Process,
        global_batch: int,
        epoch: int,
        step: int,
        lr: float,
        image_size: int,
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """This window's ``kind: train`` metrics record, and the data counters in it (summed over ranks).

        The window ends once the GPU has done its steps (the loss waits for them): timed when the
        CPU had only queued them, a rate would count work the GPU had yet to do. ``ranks`` holds
        each rank's own figures: its step times, data wait, feed threads and GPU."""
        losses = torch.stack(self.losses).float()
        loss, finite = float(losses.mean()), torch.isfinite(losses).tolist()
        nonfinite_tail = len(finite) - (max(i for i, ok in enumerate(finite) if ok) + 1 if any(finite) else 0)
        self.end = time.perf_counter()
        elapsed = self.end - self.start
        steps_ms = sorted(self.clock.durations_ms())
        forward_ms = sorted(self.clock.forward_ms())
        counters = loader.counters()
        self.read_end = data_cost.totals(loader.reads())
        mine = {
            "loss": loss,
            "nonfinite_tail": nonfinite_tail,  # the window's last steps whose loss was NaN or infinite
            **counters,
            "data_wait": self.waited / elapsed,
            "step_ms_p50": _quantile(steps_ms, 0.5),
            "step_ms_p90": _quantile(steps_ms, 0.9),
            "forward_ms_p50": _quantile(forward_ms, 0.5),  # this rank's own pace, the others' waits left out
            # this rank's reads: from the stores (copies fetched into the cache included), and from the cache
            **{
                f"{name.removesuffix('_bytes')}_mb_s": (self.read_end[name] - self.read_start[name]) / elapsed / 1e6
                for name in ("read_bytes", "cache_bytes")
            },
            # the feed threads' share of the time working: the one near 1 is what the step waits for
            **{f"busy_{k}": v / elapsed for k, v in loader.busy().items()},
            **gpu_sample(process.device),
        }
        ranks = [
            dict(zip(mine, values, strict=True)) for values in distributed.gather_floats(list(mine.values()), process)
        ]
        totals = {k: int(sum(r[k] for r in ranks)) for k in counters}
        record = {
            "kind": "train",
            "epoch": epoch + 1,  # counted from 1, as on the console
            "step": step,
            "loss": sum(r["loss"] for r in ranks) / process.world,
            "lr": lr,
            "img_per_s": self.steps * global_batch / elapsed,
            "nonfinite_tail": max(int(r["nonfinite_tail"]) for r in ranks),  # any rank's, the same on all
            "image_size": image_size,
            # rank 0's, as before ranks were recorded (NaN: what NVML could not tell)
            **{k: v for k, v in mine.items() if k.startswith(("gpu_", "busy_")) and not math.isnan(v)},
            "data_wait": mine["data_wait"],
            **totals,
            "ranks": [
                {
                    k: _rounded(v)
                    for k, v in r.items()
                    if k not in ("loss", "nonfinite_tail", *counters) and not math.isnan(v)
                }
                for r in ranks
            ],
        }
        return record, totals


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else 0.0


def _rounded(value: float) -> float | int:
    return int(value) if value.is_integer() else round(value, 3)
