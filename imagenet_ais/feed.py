"""Batches made ready on the device ahead of the step that needs them.

Two threads overlap the two halves of the work while the training step runs: one pulls host
batches (receiving from the DataLoader workers and batching: Python, holding the GIL), the
other makes them device tensors (copy + normalise, or GPU decode: mostly waiting on nvJPEG
or the GPU with the GIL released). Measured on the H100 (bench/RESULTS.md), one thread doing
both spent their sum per batch, and the sum was the end-to-end limit. On CUDA the device
work goes on a side stream, and the training stream waits on an event per batch, so the step
waits for its own batch only.
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


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` and in the tuples and lists nested in it."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for item in obj:
            yield from tensors_in(item)


def close_all(timeout: float = 10) -> None:
    """Stop every feed's threads (at exit: one left inside torch while the interpreter shuts down aborts it)."""
    for feed in list(_live):
        feed.close(timeout)


class DeviceFeed:
    """Iterate ``prepare(item)`` for each item of ``items``, computed up to ``ahead`` items early.

    ``prepare`` returns a tuple whose tensors (also in nested tuples and lists) live on
    ``device``; anything else in it passes through. Call ``close`` (or exhaust it) so the threads end.
    """

    def __init__(self, items: Iterator[Any], prepare: Callable[[Any], tuple], device: torch.device, ahead: int = 2):
        self.items, self.prepare, self.device = items, prepare, device
        self.cuda = device.type == "cuda"
        self.pulled: queue.Queue = queue.Queue(maxsize=2)
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._pull, name="host-batches", daemon=True),
            threading.Thread(target=self._run, name="device-feed", daemon=True),
        ]
        for thread in self.threads:
            thread.start()
        _live.add(self)

    def _put(self, q: queue.Queue, item: object) -> bool:
        while not self.stopping.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue) -> object:
        while not self.stopping.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        return _END

    def _pull(self) -> None:
        try:
            for item in self.items:
                if not self._put(self.pulled, item):
                    return
        except BaseException as e:  # passed on by the device thread, raised by the consumer
            self._put(self.pulled, e)
        else:
            self._put(self.pulled, _END)

    def _run(self) -> None:
        # high priority: the batch's few small kernels need not queue behind the step's
        stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        try:
            with torch.cuda.stream(stream) if stream else nullcontext():
                while True:
                    item = self._get(self.pulled)
                    if item is _END or isinstance(item, BaseException):
                        self._put(self.queue, item)
                        return
                    ready = self.prepare(item)
                    event = None
                    if stream:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not self._put(self.queue, (ready, event)):
                        return
        except BaseException as e:
            self._put(self.queue, e)

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        item = self.queue.get()
        if item is _END or isinstance(item, BaseException):
            self.close()
            if item is _END:
                raise StopIteration
            raise item
        ready, event = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in (t for t in tensors_in(ready) if t.is_cuda):
                # made on the side stream: without this, their memory would go back to that
                # stream's pool as soon as the step drops them, and the next batch would be
                # written into it while the step's kernels may still read it
                t.record_stream(current)
        return ready

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads (each finishes the item in hand first); give up after ``timeout`` seconds."""
        self.stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        _live.discard(self)
