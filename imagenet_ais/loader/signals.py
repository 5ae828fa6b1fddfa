"""What the training process and its DataLoader workers tell each other while epochs run, in
shared memory: workers started once (persistent) still see what the training process sets, and
it sees what they count. One object, made with the loader's stream and handed to every worker."""

from __future__ import annotations

import multiprocessing as mp
import time
from ctypes import c_double, c_longlong
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized, SynchronizedArray

COUNTERS = ("skipped", "read_errors", "unread", "drawn", "cropped")
# what reading the shards cost, per source (a mixture has several): bytes from its store (a copy
# fetched into the node's cache included), the requests its store's client sent for them
# (storage's Store.requests), bytes served from copies the cache already held,
# bytes read again after a failure (a resumed epoch's samples trained before it, bad copies
# fetched again), and the microseconds the workers' reads from the store took (summed over workers)
READS = ("read_bytes", "read_requests", "cache_bytes", "reread_bytes", "store_us")
READERS = 256  # workers whose shard in reading is kept (a worker beyond takes the slot of worker % READERS)


def _count() -> Synchronized[int]:
    return mp.Value("q", 0)


@dataclass(eq=False)  # (one object, shared: compared by identity)
class Signals:
    """The training process sets ``epoch``, ``size`` and ``step_wait``; the workers count and report."""

    image_size: int
    sources: int = 1  # the split's sources, whose reads are counted apart
    # training process → workers, without locks: one writer, and a worker killed while holding
    # a lock (engine.shut_down kills them at once) would stop the training process's next write
    epoch: c_longlong = field(default_factory=lambda: mp.Value("q", 0, lock=False))  # the epoch the workers read
    size: c_longlong = field(init=False)  # the output side; changes between epochs (--progressive)
    # the training step's recent share of time waiting for batches (device_feed.py), which the
    # workers' crops follow (cpu_share.py)
    step_wait: c_double = field(default_factory=lambda: mp.Value("d", 1.0, lock=False))
    # workers → training process
    skipped: Synchronized[int] = field(default_factory=_count)  # samples that failed to decode
    read_errors: Synchronized[int] = field(default_factory=_count)  # shards that failed part-way or held too few
    unread: Synchronized[int] = field(default_factory=_count)  # the samples those shards list that were not read
    drawn: Synchronized[int] = field(default_factory=_count)  # the samples of every shard piece set out to read
    cropped: Synchronized[int] = field(default_factory=_count)  # training samples the workers cropped (cpu_share.py)
    problems: mp.Queue = field(default_factory=mp.Queue)  # "where: what" lines, for the training process to name
    reads: SynchronizedArray[int] = field(init=False)  # READS of each source, one after another
    # the shard each worker reads (-1: none) and since when (time.time()): what a stuck rank was doing
    reading: SynchronizedArray[int] = field(default_factory=lambda: mp.Array("q", [-1] * READERS, lock=False))
    reading_since: SynchronizedArray[float] = field(default_factory=lambda: mp.Array("d", READERS, lock=False))

    def __post_init__(self) -> None:
        self.size = mp.Value("q", self.image_size, lock=False)
        self.reads = mp.Array("q", len(READS) * self.sources)
        # Only this process reads the lines: at its exit, one it has not sent is nobody's, and its
        # sending thread, stuck on a full pipe (lines nobody drained) or on the lock of a worker
        # killed mid-line, would hold the exit for ever. (Forked workers send theirs before exiting.)
        self.problems.cancel_join_thread()

    def renew_locks(self) -> None:
        """The workers' counters with fresh locks, their counts kept: for after the workers were
        killed. A lock is a semaphore, which its holder's death does not release: a worker killed
        holding one would leave the training process's next read, and the next workers' next
        count, waiting for ever. (A count the feed's decode thread adds meanwhile, where it outlived
        its close, goes to the old counter.)"""
        for name in COUNTERS:
            setattr(self, name, mp.Value("q", getattr(self, name).get_obj().value))
        self.reads = mp.Array("q", self.reads.get_obj()[:])

    @staticmethod
    def add(counter: Synchronized[int], n: int = 1) -> None:
        """Count ``n`` in one of the counters (from any worker)."""
        with counter.get_lock():
            counter.value += n

    def counts(self) -> dict[str, int]:
        """The counters' values, summed over this loader's workers."""
        return {name: getattr(self, name).value for name in COUNTERS}

    def add_read(self, source: int, **counts: int) -> None:
        """Count what a shard read cost (READS, by name) against ``source`` (from any worker)."""
        with self.reads.get_lock():
            for name, n in counts.items():
                self.reads[source * len(READS) + READS.index(name)] += n

    def read_start(self, worker: int, shard: int) -> None:
        """Worker ``worker`` starts reading ``shard`` (-1: it is done with it)."""
        self.reading_since[worker % READERS] = time.time()
        self.reading[worker % READERS] = shard

    def in_reading(self) -> list[tuple[int, float]]:
        """The shards the workers are reading, each with the seconds it has been read."""
        now = time.time()
        return [
            (shard, now - since)
            for shard, since in zip(self.reading[:], self.reading_since[:], strict=True)
            if shard >= 0
        ]

    def read_counts(self) -> list[dict[str, int]]:
        """Each source's READS so far, summed over this loader's workers."""
        values = self.reads[:]
        return [dict(zip(READS, values[i : i + len(READS)], strict=True)) for i in range(0, len(values), len(READS))]
