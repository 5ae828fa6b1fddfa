#!/usr/bin/env python3
"""Which part of the feed slows a step launched from Python, and would a process of its own spare it?

A user's loop compiled in ``torch.compile``'s default mode launches its kernels from Python and
is bound by the host: fed by ``ShardLoader`` it ran at 0.76-0.95 of its ceiling (bench/RESULTS.md
runs AU-AV), its loop's thread spending 4-10 ms more CPU a step. py-spy (run AV) found that
thread's extra time inside the CUDA driver, waiting on its locks while the feed's decode thread
was inside torchvision's nvJPEG (the hardware decoder, driver calls for every picture). The
driver's locks are the process's: a feed in a process of its own would not share them, but its
kernels would share the GPU with the step's from another CUDA context (time-sliced).

This measures each part apart, beside docs/library.md's step (bench/own_loop.py's, on a batch
already on the GPU, under DDP), from prepared page-locked batches of generated 500×375 q95 JPEGs
(bench/sm_split.py's): each variant is a ``DeviceFeed`` with the loader's stages, taken from once
a step, so its work starts when the step does, as the loader's does.

- ``decode``: the decode stage alone (nvJPEG through torchvision); ``crop``: the crop stage alone,
  on batches decoded beforehand; ``feed``: both, the step training on what the feed makes;
- ``nvimgcodec``: the decode alone through nvImageCodec's hardware decoder instead (where that
  package is installed);
- ``decode-process``, ``feed-process``: the same stages in a process of their own (spawned: its
  own CUDA context), taken from once a step through a queue; ``feed-process`` writes its images
  into a ring of buffers this process opened once by CUDA IPC, and the step trains on them.

Each stage's milliseconds a batch are timed alone first, and again beside the step in each window
(in this process only): the difference is the time its work waits behind the step's on the device.
Windows of ``--window`` steps take turns: none beside, then a variant, for every variant in each
of ``--rounds`` rounds (each round starting at the next variant). A variant's window counts
against the mean of the two "none" windows around it, so that the host's drift (a default-mode
step's own rate moves 14% between minutes) cancels. Prints each variant's ratios, their median,
and the loop's thread's CPU milliseconds a step beside it and beside none, as a JSON line after
each round and at the end (the last also to ``--json-out``). Run AW's answer: in this process
the parts cost the step 5-13%, in a process of their own more (0.77-0.80: the GPU time-sliced).

    bash bench/fast_steps.sh OUT beside default   # or: PYTHONPATH=. torchrun --nproc-per-node 1 bench/beside_step.py
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import click
import torch
import torch.distributed as dist
from own_loop import docs_model, sched_times, step, thread_groups
from sm_split import gpu_state, host_batches, jpegs

from imagenet_ais.loader.device_decode import Decoded, crop_decoded, decode_encoded
from imagenet_ais.loader.device_feed import DeviceFeed
from imagenet_ais.loader.wire import Encoded

VARIANTS = ("decode", "crop", "feed", "decode-process", "feed-process", "nvimgcodec")
RING = 8  # a process's output buffers, shared once (more than its queue and feed hold ahead)
DRAIN = 32  # batches taken before a feed is timed alone: more than its queues and threads hold (about 11)


def stages(kind: str, device: torch.device, size: int) -> list[tuple[str, Callable[[Any], Any]]]:
    """The loader's stages (engine._OnDevice's) for ``kind``: decode, crop, or both. The decode
    alone ends in a stage that drops its pictures there, as the loader's crop stage does (on the
    loop's thread their hundreds of frees would be driver calls the loader never makes there)."""
    drop = ("drop", lambda _: ())
    if kind == "nvimgcodec":
        return [nvimgcodec_decode(device), drop]
    decode = ("decode", lambda batch: decode_encoded(batch, device))
    crop = ("crop", lambda decoded: (crop_decoded(decoded, size, device, channels_last=True),))
    return {"decode": [decode, drop], "crop": [crop], "feed": [decode, crop]}[kind]


def nvimgcodec_decode(device: torch.device) -> tuple[str, Callable[[Encoded], list[torch.Tensor]]]:
    """A decode stage through nvImageCodec's hardware decoder (``pip install nvidia-nvimgcodec-cu13
    nvidia-nvjpeg``; bench/decoders.py, run G): does it call the driver less for each picture
    than torchvision's nvJPEG?"""
    from nvidia import nvimgcodec as nic  # (this variant's only: the loader does not use it)

    decoder = nic.Decoder(device_id=device.index or 0, backends=[nic.Backend(nic.BackendKind.HW_GPU_ONLY)])
    planar = nic.DecodeParams(sample_format=nic.SampleFormat.P_RGB)

    def decode(batch: Encoded) -> list[torch.Tensor]:
        data = [nic.CodeStream(part.numpy()) for part in batch.blob.split(batch.sizes)]
        images = decoder.decode(data, params=planar, cuda_stream=torch.cuda.current_stream(device).cuda_stream)
        return [torch.from_dlpack(image) for image in images]

    return "decode", decode


def items(kind: str, batches: list[Encoded], device: torch.device) -> Iterator[Encoded | Decoded]:
    """What the variant's first stage takes, for ever: host batches, or (crop alone) batches decoded once."""
    if kind != "crop":
        return itertools.cycle(batches)
    decoded = [decode_encoded(batch, device) for batch in batches]
    sync()
    return itertools.cycle(decoded)


class Window(NamedTuple):
    """One window's figures: its variant ("none": nothing beside), images a second, the loop's
    thread's CPU milliseconds a step, and (in this process) each stage's milliseconds a step."""

    variant: str
    img_s: float
    loop_cpu_ms: float
    stage_ms: dict[str, float]


class Beside:
    """A variant's work beside the step: ``take`` once a step while its windows run.

    In a process of its own, a ``feed`` writes each batch into one of RING buffers that this
    process opened once (CUDA IPC), and hands over only the buffer's number: a tensor received
    by IPC costs its receiver driver calls when it arrives and a synchronize when it is freed,
    which a loader built so would avoid the same way."""

    def __init__(self, name: str, batches: list[Encoded], device: torch.device, images: list[bytes], size: int):
        self.kind = name.removesuffix("-process")
        self.feed: DeviceFeed | None = None
        self.child: Any = None
        self.ring: list[torch.Tensor] = []
        if not name.endswith("-process"):
            self.feed = DeviceFeed(items(self.kind, batches, device), stages(self.kind, device, size), device, ahead=4)
            next(self.feed)  # (the stages' first call: nvJPEG's and Triton's set-up)
            return
        spawn = torch.multiprocessing.get_context("spawn")  # (its queue passes CUDA tensors by IPC handle)
        self.made, self.stop = spawn.Queue(maxsize=2), spawn.Event()
        args = (self.kind, images, len(batches[0].boxes), size, str(device), self.made, self.stop)
        self.child = spawn.Process(target=_process_feed, args=args, daemon=True)
        self.child.start()
        try:
            self.ring = self._get(timeout=300)  # (its buffers, once its first batch is made: it is ready)
        except BaseException:
            self.close()
            raise

    def take(self) -> torch.Tensor | None:
        """One batch's worth: the images a ``feed`` made (for the step to train on), else None."""
        if self.feed is None:
            index = self._get(timeout=60)
            return self.ring[index] if self.ring else None
        item = next(self.feed)
        return item[0] if self.kind == "feed" else None

    def busy(self) -> dict[str, float]:
        """Seconds each of its stages worked since the last call (in this process; else none)."""
        return self.feed.busy() if self.feed is not None else {}

    def _get(self, timeout: float) -> Any:
        """The child's next message; an error at once if it ended, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.made.get(timeout=1)
            except queue.Empty:
                if self.child.exitcode is not None:
                    raise RuntimeError(f"its process ended (exit code {self.child.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing came from its process in {timeout:g} s") from None

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close(timeout=10)
            return
        self.ring = []  # (this process's handles on the child's memory go first)
        self.stop.set()
        self.child.join(timeout=30)
        if self.child.is_alive():
            self.child.kill()


def _process_feed(kind: str, images: list[bytes], batch: int, size: int, device: str, made: Any, stop: Any) -> None:
    """(In a process of its own, spawned) the stages of ``kind`` on ``images`` in batches of
    ``batch``: first the RING buffers (``feed``; else an empty list) into ``made``, then for each
    batch the number of the buffer it was written into (else None), until ``stop``."""
    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    feed = DeviceFeed(items(kind, host_batches(images, batch), where), stages(kind, where, size), where, ahead=4)
    ring: list[torch.Tensor] = []
    try:
        for n, item in enumerate(feed):
            if kind == "feed":
                ring = ring or [torch.empty_like(item[0]) for _ in range(RING)]
                ring[n % RING].copy_(item[0])
                sync()  # (written before its number is handed over)
            if n == 0:
                _put(made, ring, stop)
            if not _put(made, n % RING if ring else None, stop):
                return
    finally:
        feed.close(timeout=10)


def _put(made: Any, message: object, stop: Any) -> bool:
    """``message`` into ``made`` once there is room; False if ``stop`` came first."""
    while not stop.is_set():
        try:
            made.put(message, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def timed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[torch.Tensor, torch.Tensor],
    name: str,
    beside: Beside | None,
    settle: int,
    steps: int,
) -> Window:
    """``steps`` steps after ``settle`` (the feed's queued batches taken): the window of ``name``.
    A stage's milliseconds a step beside the step, against its time alone, show how long its
    work waits for the step's on the device."""
    images, labels = inputs
    groups = thread_groups()
    for i in range(settle + steps):
        if i == settle:
            sync()
            start, began = time.perf_counter(), sched_times(groups)["loop"][0]
            if beside:
                beside.busy()
        made = beside.take() if beside else None
        step(model, optimizer, images if made is None else made, labels)
    sync()
    wall = time.perf_counter() - start
    stages = {stage: 1000 * seconds / steps for stage, seconds in (beside.busy() if beside else {}).items()}
    cpu = (sched_times(groups)["loop"][0] - began) / 1e6 / steps
    return Window(name, steps * images.shape[0] / wall, cpu, stages)


def alone(beside: Beside, batches: int = 30) -> dict[str, float]:
    """Each of its stages' milliseconds a batch with no step beside (in this process): timed once
    its queues ran dry, so that each batch taken was made meanwhile."""
    for _ in range(DRAIN):
        beside.take()
    beside.busy()
    for _ in range(batches):
        beside.take()
    return {stage: round(1000 * seconds / batches, 2) for stage, seconds in beside.busy().items()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summary(name: str, windows: list[Window]) -> dict[str, Any]:
    """A variant's windows, each against the mean of the "none" windows before and after it."""
    at = [i for i, w in enumerate(windows) if w.variant == name]
    ratios = [windows[i].img_s / ((windows[i - 1].img_s + windows[i + 1].img_s) / 2) for i in at]
    stages = windows[at[0]].stage_ms.keys()
    return {
        "variant": name,
        "median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "img_s": [round(windows[i].img_s) for i in at],
        "loop_cpu_ms": round(statistics.median(windows[i].loop_cpu_ms for i in at), 2),
        "loop_cpu_ms_none": round(statistics.median(w.loop_cpu_ms for w in windows if w.variant == "none"), 2),
        "stage_ms": {stage: round(statistics.median(windows[i].stage_ms[stage] for i in at), 2) for stage in stages},
    }


@click.command()
@click.option("--arch", default="resnet50", show_default=True)
@click.option("--batch-size", default=256, show_default=True)
@click.option("--image-size", default=224, show_default=True)
@click.option("--compile", "mode", default="default", type=click.Choice(["none", "default", "reduce-overhead"]))
@click.option("--variants", default=",".join(VARIANTS), show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--window", default=60, show_default=True, help="timed steps a window")
@click.option("--settle", default=25, show_default=True, help="steps before each window's timing")
@click.option("--images", default=2048, show_default=True, help="generated JPEGs, cycled")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path))
def main(
    arch: str,
    batch_size: int,
    image_size: int,
    mode: str,
    variants: str,
    rounds: int,
    window: int,
    settle: int,
    images: int,
    json_out: Path | None,
) -> None:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as docs/library.md's loop, before CUDA starts
    names = [v for v in variants.split(",") if v]
    if unknown := set(names) - set(VARIANTS):
        raise click.BadParameter(f"{sorted(unknown)}: the variants are {', '.join(VARIANTS)}", param_hint="--variants")
    pictures = jpegs(images)  # (in a pool of processes, forked before CUDA starts here)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, optimizer = docs_model(arch, 1000, mode, device)
    shape = (batch_size, 3, image_size, image_size)
    inputs = (
        torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last),
        torch.randint(0, 1000, (batch_size,), device=device),
    )
    batches = host_batches(pictures, batch_size)
    besides: dict[str, Beside] = {}
    for name in names:  # (a variant that fails is reported and left out: the others' windows still count)
        try:
            besides[name] = Beside(name, batches, device, pictures, image_size)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}: left out", flush=True)
    head = {"arch": arch, "batch": batch_size, "size": image_size, "compile": mode, "window": window, "settle": settle}
    head["stage_ms_alone"] = {name: alone(beside) for name, beside in besides.items() if beside.feed}
    windows: list[Window] = []  # none, a variant, none, ...
    try:
        timed(model, optimizer, inputs, "none", None, 0, 30)  # compile, warm up
        windows.append(timed(model, optimizer, inputs, "none", None, settle, window))
        for r in range(rounds):
            order, shift = list(besides), r % max(1, len(besides))  # (each round starts elsewhere)
            for name in order[shift:] + order[:shift]:
                try:
                    got = timed(model, optimizer, inputs, name, besides[name], settle, window)
                except Exception as e:
                    print(f"{name}: {type(e).__name__}: {e}: left out from here on", flush=True)
                    besides.pop(name).close()
                    continue
                windows += [got, timed(model, optimizer, inputs, "none", None, settle, window)]
            print(json.dumps({**head, "rounds": r + 1, **results(names, windows)}), flush=True)  # (so far)
    finally:
        for beside in besides.values():
            beside.close()
    result = {**head, "rounds": rounds, "gpu": gpu_state() if cuda else None, **results(names, windows)}
    print(json.dumps(result), flush=True)
    if json_out:
        with json_out.open("a") as out:
            out.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


def results(names: list[str], windows: list[Window]) -> dict[str, Any]:
    """Each variant's summary, and the rates of the windows with none beside."""
    return {
        "none_img_s": [round(w.img_s) for w in windows if w.variant == "none"],
        "variants": [summary(name, windows) for name in names if any(w.variant == name for w in windows)],
    }


if __name__ == "__main__":
    main()
