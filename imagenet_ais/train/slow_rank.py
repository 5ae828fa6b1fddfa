"""Which rank held the others back in an epoch, and why.

With DDP every step waits for the slowest rank, so one rank starved of data or with a slow GPU
slows them all. Each rank adds up its own figures over the epoch (from the metrics windows it
records anyway: time waiting for data, step and forward times, its feed threads' busy time) and
its reads. At the epoch's end one gather (with what the reads cost, data_cost.py) brings every
rank's to each, and rank 0 names the rank that held the others back: the one that waited for
data most, or, where none waited, the one whose forward passes took longest (its own work, with
no wait for the others in it), each against the other ranks.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass, field
from typing import Any

from imagenet_ais.loader import ShardLoader
from imagenet_ais.loader.synthetic import SyntheticLoader
from imagenet_ais.train.data_cost import Cost, minus, totals

WAITED = 0.05  # a rank waiting for data this share of its time or more holds the others back
SLOWER = 0.10  # as one whose forward passes took this much longer than the median rank's
BUSY = 0.90  # a feed thread this busy is the limit of that rank's feed


@dataclass
class EpochFigures:
    """One rank's figures over an epoch: ``add`` each metrics window's, then ``mine`` at its end."""

    loader: ShardLoader | SyntheticLoader
    seconds: float = 0.0
    waited: float = 0.0
    steps: int = 0
    step_ms: float = 0.0  # the windows' median step times, weighted by their steps
    forward_ms: float = 0.0  # likewise their forward passes
    busy: dict[str, float] = field(default_factory=dict)  # seconds each feed thread worked
    _reads_at_start: Cost = field(default_factory=dict)

    def start(self) -> None:
        self.seconds = self.waited = self.step_ms = self.forward_ms = 0.0
        self.steps, self.busy = 0, {}
        self._reads_at_start = self.loader.reads()

    def add(self, seconds: float, steps: int, mine: dict[str, float]) -> None:
        """A metrics window of ``seconds`` and ``steps``; ``mine``: this rank's figures in its record."""
        self.seconds += seconds
        self.steps += steps
        self.waited += mine["data_wait"] * seconds
        self.step_ms += mine["step_ms_p50"] * steps
        self.forward_ms += mine["forward_ms_p50"] * steps
        for name, share in mine.items():
            if thread := name.removeprefix("busy_") if name.startswith("busy_") else "":
                self.busy[thread] = self.busy.get(thread, 0.0) + share * seconds

    def mine(self) -> dict[str, Any]:
        """This rank's figures over the epoch so far, for every rank's to be gathered."""
        seconds = max(self.seconds, 1e-9)
        reads = minus(self.loader.reads(), self._reads_at_start)
        read = totals(reads)
        return {
            "host": socket.gethostname(),
            "seconds": round(self.seconds, 3),
            "data_wait": round(self.waited / seconds, 4),
            "step_ms": round(self.step_ms / max(self.steps, 1), 3),
            "forward_ms": round(self.forward_ms / max(self.steps, 1), 3),
            "busy": {name: round(s / seconds, 3) for name, s in self.busy.items()},
            "read_mb_s": round(read["read_bytes"] / seconds / 1e6, 3),
            # how fast the store gave its bytes while a worker read (the store's pace, per stream)
            "pace_mb_s": {
                loc: round(c["read_bytes"] / c["store_us"], 3)
                for loc, c in reads.items()
                if c["store_us"] and c["read_bytes"]
            },
            "cache_mb_s": round(read["cache_bytes"] / seconds / 1e6, 3),
        }


def slowest(epoch: int, ranks: list[dict[str, Any]]) -> str:
    """The line that names the rank that held the others back in ``epoch`` (counted from 1), and why."""
    waits = [r["data_wait"] for r in ranks]
    worst = max(range(len(ranks)), key=lambda i: (waits[i], -i))
    others = statistics.median(w for i, w in enumerate(waits) if i != worst)
    if waits[worst] >= WAITED and waits[worst] >= 2 * others:  # (the others may wait some: for it, or at the start)
        return f"epoch {epoch}: {_named(worst, ranks)} held the others back: {_starved(worst, ranks, others)}"
    if min(waits) >= WAITED:
        return (
            f"epoch {epoch}: no one rank held the others back: every rank waited for data (the median rank "
            f"{statistics.median(waits):.0%} of its time, rank {worst} the most, {waits[worst]:.0%}); the feed is "
            f"the limit{_busiest(ranks[worst])}"
        )
    forwards = [r["forward_ms"] for r in ranks]
    longest, median = max(range(len(ranks)), key=lambda i: (forwards[i], -i)), statistics.median(forwards)
    if median and forwards[longest] > (1 + SLOWER) * median:
        return (
            f"epoch {epoch}: {_named(longest, ranks)} held the others back: its forward passes took "
            f"{forwards[longest] / median - 1:.0%} longer than the median rank's ({forwards[longest]:.1f} ms against "
            f"{median:.1f}): a slower or throttled GPU, or a busier host"
        )
    return (
        f"epoch {epoch}: no rank held the others back: the most any waited for data was {waits[worst]:.0%} "
        f"(rank {worst}), and every rank's forward passes were within {SLOWER:.0%} of the median"
    )


def _named(rank: int, ranks: list[dict[str, Any]]) -> str:
    return f"rank {rank} (node {ranks[rank]['host']})"


def _starved(rank: int, ranks: list[dict[str, Any]], others: float) -> str:
    """Why ``rank`` waited for data (``others``: the median of the other ranks' waits): how fast
    it read, against the others."""
    r = ranks[rank]
    said = f"it waited {r['data_wait']:.0%} of its time for data (the others' median {others:.0%})"
    if r["pace_mb_s"]:  # its slowest store's pace, against the median rank's pace from any store
        location = min(r["pace_mb_s"], key=r["pace_mb_s"].get)
        median = statistics.median(min(x["pace_mb_s"].values()) for x in ranks if x["pace_mb_s"])
        said += (
            f"; its reads from {location} came at {r['pace_mb_s'][location]:,.2f} MB/s a stream against a "
            f"median of {median:,.2f}"
        )
    if r["cache_mb_s"]:
        said += f", {r['cache_mb_s']:,.1f} MB/s from the node's cache"
    return said + _busiest(r)


def _busiest(figures: dict[str, Any]) -> str:
    """Its feed's limit, where one of its threads was busy nearly all the time."""
    if not figures["busy"]:
        return ""
    thread, share = max(figures["busy"].items(), key=lambda item: item[1])
    return f"; its feed's {thread} thread was busy {share:.0%} of the time" if share >= BUSY else ""
