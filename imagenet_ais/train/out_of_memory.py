"""A GPU that runs out of memory, told in one line: the settings that size the run's memory and
what to change, instead of a traceback from deep inside a step (or a compiled graph's warm-up,
which raises it as the cause of an error of its own).

Nothing is saved on the way out: the weights of a step that failed half way are not a state to
go on from, so the last checkpoint stands, and ``--resume auto`` goes on from it with the
settings changed (a new --batch-size shares the rest of its epoch among the new batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from imagenet_ais.errors import OutOfMemory
from imagenet_ais.train.config import TrainConfig

GIB = 2**30


def behind(e: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error that ``e`` is, or that caused it (its cause or context, however deep)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


@contextmanager
def told(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """Around a run on ``device``: a device out of memory becomes one line (``OutOfMemory``)."""
    try:
        yield
    except Exception as e:
        if behind(e) is None:
            raise
        raise OutOfMemory(said(cfg, device)) from e


def said(cfg: TrainConfig, device: torch.device) -> str:
    size = f"--progressive {cfg.progressive}" if cfg.progressive else f"--image-size {cfg.image_size}"
    where = str(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        peak = torch.cuda.max_memory_allocated(device) / GIB
        where += f" ({peak:.1f} GiB in use at most, of {total:.1f})"
    return (
        f"{where} ran out of memory for {cfg.arch} at --batch-size {cfg.batch_size} per GPU, {size}: lower "
        "--batch-size (or the image size); a run that saved a checkpoint goes on from it with --resume auto and "
        "the new --batch-size"
    )
