"""The shard tools' progress (synth, convert, verify, preload): tqdm's bar on a terminal; in a
log (a job's output, a file), where its frames would pile up as carriage returns, a plain line at
each tenth of the way and one at the end, as train.py does."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

from tqdm import tqdm


class Lines:
    """tqdm's ``update``/``close`` for a log: a line at each tenth of ``total``, one at the end."""

    def __init__(self, total: int, desc: str, unit: str, unit_scale: bool = False) -> None:
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n, self.tenths, self.start = 0, 0, time.monotonic()
        self.lock = threading.Lock()  # (preload's downloads update it from their threads)

    def _done(self) -> str:
        """E.g. "3 shards of 12", "1 shard of 12", "1.20MB of 4.80MB"."""
        if self.unit_scale:
            return f"{tqdm.format_sizeof(self.n, self.unit)} of {tqdm.format_sizeof(self.total, self.unit)}"
        return f"{self.n:,} {self.unit.removesuffix('s') if self.n == 1 else self.unit} of {self.total:,}"

    def update(self, n: int = 1) -> None:
        with self.lock:
            self.n += n
            tenths = min(10, self.n * 10 // self.total) if self.total else 0
            if tenths <= self.tenths or self.n >= self.total:
                return
            self.tenths = tenths
        print(f"{self.desc}: {self._done()} ({tenths * 10}%)", file=sys.stderr)

    def close(self) -> None:
        if self.total:
            took = time.monotonic() - self.start
            print(f"{self.desc}: {self._done()} in {took:.0f}s", file=sys.stderr)

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def bar(total: int, desc: str, unit: str, unit_scale: bool = False) -> tqdm | Lines:
    """A progress bar for ``total`` units, used as a context manager with ``update(n)``."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=total == 0)
    return Lines(total, desc, unit, unit_scale)
