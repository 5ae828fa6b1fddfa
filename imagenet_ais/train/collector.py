"""The training process's garbage collector while a run lasts.

A full collection walks every object the process holds (torch, the model, torch.compile's graphs:
some 430,000 on a GPU host) with the interpreter lock held: 200-260 ms in which the feed's
threads and the step's launches all stop (bench/RESULTS.md run BE). Once an epoch's first steps
have compiled what they need, what the process holds is frozen out of the collector's reach
(``gc.freeze``); the run's end gives it back. Where the caller froze objects of its own, the run
leaves the collector as it found it.
"""

from __future__ import annotations

import gc


class Collector:
    """Freezes what the process holds once per epoch (``settle``) until ``release``."""

    def __init__(self) -> None:
        self.theirs = gc.get_freeze_count() > 0  # the caller's freeze: not ours to add to or undo
        self.epoch: int | None = None  # the epoch last settled
        self.frozen = False

    def settle(self, epoch: int) -> None:
        """Past ``epoch``'s first steps (compiled): what the process holds now, frozen (once an epoch)."""
        if self.theirs or self.epoch == epoch:
            return
        self.epoch = epoch
        gc.collect()  # (garbage frozen would stay until the run's end)
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        """The run is over: everything frozen is the collector's again."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
