"""Batches made ready on the device ahead of the step that needs them.

A pipeline of threads works while the training step runs: one pulls host batches (receiving
from the DataLoader workers: Python, holding the GIL), and each stage after it
(e.g. nvJPEG decode, then crop + resize + normalise) has a thread of its own, so that the
stages' times overlap instead of adding up. Measured on the H100 (bench/RESULTS.md), one
thread doing the work in turn spent the sum of the stages per batch, and the sum was the
end-to-end limit. On CUDA each stage's device work goes on a high-priority side stream of its own.

A stage given as ``Merged`` takes the items already waiting for it together, up to its
``most``, in one call: where each call costs a fixed wait (nvJPEG's decode call returns only once
its conversions, queued behind the step's kernels, are done), two batches cost one wait.

``busy()`` tells how long each thread spent working (the pulling thread: getting a batch,
waiting on the workers included): the stage near 100% of the wall time is the limit.
``step_wait`` is the share of its time the consumer recently spent blocked waiting for items (for
a training loop: its time in ``next``, not the GPU's idle time).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from imagenet_ais.loader.failures import Interrupted, Stalled

_END = object()
STEP_WAIT_SECONDS = 5.0  # what ``step_wait`` averages over
_live: weakref.WeakSet[DeviceFeed] = weakref.WeakSet()


@dataclass(frozen=True)
class Merged:
    """A stage's function over the items waiting for it, up to ``most`` (at least one): an output for each, in order."""

    many: Callable[[list[Any]], list[Any]]
    most: int = 2


Stage = tuple[str, Callable[[Any], Any] | Merged]


def _ends(item: object) -> bool:
    return item is _END or isinstance(item, BaseException)


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
    """Iterate each item of ``items`` passed through ``stages`` in turn, up to ``ahead`` items early.

    Each stage is a (name, function) pair with a thread of its own. The last stage returns a
    tuple whose tensors (also in nested tuples and lists) live on ``device``; anything else in
    it passes through. Call ``close`` (or exhaust it) so the threads end. While the consumer
    waits for an item, ``interrupted`` (if given) is asked every 0.2 s with the seconds waited; once it is true, the
    wait ends in ``Interrupted`` (a signal must stop a run whose data never comes); past ``timeout``
    seconds (if given) it ends in ``Stalled``.
    """

    def __init__(
        self,
        items: Iterator[Any],
        stages: Sequence[Stage],
        device: torch.device,
        ahead: int = 2,
        interrupted: Callable[[float], bool] | None = None,
        step_wait: float = 1.0,
        timeout: float | None = None,
    ):
        self.items, self.device, self.interrupted, self.timeout = items, device, interrupted, timeout
        # A stream per stage, of high priority (a batch's few small kernels need not queue behind
        # the step's): a block one stage frees while its kernels are queued goes back to its own
        # stream's pool, never to another stage's allocation, which nvJPEG could write from a
        # stream of its own before those kernels ran. Each stage's wait covers its own work only.
        cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device, priority=-1) if cuda else None for _ in stages]
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in stages] + [queue.Queue(maxsize=ahead)]
        self.stopping = threading.Event()
        self.seconds = {"host": 0.0, **{name: 0.0 for name, _ in stages}}
        # the consumer's share of time waiting for items: ``step_wait`` as given until the second
        # item (the first one's wait is the producer starting up), then its mean since the first,
        # over the last STEP_WAIT_SECONDS or so once it has run that long
        self.step_wait = step_wait
        self._began: float | None = None  # when the first item was handed over
        self._handed = 0.0  # when the last one was
        self.threads = [threading.Thread(target=self._pull, name="host-batches", daemon=True)]
        self.threads += [
            threading.Thread(target=self._stage, args=(i, name, fn), name=f"feed-{name}", daemon=True)
            for i, (name, fn) in enumerate(stages)
        ]
        for thread in self.threads:
            thread.start()
        _live.add(self)

    def busy(self) -> dict[str, float]:
        """Seconds each thread worked since the last call."""
        taken, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return taken

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
        items = iter(self.items)
        try:
            while True:
                start = time.perf_counter()
                item = next(items, _END)
                self.seconds["host"] += time.perf_counter() - start
                if not self._put(self.queues[0], item) or item is _END:
                    return
        except BaseException as e:  # passed on by the stages, raised by the consumer
            self._put(self.queues[0], e)

    def _take(self, source: queue.Queue, most: int) -> list[Any]:
        """The next item, then those already waiting, up to ``most`` or the end (_END or an error) if it comes."""
        items = [self._get(source)]
        while len(items) < most and not _ends(items[-1]):
            try:
                items.append(source.get_nowait())
            except queue.Empty:
                break
        return items

    def _stage(self, index: int, name: str, fn: Callable[[Any], Any] | Merged) -> None:
        source, sink, stream = self.queues[index], self.queues[index + 1], self.streams[index]
        many, most = (fn.many, fn.most) if isinstance(fn, Merged) else (lambda items: [fn(items[0])], 1)
        # A blocking event: the thread sleeps until the GPU is done. Beside a thread spinning in
        # the stream's synchronize, a step launched kernel by kernel from Python (torch.compile's
        # default mode) was fed at 0.74-0.82 of its ceiling in three runs, beside a sleeping one
        # at 0.83-0.95 in eight (bench/RESULTS.md runs AR-AU).
        done = torch.cuda.Event(blocking=True) if stream else None
        try:
            with torch.cuda.stream(stream) if stream else nullcontext():
                while True:
                    items = self._take(source, most)
                    end = items.pop() if _ends(items[-1]) else None
                    if items:
                        start = time.perf_counter()
                        outs = many(items)
                        if done:
                            # Done on the device before the inputs are dropped: their memory would
                            # otherwise go to the next allocation at once (nvJPEG writes from a
                            # stream of its own) while this stage's kernels may still read it.
                            done.record(stream)
                            done.synchronize()
                        self.seconds[name] += time.perf_counter() - start
                        del items
                        delivered = all(self._put(sink, out) for out in outs)
                        del outs  # (else held here, on the device, until the next call returns)
                        if not delivered:
                            return
                    if end is not None:
                        self._put(sink, end)
                        return
        except BaseException as e:
            self._put(sink, e)

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        start = time.monotonic()
        while True:
            try:
                item = self.queues[-1].get(timeout=0.2)
                break
            except queue.Empty:
                waited = time.monotonic() - start
                if self.interrupted and self.interrupted(waited):
                    raise Interrupted from None
                if self.timeout is not None and waited > self.timeout:
                    raise Stalled(f"no item came for {self.timeout:g} s") from None
        now = time.monotonic()
        self._waited(now - start, now)
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for t in (t for t in tensors_in(item) if t.is_cuda):
                # made on a stage's stream: without this, their memory would go back to that
                # stream's pool as soon as the step drops them, and the next batch would be
                # written into it while the step's kernels may still read it
                t.record_stream(current)
        return item

    def _waited(self, seconds: float, now: float) -> None:
        """The consumer waited ``seconds`` for the item handed over at ``now``: fold it into ``step_wait``."""
        span, self._handed = now - self._handed, now  # since it had the last one: its own work, then the wait
        if self._began is None:
            self._began = now
        elif span > 0:
            weight = span / min(STEP_WAIT_SECONDS, now - self._began)
            self.step_wait += min(1.0, weight) * (min(1.0, seconds / span) - self.step_wait)

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads (each finishes the item in hand first); give up after ``timeout`` seconds."""
        self.stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            if thread is not threading.current_thread():  # (closed from its own: a collection ran there)
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        # the items let go (a thread still pulling keeps its own hold): their producer is often a
        # generator of this feed's owner, which holds this feed, a cycle only a collection would end
        self.items = iter(())
        _live.discard(self)
