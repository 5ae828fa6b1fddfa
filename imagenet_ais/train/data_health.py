"""What the loaders could not read as the manifest lists it: each bad shard (or sample) named
once on the console and in train.log, the counts summed over ranks, and a bound per epoch.

A missing shard, one cut short or holding fewer samples than listed, and samples that fail to
decode or carry a label outside the manifest's classes still leave every rank with its steps
(skipped, then padded with repeats): this is where the user hears of them.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing import queues as mp_queues

from imagenet_ais import distributed

COUNTERS = ("skipped", "read_errors", "unread", "drawn", "padded")


def drain(problems: queue.Queue | mp_queues.Queue, wait: float = 0.0) -> list[str]:
    """The lines waiting in a loader's problem queue; ``wait``: seconds to give a worker's last
    lines to arrive (a process's queue hands them over from a thread of its own)."""
    lines = []
    while True:
        try:
            lines.append(problems.get(timeout=wait) if wait else problems.get_nowait())
        except queue.Empty:
            return lines


@dataclass
class DataHealth:
    """Call ``poll`` at every metrics record and ``end_epoch`` after each epoch, on every rank
    (both may gather from all ranks); ``echo`` is rank 0's voice."""

    queues: Iterable[queue.Queue | mp_queues.Queue]  # the loaders' problem queues, filled by their workers
    echo: Callable[..., None]
    max_bad: float  # the fraction of an epoch's samples that may be skipped or padded
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    named: set[str] = field(default_factory=set)
    _epoch_start: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    val_missing: int = 0  # validation images the manifest lists that the last validation could not read
    val_listed: int = 0  # the images it lists

    def poll(self, totals: dict[str, int], always: bool = False) -> None:
        """``totals``: the counters summed over ranks (the same on every rank, so every rank
        decides alike whether to gather). Names what is new."""
        changed = any(totals[k] != self.totals[k] for k in COUNTERS if k != "drawn")  # drawn moves every window
        self.totals = dict(totals)
        if not (changed or always):
            return
        lines = [line for q in self.queues for line in drain(q)]
        for rank_lines in distributed.gather_objects(lines):
            for line in rank_lines:
                where = line.partition(": ")[0]
                if where not in self.named:
                    self.named.add(where)
                    self.echo(f"warning: {line}", err=True)

    def failing(self, local: dict[str, int], say: Callable[[str], None]) -> None:
        """Before a loader's failure ends the run: this rank's unread shards and samples not yet
        named, and its own ``local`` counters in the totals, with no collective (the other ranks
        may not be here). ``say`` speaks for this rank, whichever it is."""
        self.totals = {k: max(self.totals[k], local.get(k, 0)) for k in COUNTERS}
        for line in (line for q in self.queues for line in drain(q, wait=1.0)):
            if (where := line.partition(": ")[0]) not in self.named:
                self.named.add(where)
                say(f"warning: {line}")

    def end_epoch(self, epoch: int, samples: int) -> str | None:
        """After epoch ``epoch`` of ``samples`` samples: the line to stop with, if it was too damaged."""
        self.poll(self.totals, always=True)  # validation's lines, and any that came late
        delta = {k: self.totals[k] - self._epoch_start[k] for k in COUNTERS}
        self._epoch_start = dict(self.totals)
        # The share of the samples the workers set out to read that were lost, skipped or unread, over
        # the epoch's samples: in resampled mode the workers draw on past the epoch's samples (their
        # shuffle buffers fill) and nothing is padded; in exact mode each lost sample is padded too.
        lost = delta["skipped"] + delta["unread"]
        bad = max(round(samples * lost / delta["drawn"]) if delta["drawn"] else 0, delta["padded"])
        fix = "repair the shards (imagenet_shards.py verify) and continue with --resume auto, or allow more with "
        fix += "--max-bad"
        if bad > self.max_bad * samples:
            return (
                f"epoch {epoch + 1}: {bad} of its {samples} samples could not be read as the manifest lists them "
                f"({delta['skipped']} skipped, {delta['padded']} padded, {delta['read_errors']} failed shard reads "
                f"leaving {delta['unread']} of the {delta['drawn']} samples drawn unread; named above), over --max-bad "
                f"{self.max_bad:g}: {fix}"
            )
        if self.val_missing > self.max_bad * self.val_listed:
            return (
                f"epoch {epoch + 1}: validation could not read {self.val_missing} of the {self.val_listed} images "
                f"the manifest lists (named above), over --max-bad {self.max_bad:g}: {fix}"
            )
        return None

    def summary(self, reads: str = "") -> str:
        """The run's closing ``data:`` line; ``reads``: what its reads cost (data_cost.described)."""
        read = f"; the run read {reads}" if reads else ""
        t, parts = self.totals, []
        if any(t[k] for k in COUNTERS if k != "drawn"):  # (drawn counts every read, good or bad)
            parts.append(
                f"{t['skipped']} samples skipped, {t['padded']} padded with repeats, "
                f"{t['read_errors']} shard read errors ({t['unread']} samples unread) over the run"
            )
        if self.val_missing:
            parts.append(f"{self.val_missing} validation images missing from the last validation")
        if not parts:
            return f"data: every sample was read as the manifest lists it{read}"
        return f"data: {'; '.join(parts)} (named above and in metrics.jsonl){read}"
