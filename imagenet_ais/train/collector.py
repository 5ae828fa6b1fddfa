"""The training process's garbage collector while a run lasts.

A full collection walks every object the process holds (torch, the model, torch.compile's graphs:
some 430,000 on a GPU host) with the interpreter lock held: 200-260 ms in which the feed's threads
and the step's launches all stop (bench/RESULTS.md run BE). At the run's first log window, past
its first steps' compiling, what the process holds is frozen out of the collector's reach
(``gc.freeze``), once: objects made later (another image size's graphs, validation's) are
collected as usual. Objects frozen then that later die in a reference cycle stay until the run's
end, which gives everything back (``gc.unfreeze``). Objects frozen before the run are frozen with
it and given back with it too: the frozen objects are one set, with no telling whose they are, and
Python 3.12 puts its 375 immortal objects there at every full collection, so a run that left a
frozen set alone never froze its own there. Where the caller turned the collector off, the run
leaves it off.
"""

from __future__ import annotations

import gc


class Collector:
    """Freezes what the process holds once (``settle``) until ``release``."""

    def __init__(self) -> None:
        self.idle = not gc.isenabled()  # (the caller's choice: no collections, so nothing to freeze out of them)
        self.frozen = False

    def settle(self) -> None:
        """Past the run's first steps: what the process holds now, frozen (the first call only)."""
        if self.idle or self.frozen:
            return
        gc.collect()  # (garbage frozen would stay until the run's end)
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        """The run is over: everything frozen is the collector's again."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
