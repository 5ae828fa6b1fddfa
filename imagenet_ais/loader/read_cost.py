"""What one shard read costs, counted as it goes into the loader's shared counters (signals.READS):
the training process sees a long read's bytes while it runs, not only once it ends."""

from __future__ import annotations

from dataclasses import dataclass

from imagenet_ais.loader.signals import Signals
from imagenet_ais.shards.cache import FETCHED, HIT, REFETCHED, STREAMED

STORE = "store"  # a shard read from its store, no cache on the way (else cache.py says where from)
FLUSH_BYTES = 4 * 2**20  # bytes read between two counts: a lock taken per few MB, not per sample


@dataclass
class ReadCost:
    """One read of a shard of ``size`` bytes from ``source``, which ``came_from`` the store or the
    node's cache (cache.py's HIT, FETCHED, REFETCHED, STREAMED), opened in ``opening`` seconds
    (a copy fetched into the cache: its download)."""

    signals: Signals
    source: int
    came_from: str
    size: int
    opening: float
    counted: int = 0  # bytes read so far, of them read again, and the seconds reads took, already counted
    counted_again: int = 0
    counted_waited: float = 0.0

    def __post_init__(self) -> None:
        store_us = round(1e6 * self.opening) if self.came_from != HIT else 0
        if self.came_from == STORE:  # a size check, then a GET
            self.signals.add_read(self.source, read_requests=2, store_us=store_us)
        elif self.came_from == STREAMED:  # the cache had no room: a GET
            self.signals.add_read(self.source, read_requests=1, store_us=store_us)
        elif self.came_from in (FETCHED, REFETCHED):  # the whole shard came into the cache with one GET
            refetched = self.size if self.came_from == REFETCHED else 0
            self.signals.add_read(
                self.source, read_bytes=self.size, read_requests=1, reread_bytes=refetched, store_us=store_us
            )

    def update(self, read: int, again: int, waited: float, last: bool = False) -> None:
        """``read`` bytes of the shard read so far in ``waited`` seconds of reads, ``again`` of them
        samples a resumed epoch had trained before; counted once FLUSH_BYTES more are read, and at the ``last``."""
        if not last and read - self.counted < FLUSH_BYTES:
            return
        new, new_again, new_waited = read - self.counted, again - self.counted_again, waited - self.counted_waited
        self.counted, self.counted_again, self.counted_waited = read, again, waited
        if self.came_from == HIT:
            self.signals.add_read(self.source, cache_bytes=new, reread_bytes=new_again)
        elif self.came_from in (STORE, STREAMED):
            self.signals.add_read(self.source, read_bytes=new, reread_bytes=new_again, store_us=round(1e6 * new_waited))
        else:  # read from the copy just fetched: its bytes were counted as they came
            self.signals.add_read(self.source, reread_bytes=new_again)
