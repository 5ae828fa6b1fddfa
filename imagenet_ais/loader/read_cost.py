"""What one shard read costs, counted as it goes into the loader's shared counters (signals.READS):
the training process sees a long read's bytes while it runs, not only once it ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from imagenet_ais.loader.signals import Signals
from imagenet_ais.shards.cache import FETCHED, HIT, REFETCHED, STREAMED

STORE = "store"  # a shard read from its store, no cache on the way (else cache.py says where from)
FLUSH_BYTES = 4 * 2**20  # bytes read between two counts: a lock taken per few MB, not per sample


@dataclass
class ReadCost:
    """One read of a shard from ``source``; ``sent()``: the requests this worker's stores of that
    source have sent so far (storage's ``Store.requests``), so a read counts what it sent."""

    signals: Signals
    source: int
    sent: Callable[[], int]
    came_from: str = ""  # where the shard came from, once opened (STORE, or cache.py's HIT...)
    began: float = field(default_factory=time.perf_counter)
    counted: int = 0  # bytes read so far, of them read again, and the seconds reads took, already counted
    counted_again: int = 0
    counted_waited: float = 0.0
    counted_sent: int = field(init=False)
    fetched: int = 0  # bytes fetched into the node's cache so far, and of them already counted
    counted_fetched: int = 0

    def __post_init__(self) -> None:
        self.counted_sent = self.sent()

    def opened(self, came_from: str, size: int) -> None:
        """The shard of ``size`` bytes is open, from where it ``came_from``: a copy fetched into
        the cache came over whole (``fetching``; and again, where the copy there was bad)."""
        self.came_from, opening = came_from, round(1e6 * (time.perf_counter() - self.began))
        if came_from in (FETCHED, REFETCHED):
            self._count_fetched()
            refetched = size if came_from == REFETCHED else 0
            self.signals.add_read(self.source, reread_bytes=refetched, store_us=opening)
        elif came_from != HIT:  # (the size check, the GET's first bytes)
            self.signals.add_read(self.source, store_us=opening)
        self.update(0, 0, 0.0, last=True)  # its requests so far

    def fetching(self, n: int) -> None:
        """``n`` more bytes of the shard came into the node's cache: counted as they come, so that
        a fetch that fails half-way counts what it cost too."""
        self.fetched += n
        if self.fetched - self.counted_fetched >= FLUSH_BYTES:
            self._count_fetched()

    def _count_fetched(self) -> None:
        new, self.counted_fetched = self.fetched - self.counted_fetched, self.fetched
        if new:
            self.signals.add_read(self.source, read_bytes=new)

    def update(self, read: int, again: int, waited: float, last: bool = False) -> None:
        """``read`` bytes of the shard read so far in ``waited`` seconds of reads, ``again`` of them
        samples a resumed epoch had trained before; counted once FLUSH_BYTES more are read, and at the ``last``."""
        if not last and read - self.counted < FLUSH_BYTES:
            return
        if last:  # (a fetch that failed: what it fetched)
            self._count_fetched()
        new, new_again, new_waited = read - self.counted, again - self.counted_again, waited - self.counted_waited
        sent = self.sent()
        new_sent, self.counted_sent = sent - self.counted_sent, sent
        self.counted, self.counted_again, self.counted_waited = read, again, waited
        # (a bad copy fetched again counted whole as read again, its samples trained before among them)
        counts = {"reread_bytes": 0 if self.came_from == REFETCHED else new_again, "read_requests": new_sent}
        if self.came_from == HIT:
            counts["cache_bytes"] = new
        elif self.came_from in (STORE, STREAMED):
            counts |= {"read_bytes": new, "store_us": round(1e6 * new_waited)}
        # (else read from the copy just fetched, its bytes counted as it came; or never opened)
        self.signals.add_read(self.source, **counts)
