"""How well the loader's default order mixes a split's classes, from its class counts per shard.

A loader worker reads whole shards (or runs of them) one after another and draws its batches
from a shuffle buffer of a few hundred samples. Where each shard holds one class (the
webdataset project's ImageNet shards are written in class order), a batch sees one or two
classes whatever the buffer does. The figure is the mean number of distinct classes in a batch
of ``BATCH`` drawn from what a worker's buffer holds (``WINDOW`` samples of its shards in a
shuffled shard order, each shard's classes taken as mixed within it), as a share of the same
for a batch drawn from the whole split: 1 is a uniform shuffle's, 0.01 a batch of one class
among a hundred.
"""

from __future__ import annotations

import math
import random

BATCH = 256
WINDOW = 2 * BATCH  # a worker's buffer (at least a batch: engine.TrainLoader) and the batch it makes
WINDOWS = 400  # windows averaged: enough for two digits
LOW = 0.5  # below this a run says so, with the fix (reshard)


def shuffle_quality(class_counts: list[dict[int, int]], seed: int = 0) -> float | None:
    """The figure for a split whose shards hold ``class_counts`` ({class: samples} each, in
    manifest order); None where the split holds fewer than two batches."""
    counts = [c for c in class_counts if sum(c.values())]
    total: dict[int, float] = {}
    for shard in counts:
        for cls, n in shard.items():
            total[cls] = total.get(cls, 0) + n
    samples = sum(total.values())
    if samples < 2 * BATCH:
        return None
    uniform = _distinct(total, samples)
    rng = random.Random(f"quality:{seed}")
    figures = [_distinct(*_window(counts, rng)) for _ in range(WINDOWS)]
    return min(1.0, sum(figures) / len(figures) / uniform)


def _window(counts: list[dict[int, int]], rng: random.Random) -> tuple[dict[int, float], float]:
    """The classes of ``WINDOW`` samples from a random point of a random shard order (the
    shards' classes pro-rated where the window takes part of one)."""
    order = rng.sample(range(len(counts)), len(counts))
    first = counts[order[0]]
    skip = rng.random() * sum(first.values())  # where in the first shard the window starts
    need, held = float(WINDOW), dict[int, float]()
    for i in order:
        size = sum(counts[i].values()) - skip
        take = min(size, need)
        for cls, n in counts[i].items():
            held[cls] = held.get(cls, 0) + n * take / (size + skip)
        need, skip = need - take, 0.0
        if need <= 0:
            break
    return held, WINDOW - need


def _distinct(classes: dict[int, float], size: float) -> float:
    """Expected distinct classes in ``BATCH`` samples drawn without replacement from ``size``
    samples holding ``classes`` (hypergeometric; counts may be fractional)."""
    k = min(BATCH, size)
    log_all = math.lgamma(size + 1) - math.lgamma(size - k + 1)
    distinct = 0.0
    for n in classes.values():
        rest = size - n
        absent = 0.0 if rest < k else math.exp(math.lgamma(rest + 1) - math.lgamma(rest - k + 1) - log_all)
        distinct += 1 - absent
    return distinct


def split_quality(class_counts: list[dict[str, int]]) -> float | None:
    """The figure of a manifest's split (its ``class_counts``, class indices as text)."""
    return shuffle_quality([{int(c): n for c, n in shard.items()} for shard in class_counts])


def quality_line(location: str, class_counts: list[dict[str, int]], low_only: bool = False) -> str | None:
    """What to say of a training split's figure: None where it has no class counts (a manifest
    of an older convert) or too few samples, or (``low_only``) where it is not low; the fix
    where it is low."""
    figure = split_quality(class_counts) if class_counts else None
    if figure is None or (low_only and figure >= LOW):
        return None
    line = f"shuffle quality {figure:.2f} (distinct classes in a batch of {BATCH}, as a share of a uniform shuffle's)"
    if figure < LOW:
        line += (
            f": {location}'s shards hold few classes each (sorted by class?), so each batch sees a few of them and "
            f"training suffers; write a shuffled copy (imagenet_shards.py reshard {location} DEST) and train on DEST"
        )
    return line


def low_quality_line(location: str, class_counts: list[dict[str, int]]) -> str | None:
    """``quality_line``, only where the figure is low (what a run or loader warns of)."""
    return quality_line(location, class_counts, low_only=True)
