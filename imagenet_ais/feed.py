"""Batches made ready on the device ahead of the step that needs them.

A thread pulls host batches and turns them into device tensors (copy + normalise, or GPU
decode) while the training step runs. On CUDA that work goes on a side stream, and the
training stream waits on an event per batch, so the step waits for its own batch only.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

_END = object()
_live: weakref.WeakSet[DeviceFeed] = weakref.WeakSet()


def close_all(timeout: float = 10) -> None:
    """Stop every feed thread (at exit: one left inside torch while the interpreter shuts down aborts it)."""
    for feed in list(_live):
        feed.close(timeout)


class DeviceFeed:
    """Iterate ``prepare(item)`` for each item of ``items``, computed up to ``ahead`` items early.

    ``prepare`` returns a tuple whose tensors live on ``device``; anything else in it passes
    through. Call ``close`` (or exhaust it) so the thread ends.
    """

    def __init__(self, items: Iterator[Any], prepare: Callable[[Any], tuple], device: torch.device, ahead: int = 2):
        self.items, self.prepare, self.device = items, prepare, device
        self.cuda = device.type == "cuda"
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="device-feed", daemon=True)
        self.thread.start()
        _live.add(self)

    def _put(self, item: object) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            with torch.cuda.stream(stream) if stream else nullcontext():
                for item in self.items:
                    ready = self.prepare(item)
                    event = None
                    if stream:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not self._put((ready, event)):
                        return
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(e)
        else:
            self._put(_END)

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        item = self.queue.get()
        if item is _END:
            self.thread.join()
            raise StopIteration
        if isinstance(item, BaseException):
            self.thread.join()
            raise item
        ready, event = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in ready:
                if isinstance(t, torch.Tensor):
                    t.record_stream(current)  # made on the side stream, freed after use on this one
        return ready

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (it finishes the item in hand first); give up after ``timeout`` seconds."""
        self.stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
        _live.discard(self)
