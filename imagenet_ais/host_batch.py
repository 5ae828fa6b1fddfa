"""A batch as it reaches the training process from a DataLoader worker, and what the feed does
with it on the host: receive it, pool short ones, take rows, pin it for the GPU's copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from imagenet_ais.handover import Slots
from imagenet_ais.transforms import Encoded, concat_encoded, pin_encoded, pinned_copy, split_block, take_encoded


class HostBatch(NamedTuple):
    images: torch.Tensor | Encoded  # uint8 N × H × W × 3 (decode "cpu"), or JPEG bytes and crops
    labels: torch.Tensor  # int64, N
    keys: list[str]
    ids: torch.Tensor  # int64 N × 2: (shard, sample index) of each sample


def received(slots: Slots | None, batch: tuple) -> HostBatch:
    """A batch as stream.collate_in_worker sent it; bytes in a worker's buffer are read in place."""
    pixels, labels, keys, ids = batch
    if len(pixels) == 1:
        images: torch.Tensor | Encoded = torch.from_numpy(pixels[0])
    else:
        block, sizes, boxes, plans, side = pixels
        if isinstance(block, int):  # written into the worker's buffer ``block``, read there
            block = slots.read(block)  # type: ignore[union-attr]
        images = split_block(block, sizes, torch.from_numpy(boxes), torch.from_numpy(plans), side)
    return HostBatch(images, torch.from_numpy(labels), keys, torch.from_numpy(ids))


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
        # (handover.py's are pinned; rows taken out of them may not be)
        ready = images.blob.is_pinned() and (not len(images.pixels) or images.pixels.is_pinned())
        images = images if ready else pin_encoded(images)
    else:
        images = pinned_copy(images)
    return batch._replace(images=images, labels=batch.labels.pin_memory())
