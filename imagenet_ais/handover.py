"""JPEG bytes handed from the DataLoader workers to the training process where they lie.

The usual way, each worker batch's bytes (56 MB for 512 ImageNet-sized JPEGs) go into a fresh
shared-memory block: the worker copies them in, then the training process faults the new mapping
in page by page while it copies them again into pinned memory, and unmaps and frees the block
with the interpreter lock held. On the GPU hosts that receiving thread took about 30 ms a batch
(ResNet-18 at 11,500 img/s, bench/RESULTS.md run AK), near the step's own 27 ms.

Here the training process makes a few buffers per worker once, in shared memory and, on CUDA,
page-locked (so the GPU copies from them directly). A worker writes a batch's bytes into one of
its own buffers that is free and sends only the buffer's number; the training process reads the
bytes in place; a buffer is free again once no tensor in the training process refers to it.
The pixels of samples a worker cropped itself (cpu_share.py) follow the JPEGs in the same buffer.
Where none of a worker's buffers is free, or a batch is larger than one, the batch goes the
usual way: nothing waits on a buffer, so nothing can deadlock on one.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imagenet_ais.transforms import as_bytes

PER_WORKER = 3  # a batch being written, one waiting in the DataLoader, one in the feed
HEADROOM = 1.25  # buffer size over a batch of average samples: batches of larger ones still fit


class Slots:
    """``per_worker`` shared buffers of ``capacity`` bytes for each of ``workers`` DataLoader workers."""

    def __init__(self, workers: int, capacity: int, per_worker: int = PER_WORKER):
        self.capacity, self.per_worker = capacity, per_worker
        count = workers * per_worker
        self.buffers = [torch.empty(capacity, dtype=torch.uint8).share_memory_() for _ in range(count)]
        # 1 from a worker's write until the training process lets go of the bytes
        self.held = torch.zeros(count, dtype=torch.uint8).share_memory_()
        self.reading: set[int] = set()  # (training process) buffers some tensor still refers to
        self.turn = 0  # (each worker) which of its buffers to try first
        self.registered: list[int] = []  # (training process) the buffers now page-locked
        self.unpinnable = False

    @classmethod
    def for_batches(cls, workers: int, batch: int, sample_bytes: float) -> Slots:
        """Buffers for batches of ``batch`` samples of ``sample_bytes`` on average."""
        return cls(workers, int(batch * sample_bytes * HEADROOM) + (1 << 20))

    def pin(self) -> None:
        """Page-lock the buffers for the GPU's copies, in the training process once its workers
        have started: CUDA keeps page-locked memory out of children forked later (MADV_DONTFORK),
        so workers started again need ``renewed`` buffers. Where CUDA will not, the feed copies
        each batch into pinned memory as before."""
        if self.registered or self.unpinnable:
            return
        cudart = torch.cuda.cudart()
        weakref.finalize(self, _unpin, self.registered, self.buffers, os.getpid())
        for buffer in self.buffers:
            if cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0) != 0:
                _unpin(self.registered, self.buffers, os.getpid())
                self.unpinnable = True
                message = "the workers' shared buffers could not be page-locked: batches are copied to pinned memory"
                warnings.warn(message, stacklevel=2)
                return
            self.registered.append(buffer.data_ptr())

    def renewed(self) -> Slots:
        """New buffers of the same number and size (these stay until nothing refers to them)."""
        return Slots(len(self.buffers) // self.per_worker, self.capacity, self.per_worker)

    def write(self, raws: Sequence[bytes | np.ndarray]) -> int | None:
        """(In a worker) ``raws`` one after another into a free buffer of this worker's: its number,
        or None where none is free or large enough."""
        info = get_worker_info()
        chunks = [as_bytes(raw) for raw in raws]
        if info is None or sum(map(len, chunks)) > self.capacity:
            return None
        held, first = self.held.numpy(), info.id * self.per_worker
        for tried in range(self.per_worker):  # from the one after the last written
            index = first + (self.turn + tried) % self.per_worker
            if not held[index]:
                break
        else:
            return None
        self.turn = (index - first + 1) % self.per_worker
        view, start = memoryview(self.buffers[index].numpy()), 0
        for chunk in chunks:
            view[start : start + len(chunk)] = chunk
            start += len(chunk)
        held[index] = 1
        return index

    def read(self, index: int) -> torch.Tensor:
        """(In the training process) buffer ``index``, in place: it is free again once this
        tensor and every view of it are gone."""
        array = self.buffers[index].numpy()[:]  # (a view of its own, for the finalizer)
        self.reading.add(index)
        weakref.finalize(array, self._free, index)  # (the tensors' storage holds the array)
        return torch.from_numpy(array)

    def reclaim(self) -> None:
        """(In the training process, its workers ended) free the buffers written by workers that
        are gone but never read: the batches they held were never received."""
        held = self.held.numpy()
        for index in range(len(self.buffers)):
            if index not in self.reading:
                held[index] = 0

    def _free(self, index: int) -> None:
        self.reading.discard(index)
        self.held.numpy()[index] = 0


def _unpin(registered: list[int], buffers: list[torch.Tensor], owner: int) -> None:
    """Unregister the ``registered`` buffers (``buffers`` are held here until then)."""
    if os.getpid() == owner and registered:  # (a forked worker inherits the finalizer, not the registration)
        cudart = torch.cuda.cudart()
        while registered:
            cudart.cudaHostUnregister(registered.pop())
