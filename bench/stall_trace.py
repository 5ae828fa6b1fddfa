#!/usr/bin/env python3
"""Run train.py with a trace of where the feed's time goes, to find what stalls a step (#65, goal 4).

Every process of the run (the training process and its DataLoader workers, forked from it) writes
its events to OUT/trace-PID.jsonl, each with CLOCK_MONOTONIC times, which all processes share:

- ``step``: the training loop got a batch (DeviceFeed.__next__), after waiting ``wait`` s;
- ``recv``: the feed's host thread waited ``t1 - t0`` for the DataLoader's next batch, from ``worker``;
- ``decode`` / ``crop``: a feed stage's call (its thread's CPU seconds, JPEGs, bytes; nvJPEG's
  decode takes the ``batches`` waiting for it together, the crop one);
- ``fetch``: a worker made a batch (its process's CPU seconds; ``jpegs`` of ``samples``);
- ``gc``: a collection of ``gen`` that took over 2 ms, in any process;
- ``cpu``: every 0.25 s, the host's CPUs' busy share since the last, and the share of it a virtual
  machine's host took (``steal``: its CPUs ran someone else);
- ``collector``, ``settle``: the run's Collector made (train/collector.py), with the process's
  freeze count and whether its collector was on, and its first call to freeze what the process
  holds: whether it was ``idle`` (the collector off) and the freeze count after.

Where no batch comes for STACKS_AFTER s, every process writes its threads' stacks to
OUT/stacks-PID.txt (``faulthandler``), once: where a stopped feed stopped.

Changes to try on top, as options among train.py's: ``--x-unordered`` (the DataLoader hands over
batches as they come, ``in_order=False``), ``--x-nice`` (the
DataLoader workers at nice 10, below the training process's threads), ``--x-pin-decode`` (the
decode thread alone on a core: every other thread and the workers on the others) and
``--x-blocking-sync`` (the CUDA context's synchronisations sleep instead of spinning, set before
train.py makes it: bench/decode_sync.py) and ``--x-idle=SHARE`` (cpu_share.IDLE, the part of its
time an "auto" worker keeps waiting). ``--x-profile=FIRST:LAST`` writes a torch.profiler trace of
batches FIRST to LAST to OUT/profile.json.gz.

    python3 bench/stall_trace.py OUT train.py [--x-OPTION...] ARGS...
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import gc
import json
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils import fetch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from imagenet_ais.loader import cpu_share, device_feed, engine
from imagenet_ais.train import collector

GC_MS = 2.0  # shorter collections are not written
STACKS_AFTER = 60.0  # s without a batch: a compile takes under 10


class Trace:
    """Lines of events to this process's own file (a forked worker opens its own)."""

    def __init__(self, out: Path):
        self.out, self.pid, self.file = out, -1, None
        self.lock = threading.Lock()
        self.collections: collections.deque[dict] = collections.deque()  # (gc's, written with the next event)
        self.last_step = time.monotonic()  # (or the start)
        # A thread of the parent may hold the lock as a worker forks: the worker's copy would stay
        # held, and its first event wait for ever (a feed stopped at its 7th batch, once)
        os.register_at_fork(after_in_child=self.forked)

    def forked(self) -> None:
        self.lock, self.collections = threading.Lock(), collections.deque()

    def __call__(self, ev: str, **fields: Any) -> None:
        with self.lock:
            if self.pid != os.getpid():  # (a forked worker: the parent's file is not its own)
                self.pid = os.getpid()
                self.file = open(self.out / f"trace-{self.pid}.jsonl", "a", buffering=1)  # noqa: SIM115
            while self.collections:
                self.file.write(json.dumps(self.collections.popleft()) + "\n")
            self.file.write(json.dumps({"ev": ev, **fields}) + "\n")

    def collected(self, **fields: Any) -> None:
        """A collection's event, without the lock: a collection can start in any thread while it
        holds it, inside ``__call__`` too."""
        self.collections.append({"ev": "gc", **fields})


def watch_gc(trace: Trace) -> None:
    began: dict[int, float] = {}

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            began[os.getpid()] = time.monotonic()
            return
        t0 = began.pop(os.getpid(), None)
        if t0 is not None and (time.monotonic() - t0) * 1000 >= GC_MS:
            trace.collected(gen=info["generation"], t0=t0, t1=time.monotonic(), collected=info["collected"])

    gc.callbacks.append(collected)


def watch_feed(trace: Trace) -> None:
    """The loop's batches, the host thread's receipts and the device stages' calls."""
    original_next = device_feed.DeviceFeed.__next__

    def next_batch(self: device_feed.DeviceFeed) -> tuple:
        t0 = time.monotonic()
        item = original_next(self)
        trace.last_step = time.monotonic()
        trace("step", t=trace.last_step, wait=trace.last_step - t0)
        return item

    device_feed.DeviceFeed.__next__ = next_batch  # type: ignore[method-assign]

    last_worker = threading.local()
    original_process = _MultiProcessingDataLoaderIter._process_data
    original_data = _MultiProcessingDataLoaderIter._next_data

    def process_data(self: Any, data: Any, worker_idx: int) -> Any:
        last_worker.id = worker_idx
        return original_process(self, data, worker_idx)

    def next_data(self: Any) -> Any:
        t0 = time.monotonic()
        data = original_data(self)
        trace("recv", t0=t0, t1=time.monotonic(), worker=getattr(last_worker, "id", -1))
        return data

    _MultiProcessingDataLoaderIter._process_data = process_data  # type: ignore[method-assign]
    _MultiProcessingDataLoaderIter._next_data = next_data  # type: ignore[method-assign]

    for stage in ("decode", "dali_decode", "crop"):
        original = getattr(engine._OnDevice, stage)

        def timed(self: Any, item: Any, _original: Any = original, _stage: str = stage) -> Any:
            t0, cpu0 = time.monotonic(), time.thread_time()
            out = _original(self, item)
            # decode takes the batches waiting for it together (device_feed.Merged), crop one
            batches = item if _stage == "decode" else [item if _stage == "dali_decode" else item[1]]
            encoded = [batch.images for batch in batches]
            sizes = [size for one in encoded for size in getattr(one, "sizes", ())]
            trace(
                "decode" if _stage == "dali_decode" else _stage,
                t0=t0,
                t1=time.monotonic(),
                cpu=time.thread_time() - cpu0,
                batches=len(encoded),
                jpegs=len(sizes),
                bytes=int(sum(sizes)),
            )
            return out

        setattr(engine._OnDevice, stage, timed)


def profile(out: Path, first: int, last: int) -> None:
    """torch.profiler over the loop's batches ``first`` to ``last`` to OUT/profile.json.gz: the
    GPU's kernels and copies on every stream, every thread's CUDA runtime calls, and the CPU ops
    of the training loop's threads (bench/profile_report.py reads it)."""
    import torch
    from torch.profiler import ProfilerActivity

    gpu = torch.cuda.is_available()
    profiler = torch.profiler.profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))
    steps = [0]
    original_next = device_feed.DeviceFeed.__next__

    def next_batch(self: device_feed.DeviceFeed) -> tuple:
        steps[0] += 1
        if steps[0] == first:
            profiler.start()
        item = original_next(self)
        if steps[0] == last:
            if gpu:
                torch.cuda.synchronize()
            profiler.stop()
            profiler.export_chrome_trace(str(out / "profile.json.gz"))  # (torch gzips a .gz path)
        return item

    device_feed.DeviceFeed.__next__ = next_batch  # type: ignore[method-assign]


def watch_collector(trace: Trace) -> None:
    original_init, original_settle = collector.Collector.__init__, collector.Collector.settle

    def init(self: collector.Collector) -> None:
        trace("collector", t=time.monotonic(), freeze_count=gc.get_freeze_count(), enabled=gc.isenabled())
        original_init(self)

    def settle(self: collector.Collector) -> None:
        first, t0 = not hasattr(self, "traced"), time.monotonic()
        original_settle(self)
        if first:  # (its later calls do nothing)
            self.traced = True
            trace("settle", t0=t0, t1=time.monotonic(), idle=self.idle, freeze_count=gc.get_freeze_count())

    collector.Collector.__init__ = init  # type: ignore[method-assign]
    collector.Collector.settle = settle  # type: ignore[method-assign]


def watch_workers(trace: Trace) -> None:
    original = fetch._IterableDatasetFetcher.fetch

    def fetched(self: Any, index: Any) -> Any:
        t0, cpu0 = time.monotonic(), time.process_time()
        batch = original(self, index)
        images = getattr(batch, "images", None)
        info = get_worker_info()
        trace(
            "fetch",
            worker=info.id if info else -1,
            t0=t0,
            t1=time.monotonic(),
            cpu=time.process_time() - cpu0,
            jpegs=len(getattr(images, "sizes", ())),
            samples=len(getattr(batch, "keys", ())),
        )
        return batch

    fetch._IterableDatasetFetcher.fetch = fetched  # type: ignore[method-assign]


def cpu_times() -> tuple[int, int, int]:
    """(busy, steal, all) jiffies of every CPU since boot: /proc/stat's first line."""
    times = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(times) - times[3] - times[4], times[7], sum(times)  # (less idle and iowait)


def watch_cpus(trace: Trace) -> None:
    def sample() -> None:
        before = cpu_times()
        while True:
            time.sleep(0.25)
            now = cpu_times()
            if now[2] > before[2]:
                busy, steal, all_ = (a - b for a, b in zip(now, before, strict=True))
                trace("cpu", t=time.monotonic(), busy=busy / all_, steal=steal / all_)
            before = now

    threading.Thread(target=sample, name="trace-cpus", daemon=True).start()


def watch_for_a_stop(trace: Trace, out: Path) -> None:
    """Every process's stacks where no batch has come for STACKS_AFTER s (again after each batch)."""
    files: list = []  # (kept open: faulthandler writes to their descriptors)
    # (SIGUSR2: the workers ignore SIGUSR1, a cluster's notice of preemption to the whole group)

    def register() -> None:  # in this process, and in each worker as it forks
        files.append(open(out / f"stacks-{os.getpid()}.txt", "a"))  # noqa: SIM115
        faulthandler.register(signal.SIGUSR2, file=files[-1], all_threads=True)

    def watch() -> None:
        dumped = None
        while True:
            time.sleep(1)
            last = trace.last_step
            if time.monotonic() - last > STACKS_AFTER and dumped != last:
                dumped = last
                for worker in multiprocessing.active_children():  # (first: the trace's lock may be what stopped it)
                    os.kill(worker.pid, signal.SIGUSR2)
                faulthandler.dump_traceback(file=files[0], all_threads=True)
                trace("stopped", t=time.monotonic(), since=last)

    register()
    os.register_at_fork(after_in_child=register)
    threading.Thread(target=watch, name="trace-stops", daemon=True).start()


def unordered() -> None:
    original = DataLoader.__init__

    @functools.wraps(original)
    def init(self: DataLoader, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "in_order": False})

    DataLoader.__init__ = init  # type: ignore[method-assign]


def nice(increment: int) -> None:
    """The workers at a lower CPU priority than the training process's threads."""
    original = engine.worker_init

    def init(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        os.nice(increment)

    engine.worker_init = init


def pin_decode() -> None:
    """The decode thread alone on the last core this process may run on; every other thread,
    and the workers forked later, on the rest (a thread starts with its creator's cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("--x-pin-decode: this process may run on one core only")
    # (this thread's, so every thread's it starts from here on: torch's, the feed's, the workers')
    os.sched_setaffinity(0, cores[:-1])
    original = engine._OnDevice.decode
    pinned = threading.local()

    def decode(self: Any, item: Any) -> Any:
        if not getattr(pinned, "done", False):
            os.sched_setaffinity(threading.get_native_id(), cores[-1:])  # (Linux: a thread is a task)
            pinned.done = True
        return original(self, item)

    engine._OnDevice.decode = decode  # type: ignore[method-assign]


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    flags = {a for a in args if a.startswith("--x-")}
    args = [a for a in args if a not in flags]
    out.mkdir(parents=True, exist_ok=True)
    trace = Trace(out)
    trace("start", t=time.monotonic(), flags=sorted(flags), argv=args)
    if "--x-pin-decode" in flags:
        pin_decode()  # (before any thread starts)
    if "--x-blocking-sync" in flags:
        from decode_sync import block_on_sync  # (bench/, this script's folder)

        block_on_sync()
    watch_gc(trace)
    watch_feed(trace)
    watch_collector(trace)
    watch_workers(trace)
    watch_cpus(trace)
    watch_for_a_stop(trace, out)
    if "--x-unordered" in flags:
        unordered()
    if "--x-nice" in flags:
        nice(10)
    for flag in flags:
        if flag.startswith("--x-idle="):
            cpu_share.IDLE = float(flag.split("=", 1)[1])  # (read by the workers, forked after this)
        if flag.startswith("--x-profile="):
            first, last = flag.split("=", 1)[1].split(":")
            profile(out, int(first), int(last))
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
