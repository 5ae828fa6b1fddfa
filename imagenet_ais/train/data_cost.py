"""What the run's data cost: bytes and requests read from each store, bytes the node's shard
cache served, bytes read again after a failure; per epoch and for the whole run, summed over
ranks, the train and val loaders together.

Each loader counts its own reads (loader/signals.py's READS). Every rank's are gathered at each
epoch's end (with its epoch figures, slow_rank.py: one small gather; ranks may read from places
of their own) and at each checkpoint, which carries the run's totals and where its epoch began
over a resume.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from imagenet_ais import distributed
from imagenet_ais.loader import ShardLoader
from imagenet_ais.loader.signals import READS
from imagenet_ais.loader.synthetic import SyntheticLoader

Cost = dict[str, dict[str, int]]  # location → READS


def plus(*costs: Cost) -> Cost:
    """The costs summed, location by location."""
    locations = sorted({loc for cost in costs for loc in cost})
    return {loc: {name: sum(c.get(loc, {}).get(name, 0) for c in costs) for name in READS} for loc in locations}


def minus(a: Cost, b: Cost) -> Cost:
    """What ``a`` holds more than ``b``, location by location."""
    return {loc: {name: n - b.get(loc, {}).get(name, 0) for name, n in counts.items()} for loc, counts in a.items()}


def totals(cost: Cost) -> dict[str, int]:
    """``cost`` summed over its locations."""
    return {name: sum(c[name] for c in cost.values()) for name in READS}


@dataclass
class DataCost:
    """The run's reads: ``carried`` (the run's totals in the checkpoint it resumed from) and this
    attempt's; ``epoch_start``: the run's totals when the epoch under way began. ``latest``: the
    run's totals as the last gather found them, at step ``step`` (for a run ending where no
    collective may run)."""

    loaders: Sequence[ShardLoader | SyntheticLoader]
    carried: Cost = field(default_factory=dict)
    epoch_start: Cost = field(default_factory=dict)
    latest: Cost = field(default_factory=dict)
    step: int = 0

    def __post_init__(self) -> None:
        self.latest = self.carried

    def mine(self) -> Cost:
        """This rank's reads in this attempt, its loaders' together."""
        return plus(*(loader.reads() for loader in self.loaders))

    def summed(self, gathered: Iterable[Cost], step: int) -> Cost:
        """The run's totals at ``step``, from every rank's ``mine`` (``latest`` set to them)."""
        self.latest, self.step = plus(self.carried, *gathered), step
        return self.latest

    def end_epoch(self, gathered: Iterable[Cost], step: int) -> Cost:
        """What the epoch just ended at ``step`` cost (its training and its validation), from every
        rank's ``mine``."""
        run = self.summed(gathered, step)
        epoch, self.epoch_start = minus(run, self.epoch_start), run
        return epoch

    def run_totals(self, step: int) -> Cost:
        """The run's reads so far, at ``step`` (a collective: every rank calls it)."""
        return self.summed(distributed.gather_objects(self.mine()), step)

    def record(self, status: str, epoch: int, step: int) -> dict[str, Any]:
        """The ``run`` record that closes metrics.jsonl: the run ``status`` at ``epoch`` (from 1) and
        ``step``, and its reads (``counted_to``: the step they were last gathered at, where that is
        not ``step``)."""
        counted = {"counted_to": self.step} if self.step != step else {}
        where = {"kind": "run", "epoch": epoch, "step": step, "status": status}
        return {**where, **totals(self.latest), "data": self.latest, **counted}

    def closing(self, world_size: int, step: int) -> str:
        """The run's reads for its closing line, where no collective may run: a rank alone counts
        its own to the end; several, as their last gather found them."""
        if world_size == 1:
            self.summed([self.mine()], step)
        if not self.latest:
            return ""
        if self.step == step:
            return described(self.latest)
        return f"{described(self.latest)} by step {self.step} (the ranks' reads after it were not gathered)"

    def state(self) -> dict[str, Cost]:
        """What a checkpoint carries (``carried`` and ``epoch_start`` of the run that resumes from it)."""
        return {"run": self.latest, "epoch_start": self.epoch_start}


def described(cost: Cost) -> str:
    """``cost`` in a few words per location: "ais://b/x 1.28 GB in 2,502 requests, 0.40 GB from the
    node's cache, 12.0 MB read again after a failure"."""
    parts = []
    for location, c in cost.items():
        said = f"{location} {_size(c['read_bytes'])}"
        requests = c["read_requests"]
        said += f" in {requests:,} request{'s' * (requests != 1)}" if requests else ""  # (a directory: none)
        if c["cache_bytes"]:
            said += f", {_size(c['cache_bytes'])} from the node's cache"
        if c["reread_bytes"]:
            said += f", {_size(c['reread_bytes'])} read again after a failure"
        parts.append(said)
    return "; ".join(parts) or "nothing read"


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
