"""What the run's data cost: bytes and requests read from each store, bytes the node's shard
cache served, bytes read again after a failure; per epoch and for the whole run, summed over
ranks, the train and val loaders together.

Each loader counts its own reads (loader/signals.py's READS); here they are summed over ranks
once per epoch (one small gather: ranks may read from places of their own) and at each
checkpoint, which carries the run's totals over a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from imagenet_ais import distributed
from imagenet_ais.loader import ShardLoader
from imagenet_ais.loader.signals import READS
from imagenet_ais.loader.synthetic import SyntheticLoader

Cost = dict[str, dict[str, int]]  # location → READS


@dataclass
class DataCost:
    """Call ``end_epoch`` after each epoch and ``run_totals`` at each save, on every rank (both
    gather from all ranks); ``carried``: the run's totals in the checkpoint it resumed from. ``latest``:
    the run's totals as the last of those calls found them (for a run ending where no collective may run)."""

    loaders: Sequence[ShardLoader | SyntheticLoader]
    process: distributed.Process
    carried: Cost = field(default_factory=dict)
    latest: Cost = field(default_factory=dict)
    _at_epoch_start: Cost = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.latest = self.carried

    def _summed(self) -> Cost:
        """This attempt's reads so far, summed over the loaders and the ranks; ``latest`` set from them."""
        mine: Cost = {}
        for loader in self.loaders:
            for location, counts in loader.reads().items():
                mine[location] = _plus(mine.get(location, {}), counts)
        summed: Cost = {}  # (ranks may read from places of their own: a node's mirror)
        for theirs in distributed.gather_objects(mine):
            for location, counts in theirs.items():
                summed[location] = _plus(summed.get(location, {}), counts)
        everywhere = sorted({*self.carried, *summed})
        self.latest = {loc: _plus(self.carried.get(loc, {}), summed.get(loc, {})) for loc in everywhere}
        return summed

    def end_epoch(self) -> Cost:
        """What the epoch just ended cost (its training and its validation)."""
        now = self._summed()
        epoch = {loc: _minus(counts, self._at_epoch_start.get(loc, {})) for loc, counts in now.items()}
        self._at_epoch_start = now
        return epoch

    def run_totals(self) -> Cost:
        """The run's reads: every attempt's, this one's so far included."""
        self._summed()
        return self.latest


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a.get(name, 0) + b.get(name, 0) for name in READS}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a.get(name, 0) - b.get(name, 0) for name in READS}


def totals(cost: Cost) -> dict[str, int]:
    """``cost`` summed over its locations (for the trackers' charts)."""
    return {name: sum(c[name] for c in cost.values()) for name in READS}


def described(cost: Cost) -> str:
    """``cost`` in a few words per location: "ais://b/x 1.28 GB in 2,502 requests, 0.40 GB from the
    node's cache, 12.0 MB read again after a failure"."""
    parts = []
    for location, c in cost.items():
        said = f"{location} {_size(c['read_bytes'])}"
        said += f" in {c['read_requests']:,} requests" if c["read_requests"] else " read"  # (a directory: none)
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
