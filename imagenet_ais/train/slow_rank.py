"""Which rank held the others back in an epoch, and why.

With DDP every step waits for the slowest rank, so one rank starved of data or with a slow GPU
slows them all. Each rank adds up its own figures over the epoch (from the metrics windows it
records anyway: time waiting for data, step and forward times, its feed threads' busy time) and
its reads. At the epoch's end one gather (with what the reads cost, data_cost.py) brings every
rank's to each, and rank 0 names the ranks that held the others back: those that waited for data
while the others did not, or, where none waited, those whose forward passes took longest (their
own work, with no wait for the others in it), each against the median of the others. All of a slow
node's ranks are named together, not the first of them alone.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from imagenet_ais.loader import ShardLoader
from imagenet_ais.loader.synthetic import SyntheticLoader
from imagenet_ais.train.data_cost import Cost, minus, totals

WAITED = 0.05  # a rank waiting for data this share of its time or more holds the others back
SLOWER = 0.10  # as one whose forward passes took this much longer than the others' median
BUSY = 0.90  # a feed thread this busy is the limit of that rank's feed
NODES = 4  # the most nodes a line names


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


def slowest(epoch: int, ranks: list[dict[str, Any]]) -> str | None:
    """The line that names the ranks that held the others back in ``epoch`` (counted from 1), and
    why; None where this attempt trained none of its steps (a resume at its end)."""
    if not any(r["seconds"] for r in ranks):
        return None
    waits = [r["data_wait"] for r in ranks]
    # (the others, fed, may wait some: for them, or at the start; a slow node's ranks may be most of the job)
    starved, fed = apart(waits, lambda wait, others: others < WAITED <= wait and wait >= 2 * others, len(ranks) - 1)
    if starved:
        others = statistics.median(waits[i] for i in fed)
        return f"epoch {epoch}: {_held(starved, ranks)}: {_starved(starved[0], fed, ranks, others)}"
    worst = max(range(len(ranks)), key=lambda i: (waits[i], -i))
    if min(waits) >= WAITED:
        return (
            f"epoch {epoch}: no one rank held the others back: every rank waited for data (the median rank "
            f"{statistics.median(waits):.0%} of its time, rank {worst} the most, {waits[worst]:.0%}); the feed is "
            f"the limit{_busiest(ranks[worst])}"
        )
    forwards = [r["forward_ms"] for r in ranks]
    # (at most half the ranks: where most are alike and a few are faster, the many are not the slow ones)
    slow, rest = apart(
        forwards, lambda forward, others: others > 0 and forward > (1 + SLOWER) * others, len(ranks) // 2
    )
    if slow:
        longest, others = slow[0], statistics.median(forwards[i] for i in rest)
        return (
            f"epoch {epoch}: {_held(slow, ranks)}: its forward passes took {forwards[longest] / others - 1:.0%} "
            f"longer than the other ranks' median ({forwards[longest]:.1f} ms against {others:.1f}): a slower or "
            "throttled GPU, or a busier host"
        )
    return (
        f"epoch {epoch}: no rank held the others back: the most any waited for data was {waits[worst]:.0%} "
        f"(rank {worst}), and every rank's forward passes were within {SLOWER:.0%} of the others' median"
    )


def apart(values: list[float], behind: Callable[[float, float], bool], most: int) -> tuple[list[int], list[int]]:
    """The ranks that held the others back on ``values`` (higher: worse), worst first, and the
    others: the most ranks, up to ``most``, of which each is ``behind`` the others' median value."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    for held in range(min(most, len(values) - 1), 0, -1):  # (the most: a slow node's ranks are named together)
        others = statistics.median(values[i] for i in order[held:])
        if all(behind(values[i], others) for i in order[:held]):
            return order[:held], order[held:]
    return [], order


def _held(held: list[int], ranks: list[dict[str, Any]]) -> str:
    """Who held the others back: one rank and its node ("rank 5 (node b07)"), or several, their
    nodes, and the one the line goes on to speak of."""
    if len(held) == 1:
        return f"{_named(held[0], ranks)} held the others back"
    nodes = list(dict.fromkeys(ranks[i]["host"] for i in sorted(held)))
    on = f"{len(nodes)} nodes" if len(nodes) > NODES else f"node{'s' * (len(nodes) > 1)} {', '.join(nodes)}"
    return f"{len(held)} ranks ({_spans(held)}, on {on}) held the others back, {_named(held[0], ranks)} the most"


def _spans(ranks: list[int]) -> str:
    """The ranks, each run of them as a span: "2-5, 9"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][-1] + 1:
            spans[-1][1:] = [rank]
        else:
            spans.append([rank])
    return ", ".join("-".join(map(str, span)) for span in spans)


def _named(rank: int, ranks: list[dict[str, Any]]) -> str:
    return f"rank {rank} (node {ranks[rank]['host']})"


def _starved(rank: int, fed: list[int], ranks: list[dict[str, Any]], others: float) -> str:
    """Why ``rank`` waited for data (``others``: the median of the ``fed`` ranks' waits): how fast it
    read, against the fed ranks that read the same store."""
    r = ranks[rank]
    said = f"it waited {r['data_wait']:.0%} of its time for data (the others' median {others:.0%})"
    paces = r["pace_mb_s"]
    medians = {
        location: statistics.median(theirs)
        for location in paces
        if (theirs := [ranks[i]["pace_mb_s"][location] for i in fed if ranks[i]["pace_mb_s"].get(location)])
    }
    if medians:  # the store it read slowest from, against the fed ranks' pace from it
        location = min(medians, key=lambda at: paces[at] / medians[at])
        said += (
            f"; its reads from {location} came at {paces[location]:,.2f} MB/s a stream against the others' "
            f"median of {medians[location]:,.2f}"
        )
    elif paces:
        location = min(paces, key=paces.get)
        said += f"; its reads from {location} came at {paces[location]:,.2f} MB/s a stream"
    if r["cache_mb_s"]:
        said += f", {r['cache_mb_s']:,.1f} MB/s from the node's cache"
    return said + _busiest(r)


def _busiest(figures: dict[str, Any]) -> str:
    """Its feed's limit, where one of its threads was busy nearly all the time."""
    if not figures["busy"]:
        return ""
    thread, share = max(figures["busy"].items(), key=lambda item: item[1])
    return f"; its feed's {thread} thread was busy {share:.0%} of the time" if share >= BUSY else ""
