"""What an epoch shows and records as it goes: the progress bar (or plain lines in a job log) and
the metrics window between two records."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from imagenet_ais import distributed
from imagenet_ais.data import SyntheticLoader, TrainLoader
from imagenet_ais.metrics import gpu_sample


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
