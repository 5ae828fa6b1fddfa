"""What crosses from a DataLoader worker to the training process: the batch format, and the
shared buffers the JPEG bytes cross in.

A worker packs its samples into a ``WorkerBatch`` (``pack``) and the training process unpacks
it into a ``HostBatch`` (``unpack``). With decode "cpu" the images are uint8 pixels; with "gpu"
or "dali" they are ``Jpegs``: each sample's JPEG bytes end to end, then the pixels of the
samples the worker cropped itself (cpu_share.py), with each sample's crop box and augmentation
plan. Once received, such a batch is an ``Encoded`` one, which the device decodes
(device_decode.py).

The bytes cross in one of the worker's ``Slots`` where one is free. The usual way, each batch's
bytes (56 MB for 512 ImageNet-sized JPEGs) go into a fresh shared-memory block: the worker copies
them in, then the training process faults the new mapping in page by page while it copies them
again into pinned memory, and unmaps and frees the block with the interpreter lock held (about
30 ms a batch on the GPU hosts, near ResNet-18's step: bench/RESULTS.md run AK). Instead the
training process makes a few buffers per worker once, in shared memory and, on CUDA, page-locked
(so the GPU copies from them directly). A worker writes a batch's bytes into one of its own
buffers that is free and sends only the buffer's number; the training process reads the bytes
in place; a buffer is free again once no tensor in the training process refers to it. Where none
of a worker's buffers is free, or a batch is larger than one, the batch goes the usual way:
nothing waits on a buffer, so nothing can deadlock on one.

Small arrays (labels, ids, crops) cross as numpy: a shared tensor holds a file descriptor for as
long as it lives, and the ids are kept for the whole epoch. Pixels of decode "cpu" cross as a
numpy array too, through the pipe into reused memory: as a tensor, i.e. a fresh shared-memory
block per batch, they capped the training process at ~550-950 img/s, against ~2,900 this way
(bench/RESULTS.md).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imagenet_ais.loader.failures import TransformFailed
from imagenet_ais.loader.transforms import Box

NO_PIXELS = torch.empty(0, 0, 0, 3, dtype=torch.uint8)


class Encoded(NamedTuple):
    """A batch still in JPEG form: bytes on the host, crops and augmentations to apply once decoded.

    Its first ``len(sizes)`` samples are JPEGs; the K after them (``pixels``) were cropped and
    resized in the worker already (cpu_share.py). ``boxes`` and ``plans`` have a row for each sample.
    """

    blob: torch.Tensor  # uint8: the batch's JPEGs end to end
    sizes: list[int]  # bytes of each JPEG in ``blob``
    boxes: torch.Tensor  # int64 N × 5: left, top, width, height, flip
    plans: torch.Tensor  # float32 N × Augment.width (N × 0 without augmentation)
    pixels: torch.Tensor = NO_PIXELS  # uint8 K × size × size × 3, neither flipped nor augmented yet


Raw = bytes | np.ndarray  # a worker's sample: JPEG bytes, or its crop decoded already (crop_on_cpu)


def encode_batch(samples: list[tuple[Raw, Box]], plans: list[list[float]] | None = None) -> Encoded:
    """A worker's batch, JPEGs first and those decoded already last (``ordered``): sizes, boxes,
    each sample's augmentation plan (augment.py), if any, and the bytes in one block."""
    raws = [raw for raw, _ in samples]
    jpegs = [isinstance(raw, bytes) for raw in raws]
    if jpegs != sorted(jpegs, reverse=True):
        raise ValueError("encode_batch: the samples decoded already must come after the JPEGs")
    return split_block(join_block(raws), *batch_crops(samples, plans), pixel_side(raws))


def join_block(raws: list[Raw]) -> torch.Tensor:
    """``raws`` end to end in one uint8 tensor (one shared-memory block to hand over)."""
    return torch.frombuffer(bytearray().join(map(as_bytes, raws)), dtype=torch.uint8)


def as_bytes(raw: Raw) -> memoryview:
    """``raw``'s bytes, without a copy."""
    return (memoryview(raw) if isinstance(raw, bytes) else raw.data).cast("B")


def pixel_side(raws: list[Raw]) -> int:
    """The side of the crops decoded already, last among ``raws`` (0: none)."""
    return 0 if isinstance(raws[-1], bytes) else len(raws[-1])


def ordered(samples: list[tuple]) -> list[tuple]:
    """A worker's samples (image first) with those decoded already last, as a batch has them."""
    return sorted(samples, key=lambda sample: not isinstance(sample[0][0], bytes))


def batch_crops(
    samples: list[tuple[Raw, Box]], plans: list[list[float]] | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """An encoded batch's all but its bytes: each JPEG's size, each sample's box and augmentation plan."""
    boxes = torch.tensor([tuple(box) for _, box in samples], dtype=torch.int64).view(-1, 5)
    width = len(plans[0]) if plans else 0
    drawn = torch.tensor(plans, dtype=torch.float32) if width else torch.zeros(len(samples), 0)
    return [len(raw) for raw, _ in samples if isinstance(raw, bytes)], boxes, drawn


def split_block(block: torch.Tensor, sizes: list[int], boxes: torch.Tensor, plans: torch.Tensor, side: int) -> Encoded:
    """The batch whose JPEGs (``sizes``) and then pixels (the other rows, ``side`` a side) begin ``block``."""
    jpeg = sum(sizes)
    count = len(boxes) - len(sizes)
    pixels = block[jpeg : jpeg + count * side * side * 3].view(count, side, side, 3) if count else NO_PIXELS
    return Encoded(block[:jpeg], sizes, boxes, plans, pixels)


def concat_encoded(batches: list[Encoded]) -> tuple[Encoded, list[int]]:
    """``batches`` as one, its JPEGs first; and which row of their concatenation each row is."""
    order: list[int] = []
    decoded: list[int] = []
    start = 0
    for b in batches:
        order += range(start, start + len(b.sizes))
        decoded += range(start + len(b.sizes), start + len(b.boxes))
        start += len(b.boxes)
    order += decoded
    pixels = [b.pixels for b in batches if len(b.pixels)]
    encoded = Encoded(
        torch.cat([b.blob for b in batches]),
        [n for b in batches for n in b.sizes],
        torch.cat([b.boxes for b in batches])[order],
        torch.cat([b.plans for b in batches])[order],
        torch.cat(pixels) if pixels else NO_PIXELS,
    )
    return encoded, order


def take_encoded(batch: Encoded, rows: list[int]) -> tuple[Encoded, list[int]]:
    """The samples ``rows`` of ``batch`` (repeats allowed) packed again, JPEGs first; and the
    rows in the order taken."""
    jpegs = batch.blob.split(batch.sizes)
    first = [r for r in rows if r < len(jpegs)]
    decoded = [r for r in rows if r >= len(jpegs)]
    picked = torch.cat([jpegs[r] for r in first]) if first else batch.blob[:0]
    pixels = batch.pixels[[r - len(jpegs) for r in decoded]] if decoded else NO_PIXELS
    order = first + decoded
    return Encoded(picked, [batch.sizes[r] for r in first], batch.boxes[order], batch.plans[order], pixels), order


def pin_encoded(batch: Encoded) -> Encoded:
    """``batch`` with its bytes (and pixels) copied into pinned memory.

    The copy reads the worker's shared memory here, in the thread that forms batches, so the
    first-touch page faults on it are not paid inside nvJPEG's call; a pinned buffer comes
    from torch's caching host allocator, i.e. is reused without faulting again.
    """
    return batch._replace(blob=pinned_copy(batch.blob), pixels=pinned_copy(batch.pixels))


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into pinned (page-locked) host memory, for asynchronous copies to the GPU."""
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)


class HostBatch(NamedTuple):
    images: torch.Tensor | Encoded  # uint8 N × H × W × 3 (decode "cpu"), or JPEG bytes and crops
    labels: torch.Tensor  # int64, N
    keys: list[str]
    ids: torch.Tensor  # int64 N × 2: (shard, sample index) of each sample


class Jpegs(NamedTuple):
    """A batch's JPEG bytes, then the pixels its worker cropped (``side`` a side), as they cross."""

    block: torch.Tensor | int  # the bytes in a block of their own, or the number of the worker's slot holding them
    sizes: list[int]  # bytes of each JPEG
    boxes: np.ndarray  # int64 N × 5: each sample's crop (left, top, width, height, flip)
    plans: np.ndarray  # float32 N × Augment.width: each sample's augmentation
    side: int  # of the pixels after the JPEGs (0: none)


class WorkerBatch(NamedTuple):
    """A batch as a worker hands it to the training process."""

    images: np.ndarray | Jpegs  # uint8 N × H × W × 3 (decode "cpu"), or JPEGs for the device
    labels: np.ndarray  # int64, N
    keys: list[str]
    ids: np.ndarray  # int64 N × 2: (shard, sample index) of each sample


def pack(samples: list[tuple], slots: Slots | None = None) -> WorkerBatch:
    """(In a worker: the DataLoader's collate) a batch of ``(image, label, key, shard, index)``
    samples; JPEG bytes go into one of this worker's ``slots`` where one is free."""
    if not isinstance(samples[0][0], torch.Tensor):
        samples = ordered(samples)  # JPEGs first, those cropped here (cpu_share.py) after them
    images, labels, keys, shards, indices = zip(*samples, strict=True)
    ids = np.stack([np.array(shards, dtype=np.int64), np.array(indices, dtype=np.int64)], axis=1)
    crossing: np.ndarray | Jpegs
    if isinstance(images[0], torch.Tensor):
        first = images[0]
        if odd := next((i for i, im in enumerate(images) if (im.shape, im.dtype) != (first.shape, first.dtype)), None):
            raise TransformFailed(
                f"samples {keys[0]!r} and {keys[odd]!r} of a batch are {first.dtype} {tuple(first.shape)} and "
                f"{images[odd].dtype} {tuple(images[odd].shape)}: a batch needs one kind and size (end the transform "
                "with a fixed-size crop, and give every sample the same type)"
            )
        crossing = np.stack([image.numpy() for image in images])
    else:
        encoded, plans = [(raw, box) for raw, box, _ in images], [p for *_, p in images]
        raws = [raw for raw, _ in encoded]
        sizes, boxes, drawn = batch_crops(encoded, plans)
        where = slots.write(raws) if slots else None
        block = join_block(raws) if where is None else where
        crossing = Jpegs(block, sizes, boxes.numpy(), drawn.numpy(), pixel_side(raws))
    return WorkerBatch(crossing, np.array(labels, dtype=np.int64), list(keys), ids)


def unpack(slots: Slots | None, batch: WorkerBatch) -> HostBatch:
    """(In the training process) a worker's batch; bytes in a worker's slot are read in place."""
    images: torch.Tensor | Encoded
    if isinstance(batch.images, Jpegs):
        block, sizes, boxes, plans, side = batch.images
        if isinstance(block, int):
            block = slots.read(block)  # type: ignore[union-attr]
        images = split_block(block, sizes, torch.from_numpy(boxes), torch.from_numpy(plans), side)
    else:
        images = torch.from_numpy(batch.images)
    return HostBatch(images, torch.from_numpy(batch.labels), batch.keys, torch.from_numpy(batch.ids))


def concat(batches: Sequence[HostBatch]) -> HostBatch:
    """``batches`` as one (an encoded one's JPEGs first, its samples in that order)."""
    labels, ids = torch.cat([b.labels for b in batches]), torch.cat([b.ids for b in batches])
    keys = [k for b in batches for k in b.keys]
    if not isinstance(batches[0].images, Encoded):
        return HostBatch(torch.cat([b.images for b in batches]), labels, keys, ids)  # type: ignore[misc]
    images, order = concat_encoded([b.images for b in batches])  # type: ignore[misc]
    return HostBatch(images, labels[order], [keys[r] for r in order], ids[order])


def take(batch: HostBatch, rows: list[int]) -> HostBatch:
    """The samples ``rows`` of ``batch`` (repeats allowed; an encoded one's JPEGs first)."""
    images = batch.images
    picked: torch.Tensor | Encoded
    if isinstance(images, Encoded):
        picked, rows = take_encoded(images, rows)
    else:
        picked = images[rows]
    return HostBatch(picked, batch.labels[rows], [batch.keys[r] for r in rows], batch.ids[rows])


def pinned(batch: HostBatch) -> HostBatch:
    """``batch`` in pinned memory, ready for an asynchronous copy to the GPU."""
    images = batch.images
    if isinstance(images, Encoded):
        # (the slots are pinned; rows taken out of them may not be)
        ready = images.blob.is_pinned() and (not len(images.pixels) or images.pixels.is_pinned())
        images = images if ready else pin_encoded(images)
    else:
        images = pinned_copy(images)
    return batch._replace(images=images, labels=batch.labels.pin_memory())


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
