#!/usr/bin/env python3
"""GPU JPEG decoders compared: torchvision's nvJPEG against nvImageCodec's backends.

Each decoder takes one batch of ImageNet-like JPEGs (500×375, quality 95, ~110 KB) on a side
stream: alone, then from ``--threads`` threads (each with a decoder of its own) beside a
training loop of ``--model`` (bf16, channels_last, eager; the ceiling printed next to it is
the same loop alone). With ``--compile`` (CUDA graphs, as train.py trains) the decoding threads
hardly run at all in this loop (80 img/s in run AB): that mode shows the starvation, not a
rate. Needs a CUDA GPU and nvImageCodec with nvJPEG (``pip install nvidia-nvimgcodec-cu13
nvidia-nvjpeg``, or the -cu12 builds), which the training path does not use yet: this measures
whether it should.
"""

from __future__ import annotations

import io
import random
import threading
import time
from collections.abc import Callable

import click
import torch
import torchvision
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import RandomResizedCrop

from imagenet_ais.loader.transforms import RATIO, SCALE
from imagenet_ais.shards.synth import draw_picture


def jpegs(n: int) -> list[bytes]:
    rng = random.Random(0)
    out = []
    for k in range(n):
        buf = io.BytesIO()
        draw_picture(k, rng, (500, 375)).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def decoders(data: list[bytes], stream: torch.cuda.Stream) -> dict[str, Callable[[], object]]:
    """One batch decode per call, on ``stream``, for each decoder that can be built here (a
    decoder object of its own at each call of this function)."""
    from nvidia import nvimgcodec as nic

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    boxes = [RandomResizedCrop.get_params(torch.empty(3, 375, 500), list(SCALE), list(RATIO)) for _ in data]
    planar = nic.DecodeParams(sample_format=nic.SampleFormat.P_RGB)

    def torchvision_batch() -> object:
        with torch.cuda.stream(stream):
            return decode_jpeg(tensors, mode=ImageReadMode.RGB, device="cuda")

    def nvimgcodec_batch(decoder: object, roi: bool) -> Callable[[], object]:
        def run() -> object:
            streams = [nic.CodeStream(d) for d in data]
            if roi:  # decode only the RandomResizedCrop box
                streams = [
                    s.get_sub_code_stream(region=nic.Region(t, left, t + h, left + w))
                    for s, (t, left, h, w) in zip(streams, boxes, strict=True)
                ]
            images = decoder.decode(streams, params=planar, cuda_stream=stream.cuda_stream)
            with torch.cuda.stream(stream):
                return [torch.from_dlpack(img) for img in images]

        return run

    out: dict[str, Callable[[], object]] = {"torchvision decode_jpeg": torchvision_batch}
    for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU", None):
        for threads in (4, 16):
            backends = [nic.Backend(getattr(nic.BackendKind, kind))] if kind else None
            try:
                decoder = nic.Decoder(device_id=0, max_num_cpu_threads=threads, backends=backends)
            except RuntimeError as e:
                click.echo(f"nvimgcodec {kind}: cannot be built here ({e})")
                break
            for roi in (False, True):
                out[f"nvimgcodec {kind or 'any backend'} {threads} threads{' ROI' if roi else ''}"] = nvimgcodec_batch(
                    decoder, roi
                )
    return out


def rate(fn: Callable[[], object], images: int, seconds: float) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    torch.cuda.synchronize()
    return calls * images / (time.perf_counter() - start)


def training_step(arch: str, batch: int, compiled: bool) -> Callable[[], None]:
    model = getattr(torchvision.models, arch)().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    forward = torch.compile(model, mode="reduce-overhead", dynamic=False) if compiled else model

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def beside_training(
    decodes: list[tuple[Callable[[], object], torch.cuda.Stream]], batch: int, step: Callable[[], None]
) -> tuple[float, float]:
    """Decode rate of one thread per decoder (each on a stream of its own) while the training
    loop runs, and the training rate meanwhile."""
    stop, done = threading.Event(), [0] * len(decodes)  # images decoded, a count per thread

    def loop(i: int, decode: Callable[[], object], stream: torch.cuda.Stream) -> None:
        while not stop.is_set():
            decode()
            stream.synchronize()
            done[i] += batch

    threads = [threading.Thread(target=loop, args=(i, *pair)) for i, pair in enumerate(decodes)]
    for thread in threads:
        thread.start()
    time.sleep(1)
    before, start = sum(done), time.perf_counter()
    trained = rate(step, batch, 6.0)
    decoded = (sum(done) - before) / (time.perf_counter() - start)
    stop.set()
    for thread in threads:
        thread.join()
    return decoded, trained


@click.command()
@click.option("--seconds", default=4.0, show_default=True, help="per decoder, alone")
@click.option("--model", "arch", default="resnet50", show_default=True, help="a torchvision model to train beside")
@click.option("--batch", default=256, show_default=True, help="images per step")
@click.option("--decode-batch", default="", help="images per decode call alone, e.g. 128,256,512 (default: --batch)")
@click.option("--compile", "compiled", is_flag=True, help="train compiled with CUDA graphs (default: eager)")
@click.option("--threads", default="1", show_default=True, help="decoding threads beside training, e.g. 1,2")
@click.option("--only", default="", help="decoders whose names contain one of these, e.g. torchvision,HW_GPU_ONLY")
def main(seconds: float, arch: str, batch: int, decode_batch: str, compiled: bool, threads: str, only: str) -> None:
    if not torch.cuda.is_available():
        raise click.ClickException("bench/decoders.py needs a CUDA GPU")
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError as e:
        hint = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (or the -cu12 builds)"
        raise click.ClickException(f"{e}: {hint}") from e
    data = jpegs(batch)
    counts = [int(n) for n in threads.split(",")]
    # a decoder (and a high-priority stream) per decoding thread
    streams = [torch.cuda.Stream(priority=-1) for _ in range(max(counts))]
    sets = [decoders(data, stream) for stream in streams]
    click.echo(f"{torch.cuda.get_device_name()}, batch {batch}, {sum(map(len, data)) / batch / 1e3:.0f} KB a JPEG")
    working = [name for name in sets[0] if any(part in name for part in only.split(","))]
    for size in [int(n) for n in decode_batch.split(",")] if decode_batch else [batch]:
        alone = decoders(jpegs(size), streams[0]) if size != batch else sets[0]
        for name in list(working):
            try:
                click.echo(f"{name:44} alone, {size} a call {rate(alone[name], size, seconds):8.0f} img/s")
            except (RuntimeError, ValueError, TypeError) as e:
                click.echo(f"{name:44} failed: {e}")
                working.remove(name)
    step = training_step(arch, batch, compiled)
    label = f"{arch} {'compiled' if compiled else 'eager'} bf16 bs{batch}, no decoding"
    rate(step, batch, 10.0)  # warm-up (compiled: compiling, CUDA graphs recorded)
    click.echo(f"{label:44} {rate(step, batch, 6.0):8.0f} img/s (ceiling)")
    for name in working:
        if "16 threads" in name:  # the loader workers want the other cores
            continue
        for n in counts:
            pairs = [(sets[i][name], streams[i]) for i in range(n)]
            decoded, trained = beside_training(pairs, batch, step)
            meanwhile = f"{arch} meanwhile {trained:6.0f} img/s"
            click.echo(f"{name + f' ×{n}':44} beside training {decoded:8.0f} img/s, {meanwhile}")


if __name__ == "__main__":
    main()
