"""A GPU that runs out of memory, told in one line: the settings that size the run's memory and
what to change, instead of a traceback from deep inside a step (or a compiled graph's warm-up,
which raises an error of its own in its place).

Nothing is saved on the way out: the weights of a step that failed half way are not a state to
go on from, so the last checkpoint stands, and ``--resume auto`` goes on from it with the
settings changed (a new --batch-size shares the rest of its epoch among the new batches).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from imagenet_ais.errors import OutOfMemory
from imagenet_ais.train.config import TrainConfig, image_sizes

GIB = 2**30
# A full GPU met outside PyTorch's caching allocator (a library's own allocation, a raw cudaMalloc,
# NCCL's buffers, whose last warning torch's DistBackendError quotes): torch raises these as plain
# errors, not as OutOfMemoryError
OUT_OF_MEMORY = re.compile(
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA error: out of memory"
    r"|Cuda failure (\d+ )?'out of memory'|Failed to CUDA calloc"
)


def behind(e: BaseException | None) -> BaseException | None:
    """The out-of-memory error that ``e`` is, or was raised from (``raise ... from``, or in place of
    it, ``from None``). Not one that ``e`` merely came while handling: that is another failure."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and OUT_OF_MEMORY.search(str(e))):
            return e
        seen.add(id(e))
        e = e.__cause__ or (e.__context__ if e.__suppress_context__ else None)
    return None


@contextmanager
def told(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """Around a run on ``device`` before its epochs: running out of memory becomes ``OutOfMemory``."""
    try:
        yield
    except Exception as e:
        if (oom := behind(e)) is None:
            raise
        raise OutOfMemory(said(cfg, device, oom)) from e


def said(cfg: TrainConfig, device: torch.device, oom: BaseException, epoch: int = 0) -> str:
    """The line for ``oom`` on ``device``, training epoch ``epoch`` (from 0) as ``cfg`` says."""
    sizes, val_size = image_sizes(cfg)
    size = f"images of {sizes[epoch]} px" + (f" (validation {val_size} px)" if val_size != sizes[epoch] else "")
    where = str(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        peak = torch.cuda.max_memory_allocated(device) / GIB
        where += f" ({peak:.1f} GiB in use at most, of {total:.1f})"
    if wanted := re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(oom)):
        where += f", asked for {wanted[1]} more,"
    return (
        f"{where} ran out of memory for {cfg.arch} at --batch-size {cfg.batch_size} per GPU, {size}: lower "
        "--batch-size (or the image size); a run that saved a checkpoint goes on from it with --resume auto and "
        "the new --batch-size"
    )
