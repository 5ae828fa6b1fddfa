#!/usr/bin/env python3
"""GPU JPEG decoders compared: torchvision's nvJPEG against nvImageCodec's backends.

Each decoder takes one batch of ImageNet-like JPEGs (500×375, quality 95, ~110 KB) on a side
stream: alone, then in a thread beside an eager ResNet-50 bf16 training loop (the ceiling
printed next to it is the same loop alone). Needs a CUDA GPU and nvImageCodec with nvJPEG
(``pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg``, or the -cu12 builds), which the
training path does not use yet: this measures whether it should.
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

from imagenet_ais.synth import draw_picture
from imagenet_ais.transforms import RATIO, SCALE, RandomResizedCrop

BATCH = 256


def jpegs(n: int) -> list[bytes]:
    rng = random.Random(0)
    out = []
    for k in range(n):
        buf = io.BytesIO()
        draw_picture(k, rng, (500, 375)).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def decoders(data: list[bytes], stream: torch.cuda.Stream) -> dict[str, Callable[[], object]]:
    """One batch decode per call, on ``stream``, for each decoder that can be built here."""
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


def resnet50_step() -> Callable[[], None]:
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(BATCH, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (BATCH,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def beside_training(
    decode: Callable[[], object], stream: torch.cuda.Stream, step: Callable[[], None]
) -> tuple[float, float]:
    """Decode rate in a thread while the training loop runs, and the training rate meanwhile."""
    stop, done = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            decode()
            stream.synchronize()
            done[0] += BATCH

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(1)
    before, start = done[0], time.perf_counter()
    trained = rate(step, BATCH, 6.0)
    decoded = (done[0] - before) / (time.perf_counter() - start)
    stop.set()
    thread.join()
    return decoded, trained


@click.command()
@click.option("--seconds", default=4.0, show_default=True, help="per decoder, alone")
def main(seconds: float) -> None:
    if not torch.cuda.is_available():
        raise click.ClickException("bench/decoders.py needs a CUDA GPU")
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError as e:
        hint = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (or the -cu12 builds)"
        raise click.ClickException(f"{e}: {hint}") from e
    data = jpegs(BATCH)
    stream = torch.cuda.Stream(priority=-1)
    click.echo(f"{torch.cuda.get_device_name()}, batch {BATCH}, {sum(map(len, data)) / BATCH / 1e3:.0f} KB a JPEG")
    alone = {}
    for name, fn in decoders(data, stream).items():
        try:
            alone[name] = (fn, rate(fn, BATCH, seconds))
        except RuntimeError as e:
            click.echo(f"{name:44} failed: {e}")
            continue
        click.echo(f"{name:44} alone {alone[name][1]:8.0f} img/s")
    step = resnet50_step()
    click.echo(f"{'ResNet-50 eager bf16 bs256, no decoding':44} {rate(step, BATCH, 6.0):8.0f} img/s (ceiling)")
    for name, (fn, _) in alone.items():
        if "16 threads" not in name:  # the loader workers want the other cores
            decoded, trained = beside_training(fn, stream, step)
            click.echo(f"{name:44} beside training {decoded:8.0f} img/s, ResNet-50 meanwhile {trained:6.0f} img/s")


if __name__ == "__main__":
    main()
