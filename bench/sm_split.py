"""What does the GPU decode compete with beside the training step, and does keeping the step
off some of the GPU's SMs leave the feed room? (bench/RESULTS.md, run AM)

Our device feed runs unchanged (device_feed.DeviceFeed: nvJPEG decode, then crop + resize + flip +
normalise, `transforms.decode_encoded` / `crop_decoded`) from prepared page-locked host batches
of 500×375 q95 JPEGs (no DataLoader: the GPU side alone), beside either

- `--sms N,...`: a training step (a CUDA graph of a torchvision ResNet, bf16, channels_last, SGD)
  on the whole GPU (0) or confined to a CUDA green context of N SMs: the step alone (its
  ceiling there) and the step fed, with each feed stage's busy seconds;
- `--loads KIND:N,...`: matmuls or device-memory copies on N SMs (0: all): the feed's rate;
- `--feeds N`: nothing but N processes, each with a feed of its own, at once: their rates, and
  the GPU's JPEG engines' utilisation (`nvidia-smi dmon`).

Each case prints the GPU's clocks, power, temperature and throttle reasons. CUDA gets 32 work
queues as train.py gives it (distributed.WORK_QUEUES) unless CUDA_DEVICE_MAX_CONNECTIONS is set.
Run a green-context case in a process of its own (one --sms value per call): a failure there can
abort the process.

    PYTHONPATH=. python bench/sm_split.py --sms 0      # then --sms 120, --sms 104
    PYTHONPATH=. python bench/sm_split.py --loads matmul:32,copy:32,copy:0
"""

from __future__ import annotations

import argparse
import io
import itertools
import multiprocessing as mp
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch
import torchvision
from PIL import Image

from imagenet_ais.distributed import WORK_QUEUES
from imagenet_ais.loader.device_decode import crop_decoded, decode_encoded
from imagenet_ais.loader.device_feed import DeviceFeed
from imagenet_ais.loader.transforms import Box, encode_for_device
from imagenet_ais.loader.wire import Encoded, Raw, encode_batch, pin_encoded

DEVICE = torch.device("cuda")


def jpegs(count: int) -> list[bytes]:
    """500 × 375 q95 JPEGs, smooth colour fields with grain (about ImageNet's bytes per image)."""
    with ProcessPoolExecutor() as pool:
        return [data for part in pool.map(_jpegs, [(count // 64, seed) for seed in range(64)]) for data in part]


def _jpegs(job: tuple[int, int]) -> list[bytes]:
    count, seed = job
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        field = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
            (500, 375), Image.Resampling.BICUBIC
        )
        grain = rng.normal(0, 6, (375, 500, 3))
        buf = io.BytesIO()
        Image.fromarray((np.asarray(field) + grain).clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def host_batches(images: list[bytes], batch: int) -> list[Encoded]:
    """Page-locked batches with RandomResizedCrop boxes, as the workers hand them over."""
    rng = random.Random(0)
    samples: list[tuple[Raw, Box]] = [encode_for_device(data, rng) for data in images]
    return [pin_encoded(encode_batch(samples[i : i + batch])) for i in range(0, len(samples) - batch + 1, batch)]


def graphed_step(model_name: str, batch: int, stream: torch.cuda.Stream) -> tuple[Callable[[], None], torch.Tensor]:
    """One training step as a CUDA graph captured on ``stream``; and its static input."""
    model = getattr(torchvision.models, model_name)().to(DEVICE, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=DEVICE).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=DEVICE)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph.replay, x


def rate(step: Callable[[], None], batch: int, seconds: float) -> float:
    """Images a second over ``seconds`` after a second's warm-up."""
    for warm in (True, False):
        torch.cuda.synchronize()
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < (1.0 if warm else seconds):
            step()
            steps += 1
            if steps % 4 == 0:
                torch.cuda.synchronize()  # (bounded run-ahead, as the feed's queue bounds it)
        torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - start)


def feed(batches: list[Encoded]) -> DeviceFeed:
    stages = [
        ("decode", lambda b: decode_encoded(b, DEVICE)),
        ("crop", lambda d: (crop_decoded(d, 224, DEVICE, True),)),
    ]
    return DeviceFeed(itertools.cycle(batches), stages, DEVICE, ahead=4)


def feed_alone(batches: list[Encoded], seconds: float) -> float:
    """The feed's images a second (beside whatever else runs), after a second's warm-up."""
    source = feed(batches)
    try:
        for warm in (True, False):
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < (1.0 if warm else seconds):
                next(source)
                n += 1
    finally:
        source.close()
    return n * len(batches[0].sizes) / (time.perf_counter() - start)


def feeds_at_once(count: int, images: list[bytes], batch: int, seconds: float) -> Iterator[str]:
    """``count`` processes, each with its feed alone on the GPU at the same time (each its own
    nvJPEG decoder: torchvision decodes one batch at a time per process): is the decode bound by
    the process or by the GPU's JPEG engines? With the engines' utilisation meanwhile."""
    spawn = mp.get_context("spawn")
    start, results = spawn.Barrier(count + 1), spawn.Queue()
    jobs = [spawn.Process(target=_feed_process, args=(images, batch, seconds, start, results)) for _ in range(count)]
    for job in jobs:
        job.start()
    start.wait(timeout=600)  # (a process that died first breaks it)
    time.sleep(1 + seconds / 3)
    usage = subprocess.run(["nvidia-smi", "dmon", "-s", "u", "-c", "3"], capture_output=True, text=True).stdout
    rates = [results.get(timeout=seconds + 120) for _ in jobs]
    for job in jobs:
        job.join()
    yield f"{count} feeds at once: {sum(rates):,.0f} img/s ({', '.join(f'{r:,.0f}' for r in rates)})"
    yield from ("  " + line for line in usage.splitlines())


def _feed_process(images: list[bytes], batch: int, seconds: float, start: Any, results: Any) -> None:
    batches = host_batches(images, batch)
    start.wait(timeout=600)
    results.put(feed_alone(batches, seconds))


def gpu_state() -> str:
    query = "clocks.sm,clocks.max.sm,clocks.video,power.draw,temperature.gpu,clocks_event_reasons.active"
    got = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
    )
    return got.stdout.strip() or got.stderr.strip()


def step_stream(sms: int) -> tuple[torch.cuda.Stream, Any]:
    """A stream on the whole GPU (0), or on a green context of ``sms`` SMs (kept alive with it)."""
    if not sms:
        return torch.cuda.Stream(), None
    green = torch.cuda.green_contexts.GreenContext.create(sms, 0)
    s = green.Stream()  # type: ignore[attr-defined]
    return torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type), green


def run_case(args: argparse.Namespace, sms: int, batches: list[Encoded]) -> Iterator[str]:
    stream, green = step_stream(sms)
    replay, x = graphed_step(args.model, args.batch, stream)
    current = torch.cuda.current_stream()

    def alone() -> None:
        with torch.cuda.stream(stream):
            replay()

    yield f"sms={sms or 'all'} alone={rate(alone, args.batch, args.seconds):,.0f}"
    source = feed(batches)

    def fed() -> None:
        # the batch is taken and copied on the current stream, where the feed recorded it
        (images,) = next(source)
        current.wait_stream(stream)
        x.copy_(images)
        stream.wait_stream(current)
        alone()

    try:
        together = rate(fed, args.batch, args.seconds)
        busy = source.busy()
    finally:
        source.close()
    yield f"sms={sms or 'all'} fed={together:,.0f} busy={ {k: round(v, 1) for k, v in busy.items()} }"
    yield f"  gpu: {gpu_state()}"
    del green


def loaded(kind: str, sms: int, batches: list[Encoded], seconds: float) -> Iterator[str]:
    """The feed alone while another thread keeps ``sms`` SMs busy with matmuls or with copies
    in device memory: what does the decode compete for?"""
    stream, green = step_stream(sms)
    with torch.cuda.stream(stream):
        if kind == "matmul":
            a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
            op: Callable[[], object] = lambda: a @ a  # noqa: E731
        else:
            src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
            dst = torch.empty_like(src)
            op = lambda: dst.copy_(src)  # noqa: E731
    stop, done = threading.Event(), [0]

    def work() -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                op()
                done[0] += 1
                if done[0] % 4 == 0:
                    stream.synchronize()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        start, before = time.perf_counter(), done[0]
        fed = feed_alone(batches, seconds)
        took, ops = time.perf_counter() - start, done[0] - before  # (the load's rate over the feed's run)
        state = gpu_state()
    finally:
        stop.set()
        thread.join()
    unit = 2 * 8192**3 / 1e12 if kind == "matmul" else 2 * 2**30 / 1e9  # TFLOP, or GB read + written
    yield (
        f"feed beside {kind} on {sms or 'all'} SMs: {fed:,.0f} img/s; "
        f"{kind} {ops * unit / took:,.0f} {'TFLOP/s' if kind == 'matmul' else 'GB/s'}"
    )
    yield f"  gpu: {state}"
    del green


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--sms", default="0", help="the step's SMs per case; 0: all")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--feeds", type=int, default=0, help="N processes feeding alone at once instead")
    parser.add_argument("--loads", default="", help="e.g. matmul:0,copy:88: the feed alone beside these instead")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", WORK_QUEUES)  # before CUDA starts
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ['CUDA_DEVICE_MAX_CONNECTIONS']}")
    images = jpegs(args.images)
    if args.feeds:
        for line in feeds_at_once(args.feeds, images, args.batch, args.seconds):
            print(line, flush=True)
        return
    batches = host_batches(images, args.batch)
    props = torch.cuda.get_device_properties(0)
    kb = sum(len(b.blob) for b in batches) / args.images / 1e3
    print(
        f"{props.name}, {props.multi_processor_count} SMs; {len(batches)} batches of {args.batch} ({kb:.0f} kB a JPEG)"
    )
    print(f"feed alone: {feed_alone(batches, args.seconds / 2):,.0f} img/s; gpu: {gpu_state()}")
    for load in filter(None, args.loads.split(",")):
        kind, sms = load.split(":")
        for line in loaded(kind, int(sms), batches, args.seconds):
            print(line, flush=True)
    for sms in (int(s) for s in args.sms.split(",") if not args.loads):
        try:
            for line in run_case(args, sms, batches):
                print(line, flush=True)
        except Exception as e:  # report and go on to the next SM count
            print(f"sms={sms}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
