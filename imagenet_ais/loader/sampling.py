"""Which samples each rank reads in an epoch, and where an interrupted epoch stands.

- exact: the epoch's shards are laid end to end in a (seed, epoch) permutation and the line
  is cut into ``world`` equal runs of steps × batch samples, steps = N // (world × batch).
  The last N mod (world × batch) samples of the line sit the epoch out. A resumed epoch lays
  out the same line without the samples trained before the restart, whatever the topology
  that trained them, and cuts the rest for the new one.
- resampled: each DataLoader worker draws whole shards with replacement, weighted by their
  sample counts, forever (see ``resampled_pieces``).
- validation: every sample once, in manifest order, in runs that differ by at most one.

A position is ``{"epoch": E, "delivered": {shard: [sample indices]}}``: the samples of epoch E
trained on so far, across all ranks. It names samples, not ranks or steps, so any world size,
batch or worker count can continue from it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from imagenet_ais.errors import DataError

Done = dict[int, set[int]]  # shard → indices of its samples already trained on this epoch


class Piece(NamedTuple):
    """Samples [start, stop) of one shard, in stored order (less any the reader is told to skip)."""

    shard: int
    start: int
    stop: int


def exact_assignment(
    counts: list[int],
    world: int,
    batch: int,
    seed: int,
    epoch: int,
    done: Done | None = None,
    runs: Callable[[int, int, int], list[range]] | None = None,
) -> tuple[list[list[Piece]], int]:
    """Per-rank pieces for one exact-mode epoch, and the number of steps every rank runs.

    With ``done``, the samples it names are left out of the line (the pieces may span them:
    the reader skips them), so each rank's pieces hold steps × batch samples still to train.
    ``runs(shard, seed, epoch)``: the samples of a shard the epoch takes, as runs in stored order
    (a mixture's share of a source, mixture.py); by default all of them. No piece spans two runs.
    """
    done = done or {}
    lines = [
        [_free_indices(run, done.get(shard)) for run in (runs(shard, seed, epoch) if runs else [range(count)])]
        for shard, count in enumerate(counts)
    ]
    steps = sum(len(indices) for line in lines for indices in line) // (world * batch)
    if steps == 0 and not done:
        raise DataError(
            f"the training split has {sum(counts)} samples, fewer than one global batch "
            f"({world} ranks × {batch}): lower --batch-size"
        )
    order = list(range(len(counts)))
    random.Random(f"exact:{seed}:{epoch}").shuffle(order)
    per_rank = steps * batch
    ranks: list[list[Piece]] = [[] for _ in range(world)]
    rank, room = 0, per_rank
    for shard in order:
        for indices in lines[shard]:
            at = 0
            while at < len(indices) and rank < world and room:
                take = min(room, len(indices) - at)
                ranks[rank].append(Piece(shard, indices[at], indices[at + take - 1] + 1))
                at += take
                room -= take
                if room == 0:
                    rank, room = rank + 1, per_rank
    return ranks, steps


def _free_indices(run: range, done: set[int] | None) -> range | list[int]:
    return [i for i in run if i not in done] if done else run


def contiguous_assignment(counts: list[int], world: int) -> list[list[Piece]]:
    """Split all samples, in manifest order, into ``world`` runs differing by at most one (validation)."""
    total = sum(counts)
    bounds = [total * r // world for r in range(world + 1)]
    ranks: list[list[Piece]] = [[] for _ in range(world)]
    offset = 0
    for shard, count in enumerate(counts):
        for rank in range(world):
            lo, hi = max(bounds[rank], offset), min(bounds[rank + 1], offset + count)
            if lo < hi:
                ranks[rank].append(Piece(shard, lo - offset, hi - offset))
        offset += count
    return ranks


def resampled_pieces(counts: list[int], stream: str, weights: list[float] | None = None) -> Iterator[Piece]:
    """Whole shards drawn with replacement, weighted by their sample counts (or by ``weights``:
    a mixture's, mixture.py), from the stream named ``stream`` (distinct names: independent draws)."""
    rng = random.Random(f"resampled:{stream}")
    cumulative = list(itertools.accumulate(weights if weights is not None else counts))
    while True:
        shard = rng.choices(range(len(counts)), cum_weights=cumulative)[0]
        yield Piece(shard, 0, counts[shard])


def split_among_workers(pieces: list[Piece], workers: int) -> list[list[Piece]]:
    """Whole pieces per worker, balancing sample counts (a worker may get none)."""
    loads = [0] * workers
    out: list[list[Piece]] = [[] for _ in range(workers)]
    for piece in sorted(pieces, key=lambda p: p.stop - p.start, reverse=True):
        w = loads.index(min(loads))
        out[w].append(piece)
        loads[w] += piece.stop - piece.start
    return out


def merge_positions(epoch: int, positions: Iterable[dict | None]) -> dict:
    """One position for ``epoch``: the union of the ranks' (those of another epoch are ignored)."""
    merged: Done = {}
    for position in positions:
        if position and position["epoch"] == epoch:
            for shard, indices in trained(position).items():
                merged.setdefault(shard, set()).update(indices)
    return {"epoch": epoch, "delivered": {shard: sorted(v) for shard, v in sorted(merged.items())}}


def trained(position: dict) -> Done:
    """A position's samples as sets, by shard."""
    return {int(shard): set(indices) for shard, indices in position["delivered"].items()}
