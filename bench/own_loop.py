#!/usr/bin/env python3
"""A user's own loop fed by ``ShardLoader``, against the same loop's ceiling, in one process.

The loop is docs/library.md's plain DDP loop as written there (bf16 autocast, cross entropy,
SGD, channels-last), run under ``torchrun`` with one process or more; ``--compile MODE`` wraps
the model in ``torch.compile`` as a user would. The ceiling is the same compiled step on four
batches already on the GPU (so the compiled graph copies its inputs as it does when fed), timed
before the loader starts and again after it closed (a step launched from Python runs at the
host's pace, which drifts between minutes: the ratio is against the mean of both); between them
the loader's batches, timed after ``--warmup`` steps inside an epoch as long as ImageNet's (the
rows of bench/RESULTS.md run AQ had short epochs of 510-710 steps). Prints both rates, their
ratio and each phase's milliseconds a step, of the wall time and on a CPU for the loop's thread
and autograd's backward thread (``per_step``: the step's host work costing more when fed shows
there), as one JSON line (also written to ``--json-out``). The environment is the caller's, with
``CUDA_DEVICE_MAX_CONNECTIONS`` 32 unless set, as the docs' loop sets it.

Under the rates, each window's host evidence (``host``): the loop's own thread's CPU share of
the wall time, the job's cores' busy share, the share of the machine's cores its hypervisor took
(steal), the garbage collections and the share of the wall time they took, the share of samples
the workers cropped, and for the loop's thread, autograd's backward thread and the feed's
threads the shares of the wall time each spent on a CPU and waiting in the run queue for one
(Linux's schedstat: a thread runnable but not running lost its core to another); a window slower
than the rest says by these what its host did otherwise.

``--profile FILE`` also samples the fed steady state with py-spy into FILE in py-spy's raw
(collapsed) format, and the first ceiling's timed steps into FILE-ceiling (``bench/spy_split.py``
compares the two): ``--gil`` (who holds the GIL, not pausing the process) or ``--native``
(every thread's native frames too, idle ones included, pausing the process at each sample: where
the loop's thread waits for the GIL).

    torchrun --nproc-per-node 1 bench/own_loop.py --data SHARDS --compile default
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.distributed as dist
import torchvision
from throughput import IMAGENET_TRAIN

from imagenet_ais import ShardLoader
from imagenet_ais.loader.cpu_time import own_cpu_jiffies

WINDOW = 50  # steps per window of the fed rate's trace
SPY = ["py-spy", "record", "--threads", "--duration", "10", "--format", "raw"]
SPY_MODES = {"gil": ["--gil", "--nonblocking", "--rate", "200"], "native": ["--native", "--idle", "--rate", "50"]}


class GcClock:
    """The interpreter's garbage collections, in any thread, and the seconds they took (a
    ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.collections, self.seconds, self._began = 0, 0.0, 0.0

    def __call__(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.collections += 1
            self.seconds += time.perf_counter() - self._began


GC_CLOCK = GcClock()


def spy_on(profile: tuple[Path, str] | None, suffix: str = "") -> subprocess.Popen | None:
    """py-spy sampling this process for 10 s into ``profile``'s file (its name + ``suffix``)."""
    if not profile:
        return None
    path, how = profile
    out = path.with_name(path.stem + suffix + path.suffix)
    return subprocess.Popen([*SPY, *SPY_MODES[how], "--output", str(out), "--pid", str(os.getpid())])


def steal_jiffies() -> tuple[int, int]:
    """(steal, all) of every core together since boot (/proc/stat): time the hypervisor ran others."""
    row = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return row[7], sum(row)


def thread_groups() -> dict[str, set[int]]:
    """The native ids of the loop's thread and of the feed's threads (the backward thread is
    told by its name, pt_autograd_N, in ``sched_times``)."""
    feed = [t for t in threading.enumerate() if t.name == "host-batches" or t.name.startswith("feed-")]
    groups = {"loop": [threading.main_thread()], "feed": feed}
    return {name: {t.native_id for t in threads if t.native_id is not None} for name, threads in groups.items()}


def sched_times(groups: dict[str, set[int]]) -> dict[str, tuple[int, int]]:
    """Per group of this process's threads, (ns on a CPU, ns runnable in the run queue) since they began."""
    out = {name: (0, 0) for name in (*groups, "autograd")}
    for task in Path("/proc/self/task").iterdir():
        try:
            run, queued = map(int, (task / "schedstat").read_text().split()[:2])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue  # (a thread that ended meanwhile)
        tid, autograd = int(task.name), "autograd" if name.startswith("pt_autograd") else None
        group = next((g for g, ids in groups.items() if tid in ids), autograd)
        if group:
            out[group] = (out[group][0] + run, out[group][1] + queued)
    return out


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    """docs/library.md's step, as written."""
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def docs_model(
    arch: str, classes: int, mode: str, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """docs/library.md's model and optimizer: channels-last under DDP, compiled in ``mode`` ("none": eager)."""
    model = torchvision.models.__dict__[arch](num_classes=classes).to(device, memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(model)
    if mode != "none":
        model = torch.compile(model, mode=mode)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def per_step(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]], wall: float, steps: int) -> dict[str, float]:
    """Milliseconds a step: of the wall time, and on a CPU for the loop's thread and autograd's
    backward thread (``sched_times`` at either end): a step's host work costing more when fed shows here."""
    cpu = {f"{group}_cpu_ms": round((b[group][0] - a[group][0]) / 1e6 / steps, 2) for group in ("loop", "autograd")}
    return {"wall_ms": round(wall * 1000 / steps, 2), **cpu}


def ceiling(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    shape: tuple[int, ...],
    classes: int,
    steps: int,
    profile: tuple[Path, str] | None = None,
) -> tuple[float, dict[str, float]]:
    batches = [
        (
            torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last),
            torch.randint(0, classes, (shape[0],), device="cuda"),
        )
        for _ in range(4)
    ]
    for i in range(30):  # compile, capture, warm up
        step(model, optimizer, *batches[i % 4])
    torch.cuda.synchronize()
    groups = thread_groups()
    start, began, spy = time.perf_counter(), sched_times(groups), spy_on(profile, "-ceiling")
    for i in range(steps):
        step(model, optimizer, *batches[i % 4])
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if spy:
        spy.wait()
    return steps * shape[0] / wall, per_step(began, sched_times(groups), wall, steps)


@dataclass
class Mark:
    """Where the loop stood at the end of a step: for the rate and the host's evidence of each window."""

    step: int
    wall: float
    event: torch.cuda.Event
    thread_cpu: float  # the loop's own thread's CPU seconds so far
    cores: tuple[int, int] | None  # the job's cores' (busy, all) jiffies
    collections: int  # the interpreter's garbage collections so far (GC_CLOCK's)
    gc_seconds: float  # and the seconds they took
    cropped: int  # samples the workers cropped so far
    steal: tuple[int, int]  # the machine's (steal, all) jiffies
    sched: dict[str, tuple[int, int]]  # per group of threads, (ns on a CPU, ns in the run queue)

    @classmethod
    def now(cls, step: int, loader: ShardLoader, groups: dict[str, set[int]]) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return cls(step, time.perf_counter(), event, time.thread_time(), own_cpu_jiffies(), GC_CLOCK.collections,
                   GC_CLOCK.seconds, loader.counters().get("cropped", 0), steal_jiffies(),
                   sched_times(groups))  # fmt: skip


def window(a: Mark, b: Mark, batch: int) -> dict[str, float]:
    """A window's rate (GPU time between its events) and what the host did meanwhile: the loop's
    thread's CPU share of the wall time (under 1: it waited, for the GIL, the GPU or a core), the
    job's cores' busy share, the steal, garbage collections and their share of the wall time, the
    share of its samples the workers cropped, and each group of threads' shares on a CPU
    (``_run``) and in the run queue (``_queued``)."""
    wall = b.wall - a.wall
    busy = (b.cores[0] - a.cores[0]) / max(1, b.cores[1] - a.cores[1]) if a.cores and b.cores else float("nan")
    sched = {}
    for group, (run, queued) in b.sched.items():
        sched[f"{group}_run"] = round((run - a.sched[group][0]) / 1e9 / wall, 2)
        sched[f"{group}_queued"] = round((queued - a.sched[group][1]) / 1e9 / wall, 3)
    return {
        "img_s": round((b.step - a.step) * batch * 1000 / a.event.elapsed_time(b.event)),
        "loop_cpu": round((b.thread_cpu - a.thread_cpu) / wall, 2),
        "cores_busy": round(busy, 2),
        "steal": round((b.steal[0] - a.steal[0]) / max(1, b.steal[1] - a.steal[1]), 3),
        "gc": b.collections - a.collections,
        "gc_share": round((b.gc_seconds - a.gc_seconds) / wall, 4),
        "cropped": round((b.cropped - a.cropped) / ((b.step - a.step) * batch), 3),
        **sched,
    }


def fed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: ShardLoader,
    warmup: int,
    steps: int,
    profile: tuple[Path, str] | None,
) -> dict[str, object]:
    """The loader's rate over ``steps`` after ``warmup``, with the step's wait for batches, the
    feed threads' busy shares and each window of WINDOW steps (CUDA events: no sync)."""
    spy, wait, batches, marks = None, 0.0, iter(loader), []
    groups: dict[str, set[int]] = {}
    for i in range(warmup + steps + 1):
        asked = time.perf_counter()
        images, labels, _keys = next(batches)
        wait += time.perf_counter() - asked
        step(model, optimizer, images, labels)
        groups = groups or thread_groups()  # (the feed's threads run once the first batch came)
        if i % WINDOW == 0 or i == warmup:
            marks.append(Mark.now(i, loader, groups))
        if i == warmup:
            wait, busy = 0.0, loader.busy()
            spy = spy_on(profile)
    torch.cuda.synchronize()
    busy = loader.busy()
    if spy:
        spy.wait()
    first = next(m for m in marks if m.step == warmup)
    seconds = first.event.elapsed_time(marks[-1].event) / 1000
    n = images.shape[0]
    windows = [window(a, b, n) for a, b in itertools.pairwise(marks) if b.step - a.step == WINDOW]
    return {
        "fed": round(steps * n / seconds, 1),
        "data_wait": round(wait / (marks[-1].wall - first.wall), 3),
        **{f"busy_{name}": round(s / seconds, 2) for name, s in busy.items()},
        "per_step": per_step(first.sched, marks[-1].sched, marks[-1].wall - first.wall, steps),
        "windows": [w["img_s"] for w in windows],
        "host": {key: [w[key] for w in windows] for key in windows[0] if key != "img_s"} if windows else {},
    }


def sleep_in_cuda_waits(device: int) -> None:
    """The device's host waits (synchronize, nvJPEG's inside torchvision) sleep rather than spin,
    for the whole process: cudaDeviceScheduleBlockingSync, set through the runtime torch loaded."""
    cudart = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    for call, arg in (("cudaSetDevice", device), ("cudaSetDeviceFlags", 4)):  # 4: cudaDeviceScheduleBlockingSync
        if error := getattr(cudart, call)(arg):
            raise RuntimeError(f"{call}({arg}) failed: CUDA error {error}")


@click.command()
@click.option("--data", required=True, help="shard location")
@click.option("--arch", default="resnet50", show_default=True)
@click.option("--batch-size", default=256, show_default=True)
@click.option("--image-size", default=224, show_default=True)
@click.option("--compile", "mode", default="none", type=click.Choice(["none", "default", "reduce-overhead"]))
@click.option("--steps", default=1000, show_default=True, help="timed fed steps")
@click.option("--ceiling-steps", default=500, show_default=True, help="timed steps on batches already on the GPU")
@click.option("--warmup", default=300, show_default=True, help="fed steps before the timing starts")
@click.option("--cpu-share", default="auto", show_default=True, help="ShardLoader's cpu_share (a diagnosis)")
@click.option("--switch-interval", type=float, help="sys.setswitchinterval for the run, in ms (a diagnosis)")
@click.option("--workers", type=int, help="ShardLoader's workers (a diagnosis; default: its own)")
@click.option("--decode", default="auto", show_default=True, help="ShardLoader's decode (a diagnosis: dali)")
@click.option("--blocking-sync", is_flag=True, help="CUDA's host threads sleep in their waits, not spin (a diagnosis)")
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path), help="py-spy raw samples here")
@click.option("--profile-mode", type=click.Choice(sorted(SPY_MODES)), default="gil", show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path))
def main(
    data: str,
    arch: str,
    batch_size: int,
    image_size: int,
    mode: str,
    steps: int,
    ceiling_steps: int,
    warmup: int,
    cpu_share: str,
    switch_interval: float | None,
    workers: int | None,
    decode: str,
    blocking_sync: bool,
    profile: Path | None,
    profile_mode: str,
    json_out: Path | None,
) -> None:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as docs/library.md's loop, before CUDA starts
    if switch_interval:
        sys.setswitchinterval(switch_interval / 1000)
    if blocking_sync:
        sleep_in_cuda_waits(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # an epoch as long as ImageNet's (or longer): the window lies inside it, as in a real run
    epoch = max(IMAGENET_TRAIN, (warmup + steps + 10) * batch_size * dist.get_world_size())
    loader = ShardLoader(
        data,
        "train",
        batch_size,
        epoch_size=epoch,
        image_size=image_size,
        channels_last=True,
        cpu_share=float(cpu_share) if cpu_share != "auto" else cpu_share,
        decode=decode,
        **({"workers": workers} if workers is not None else {}),
    )
    model, optimizer = docs_model(arch, len(loader.classes), mode, torch.device("cuda"))
    shape = (batch_size, 3, image_size, image_size)
    gc.callbacks.append(GC_CLOCK)
    spy = (profile, profile_mode) if profile and dist.get_rank() == 0 else None
    before, before_steps = ceiling(model, optimizer, shape, len(loader.classes), ceiling_steps, spy)
    got = fed(model, optimizer, loader, warmup, steps, spy)
    loader.close()
    after, after_steps = ceiling(model, optimizer, shape, len(loader.classes), ceiling_steps)
    top = (before + after) / 2
    row = {
        "arch": arch, "batch": batch_size, "size": image_size, "compile": mode, "ranks": dist.get_world_size(),
        "queues": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset"), "workers": loader.workers,
        "cpu_share": cpu_share, "decode": decode, "switch_ms": switch_interval, "blocking_sync": blocking_sync,
        "ceiling": round(top, 1), "ceiling_before": round(before, 1), "ceiling_after": round(after, 1),
        "ceiling_per_step": {"before": before_steps, "after": after_steps},
        "ratio": round(float(got["fed"]) / top, 3), **got,  # type: ignore[arg-type]
    }  # fmt: skip
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
        if json_out:
            with json_out.open("a") as out:
                out.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
