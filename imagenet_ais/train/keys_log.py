"""``--log-keys``: the key of every sample trained on, one file per epoch and rank, to check
exact epochs. Like the metrics log, a resumed run first cuts the files back to what its
checkpoint had trained (sizes recorded at each save), so they hold each trained step once.
Files are named by the epoch's number counted from 1, as the console and metrics.jsonl count;
``epoch`` arguments are the run's index, from 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO


def _path(output: Path, epoch: int, rank: int) -> Path:
    return output / "keys" / f"epoch{epoch + 1:03d}-rank{rank}.txt"


def open_log(output: Path, epoch: int, rank: int) -> TextIO:
    path = _path(output, epoch, rank)
    path.parent.mkdir(exist_ok=True)
    return path.open("a", buffering=1)  # line-buffered: each step's keys are written at once


def sizes(output: Path, epoch: int) -> dict[str, int]:
    """The sizes of ``epoch``'s files in ``output`` (for the checkpoint saved now)."""
    return {p.name: p.stat().st_size for p in (output / "keys").glob(f"epoch{epoch + 1:03d}-rank*.txt")}


def cut_back(output: Path, epoch: int, recorded: dict[str, int]) -> None:
    """Files of ``epoch`` back to their ``recorded`` sizes; of later epochs, emptied."""
    for path in (output / "keys").glob("epoch*-rank*.txt"):
        file_epoch = int(path.name[len("epoch") :].partition("-")[0]) - 1
        keep = recorded.get(path.name, 0) if file_epoch == epoch else 0
        if file_epoch >= epoch and path.stat().st_size > keep:
            os.truncate(path, keep)
