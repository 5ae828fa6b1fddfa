#!/usr/bin/env python3
"""Is the decode thread's CPU time nvJPEG's work, or its wait for the GPU's JPEG engines? (#65, goal 4)

torchvision's batched GPU decode (``decode_jpeg`` of a list, device "cuda") sends baseline JPEGs
to the JPEG engines (nvJPEG's hardware backend, A100 and later) and waits for them in
``cudaStreamSynchronize``, which under CUDA's default scheduling spins on a core. Traces had the
feed's decode thread using CPU for 93% of its time (bench/RESULTS.md run BE): work, or spinning?

This decodes batches of JPEGs taken from shards in a loop (torchvision's call, and where the
nvidia-nvimgcodec-cu13 and nvidia-nvjpeg wheels are installed, nvImageCodec's hardware decoder on
a stream of the highest or the lowest priority, and two of them on two threads, half a batch
each), each schedule in a process of its own: ``spin`` (CUDA's default) and ``block`` (the
primary context's blocking sync, set through the driver API before torch makes the context). It
prints, per batch size, JPEGs a second and the thread's (and the process's) CPU seconds per wall
second. ``--beside`` also runs each schedule beside a ResNet-18 bs512 training step (replayed as
one CUDA graph in a thread of its own, as train.py's compiled step keeps the GPU busy): what the
step does to the decode's time. ``--sync-every 10`` has the step wait on a sleeping event once in
10 replays, as train.py's loop does, and ``--step-stream own`` runs it on a stream of its own
instead of the legacy default stream. CUDA gets train.py's 32 work queues unless
CUDA_DEVICE_MAX_CONNECTIONS is set (before run BH it had CUDA's 8, and the step and the decode
shared queues). Run BH: beside the step at 32 queues every decoder ran at 0.56-0.74 of its rate
alone; two decoders on two threads were no faster alone than one, and 1.07× torchvision beside.

    python3 bench/decode_sync.py SHARDS_DIR [--sizes 256,365,512] [--batches 40] [--beside] [--schedules spin,block]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from imagenet_ais.distributed import WORK_QUEUES
from imagenet_ais.shards.members import members

BLOCKING_SYNC = 0x04  # CU_CTX_SCHED_BLOCKING_SYNC
WARMUP = 5  # batches before the timed ones


def jpegs(shards: Path, count: int) -> list[bytes]:
    """The first ``count`` JPEGs of the tar shards in ``shards``."""
    out: list[bytes] = []
    for path in sorted(shards.glob("*.tar")):
        with path.open("rb") as stream:
            for _, data in members(stream, lambda name: name.endswith((".jpg", ".jpeg"))):
                out.append(data)
                if len(out) == count:
                    return out
    if not out:
        raise click.ClickException(f"{shards}: no .jpg members in its *.tar files")
    return out


def block_on_sync() -> None:
    """The device's primary context to sleep in its synchronisations (before torch makes it)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), 0))):
        if getattr(cuda, call)(*args):
            sys.exit(f"{call} failed")
    if cuda.cuDevicePrimaryCtxSetFlags(device, BLOCKING_SYNC):
        sys.exit("cuDevicePrimaryCtxSetFlags failed")


def training(stop: threading.Event, steps: list[int], sync_every: int, own_stream: bool) -> None:
    """ResNet-18 bs512's training step as one CUDA graph (sm_split.graphed_step: forward, backward
    and SGD in bf16), replayed until ``stop``, counted in ``steps[0]``: waited for after each
    replay (the stream's synchronize: it spins under "spin"), or with ``sync_every`` over 1 every
    that many replays on an event that sleeps (train.py's compiled loop waits once a log window).
    On the legacy default stream, as train.py's step runs, which blocking streams and synchronous
    copies wait on; or on the stream it was captured on."""
    import torch
    from sm_split import graphed_step  # (bench/, this script's folder)

    captured_on = torch.cuda.Stream()
    replay, _ = graphed_step("resnet18", 512, captured_on)
    if own_stream:
        torch.cuda.set_stream(captured_on)
    done = torch.cuda.Event(blocking=True)
    while not stop.is_set():
        replay()
        steps[0] += 1
        if sync_every == 1:
            torch.cuda.current_stream().synchronize()
        elif steps[0] % sync_every == 0:
            done.record()
            done.synchronize()


def decoders(data: list[bytes]) -> dict[str, Callable[[list[int]], object]]:
    """Each decoder that can be built here: a function decoding the JPEGs of ``data`` at the given
    indices on the GPU, done when it returns. torchvision's decodes on a stream of its own (from
    PyTorch's pool, at the lowest priority); nvImageCodec's (its hardware backend, where its package
    is installed) on a stream given to it, of the highest priority or the lowest."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    out: dict[str, Callable[[list[int]], object]] = {
        "torchvision": lambda rows: decode_jpeg([tensors[i] for i in rows], mode=ImageReadMode.RGB, device="cuda")
    }
    try:
        from nvidia import nvimgcodec as nic
    except ImportError:
        return out
    planar = nic.DecodeParams(sample_format=nic.SampleFormat.P_RGB)

    def hardware(priority: int) -> Callable[[list[int]], object]:
        """A decoder of nvImageCodec's hardware backend, on a stream of its own of ``priority``."""
        stream = torch.cuda.Stream(priority=priority)
        decoder = nic.Decoder(device_id=0, max_num_cpu_threads=4, backends=[nic.Backend(nic.BackendKind.HW_GPU_ONLY)])

        def run(rows: list[int]) -> object:
            images = decoder.decode([data[i] for i in rows], params=planar, cuda_stream=stream.cuda_stream)
            stream.synchronize()
            return images

        return run

    out["nvimgcodec high priority"], out["nvimgcodec low priority"] = hardware(-1), hardware(0)
    # two decoders (each its own nvJPEG state) on two threads, half the batch each: nvJPEG's
    # hardware path waits for each picture's conversion kernel (bench/RESULTS.md run BH), so one
    # decoder's waits could overlap the other's work
    pair, pool = (hardware(0), hardware(0)), ThreadPoolExecutor(2)

    def halves(rows: list[int]) -> object:
        middle = len(rows) // 2
        return list(pool.map(lambda run, part: run(part), pair, (rows[:middle], rows[middle:])))

    out["nvimgcodec, 2 decoders on 2 threads"] = halves
    return out


def still_training(trainer: threading.Thread) -> None:
    """Exit where the step's thread has ended: rows measured beside no step would read as beside one."""
    if not trainer.is_alive():
        sys.exit("the training step's thread ended: its traceback is above")


def measure(
    shards: Path, schedule: str, sizes: list[int], batches: int, beside: bool, sync_every: int, own_stream: bool
) -> None:
    """(In a child process) decode ``batches`` batches of each size; a JSON line per size."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", WORK_QUEUES)  # as train.py, before CUDA starts
    if schedule == "block":
        block_on_sync()
    import torch

    stop, steps = threading.Event(), [0]
    step_on = f"resnet18 on {'its own' if own_stream else 'the default'} stream, waited every {sync_every}"
    trainer = None
    if beside:
        trainer = threading.Thread(target=training, args=(stop, steps, sync_every, own_stream), daemon=True)
        trainer.start()
        time.sleep(15)  # (the model built and its graph captured)
        still_training(trainer)
        before = steps[0]
        time.sleep(3)
        print(json.dumps({"schedule": schedule, "training_alone_steps_per_s": round((steps[0] - before) / 3, 1)}))
    data = jpegs(shards, max(sizes) * 2)
    torch.cuda.set_stream(torch.cuda.Stream())  # (this thread's: not the training step's to wait for)
    for decoder, decode in decoders(data).items():
        for size in sizes:
            groups = [list(range(i, i + size)) for i in range(0, len(data) - size + 1, size)]
            walls, cpus, process = [], [], []
            trained = 0
            for k in range(WARMUP + batches):
                if k == WARMUP:
                    trained = steps[0]  # (the step's count over the timed batches only)
                wall, cpu, all_cpu = time.perf_counter(), time.thread_time(), time.process_time()
                decode(groups[k % len(groups)])
                torch.cuda.current_stream().synchronize()
                if k >= WARMUP:
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.thread_time() - cpu)
                    process.append(time.process_time() - all_cpu)
            if trainer:
                still_training(trainer)
            walls.sort()
            row: dict[str, Any] = {
                "decoder": decoder,
                "schedule": schedule,
                "beside": step_on if beside else None,
                "batch": size,
                "jpegs_per_s": round(size * batches / sum(walls)),
                "ms_per_batch_median": round(walls[len(walls) // 2] * 1e3, 2),
                "cpu_per_wall": round(sum(cpus) / sum(walls), 3),
                "cpu_us_per_jpeg": round(sum(cpus) / (size * batches) * 1e6, 1),
                "process_cpu_per_wall": round(sum(process) / sum(walls), 3),  # other threads' too
                "training_steps_per_s": round((steps[0] - trained) / sum(walls), 1) if beside else None,
            }
            print(json.dumps(row), flush=True)
    stop.set()
    if trainer:
        trainer.join()  # (a thread inside CUDA at the interpreter's exit aborts it)


@click.command()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--sizes", default="256,365,512", help="JPEGs a batch, comma-separated")
@click.option("--batches", default=40, show_default=True, help="timed batches per size")
@click.option("--beside", is_flag=True, help="also beside a ResNet-18 training step on the GPU")
@click.option("--schedules", default="spin,block,spin,block", show_default=True, help="in turn, a process each")
@click.option("--sync-every", default=1, show_default=True, help="beside: replays between the step's waits")
@click.option("--step-stream", type=click.Choice(["default", "own"]), default="default", show_default=True)
@click.option("--child", type=click.Choice(["spin", "block"]), hidden=True)
def main(
    shards: Path,
    sizes: str,
    batches: int,
    beside: bool,
    schedules: str,
    sync_every: int,
    step_stream: str,
    child: str | None,
) -> None:
    sizes_ = [int(s) for s in sizes.split(",")]
    if child:
        measure(shards, child, sizes_, batches, beside, sync_every, step_stream == "own")
        return
    for schedule in schedules.split(","):
        for alongside in (False, True) if beside else (False,):
            command = [sys.executable, __file__, str(shards), "--sizes", sizes, "--batches", str(batches)]
            command += ["--sync-every", str(sync_every), "--step-stream", step_stream]
            subprocess.run([*command, "--child", schedule, *(["--beside"] if alongside else [])], check=True)


if __name__ == "__main__":
    main()
