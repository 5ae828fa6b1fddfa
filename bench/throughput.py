#!/usr/bin/env python3
"""Training rate through the real input pipeline against the ceiling, in one run.

For each model of the preset: (a) the ceiling, ``train.py --synthetic`` (random batches
already on the device); (b) end to end, ``train.py --data SHARDS`` with CPU and/or GPU
decoding, same model, batch, image size and compile mode. The GPU presets train on epochs
as long as ImageNet's (``--epoch-size``), whatever the generated data's size. Prints img/s in
the steady state (past the warm-up, without the windows that start an epoch: records.py), the
fraction of step time spent waiting for data, (b)/(a), the seconds an epoch's first window took
beyond the steady rate (the loader restarting: paid once an epoch, so weigh it by the epoch's
length), the share of the host's cores busy, and how busy rank 0's feed threads were (host:
getting batches from the workers; decode; crop: the fraction of the time each was working, so
the one near 1 is the limit). Under each row, every rank's step-time median and p90, data wait,
feed threads and GPU (SM clock, temperature, throttle reasons); a row whose GPUs were slowed by
heat or power is marked INVALID. On CUDA also per-stage rates (nvJPEG decode, crop+resize, H2D
copy, PIL decode per core).

Without --data it generates shards first: for the GPU presets ImageNet-like ones (1,000
classes, 500×375 JPEGs of ~110 KB), for the CPU preset a small demo-like set. With
--ais-targets N it also converts them into an AIStore playground on this host (N targets on
loopback, tools/ais_local.py; the conversion timed against one into a local directory) and adds
an end-to-end row per GPU count that reads them through ``ais://``.

Where NVIDIA DALI is importable (``pip install nvidia-dali-cuda130``), each GPU count also gets
DALI's rows, the reference to beat: ``bench/dali_train.py`` (DALI's webdataset reader and
mixed decoder with the hardware JPEG decoder feeding the same model, batch, image size and
compile mode in a plain loop) on the same shards, and on one random batch (its own ceiling); its
ratio is to that ceiling.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from records import HostCpu, describe_ranks, epoch_starts, invalid_because, rank_figures, steady_windows
from servers import aistore

from imagenet_ais.loader import dali_decode
from imagenet_ais.loader.augment import NO_AUGMENT, POLICIES, Augment
from imagenet_ais.loader.device_decode import crop_decoded, decode_encoded, decode_on_device
from imagenet_ais.loader.engine import Feeding, TrainLoader
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.transforms import decode_on_cpu, encode_for_device
from imagenet_ais.loader.wire import encode_batch, pin_encoded
from imagenet_ais.loader.worker import LoaderSpec
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.storage import open_store

ROOT = Path(__file__).resolve().parent.parent
DECODES = ("cpu", "gpu")
IMAGENET_TRAIN = 1_281_167  # ILSVRC2012's training images: the epoch users run


@dataclass(frozen=True)
class Model:
    arch: str
    batch: int
    size: int
    compile: str | None  # torch.compile mode, None = eager
    decodes: tuple[str, ...]  # end-to-end variants to run besides the ceiling
    steps: int  # per measurement (the first windows are dropped as warm-up)
    e2e_steps: int
    epoch_size: int | None = None  # train.py --epoch-size: long epochs whatever the data set's size


@dataclass(frozen=True)
class Preset:
    classes: int
    per_class: int
    picture: tuple[int, int] | None  # fixed (width, height), None = the demo's random sizes
    quality: int | None
    models: tuple[Model, ...]


PRESETS = {
    # the development machine: 2 cores, no GPU
    "cpu": Preset(10, 200, None, None, (Model("resnet18", 32, 64, None, ("cpu",), 60, 60),)),
    # a GPU machine in two minutes: do both decode paths run?
    "gpu-smoke": Preset(
        100,
        20,
        (500, 375),
        95,
        (Model("resnet50", 256, 224, None, ("gpu", "cpu"), 40, 60),),
    ),
    # one GPU host, 1 to N GPUs (--gpus 1,2,4): ResNet-50 as train.py trains by default there, on
    # epochs as long as ImageNet's (1,251 steps at 4 × 256): short epochs hide the steady state
    # (40,000 images made 39-step epochs at 4 GPUs and read 0.90 where long ones gave 0.76-0.79).
    # 1,100 steps: 1,050 timed after the warm-up, the 1,000 a figure needs (750 were screens only).
    "multi-gpu": Preset(
        1000,
        100,
        (500, 375),
        95,
        (Model("resnet50", 256, 224, "reduce-overhead", ("auto",), 400, 1100, IMAGENET_TRAIN),),
    ),
    # ResNet-18 at 1 GPU, the same shards as multi-gpu (to share a --work directory)
    "resnet18": Preset(
        1000,
        100,
        (500, 375),
        95,
        (Model("resnet18", 512, 224, "reduce-overhead", ("auto",), 400, 1100, IMAGENET_TRAIN),),
    ),
    # one H100/H200 with 16 cores, in one device call (about 9 minutes)
    "gpu": Preset(
        1000,
        40,
        (500, 375),
        95,
        (
            Model("resnet50", 256, 224, "reduce-overhead", ("gpu", "cpu"), 200, 400),
            Model("resnet18", 512, 224, None, ("gpu", "cpu"), 200, 250),
        ),
    ),
}


def make_shards(work: Path, preset: Preset, workers: int) -> str:
    tree, data = work / "tree", work / "shards"
    if (data / "manifest.json").exists():
        return str(data)
    synth = ["synth", str(tree), "--classes", str(preset.classes), "--train-per-class", str(preset.per_class)]
    synth += ["--val-per-class", "0", "--workers", str(workers)]
    if preset.picture:
        synth += ["--size", *map(str, preset.picture), "--quality", str(preset.quality)]
    convert = ["convert", str(tree), str(data), "--splits", "train", "--workers", str(workers)]
    for cmd in (synth, convert):
        click.echo(f"  {cmd[0]}: {shards_cli(cmd):.0f}s", err=True)
    return str(data)


def shards_cli(args: list[str]) -> float:
    """Runs imagenet_shards.py; its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "imagenet_shards.py"), *args], check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def to_ais(tree: Path, work: Path, workers: int) -> str:
    """Converts the tree into AIStore (AIS_ENDPOINT) and, for the ceiling, into a fresh local
    directory with the same workers; prints both times. The AIS location."""
    common = ["--splits", "train", "--workers", str(workers)]
    shutil.rmtree(work / "convert-local", ignore_errors=True)
    local = shards_cli(["convert", str(tree), str(work / "convert-local"), *common])
    ais = shards_cli(["convert", str(tree), "ais://bench-shards", *common])
    click.echo(f"convert {tree}: local directory {local:.1f}s, AIStore {ais:.1f}s (ratio {local / ais:.2f})")
    shutil.rmtree(work / "convert-local")
    return "ais://bench-shards"


def train(args: list[str], batch: int, output: Path, log: Path, gpus: int = 1) -> dict[str, Any]:
    """One train.py run (under torchrun for several GPUs): its steady rate (global img/s), each
    rank's figures and GPU, and the host's CPU use meanwhile."""
    shutil.rmtree(output, ignore_errors=True)  # a fresh run, not a resumed one
    launch = [sys.executable]
    if gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
    with log.open("a") as out, HostCpu() as cpu:
        out.write(f"\n$ {gpus} × train.py {' '.join(args)}\n")
        out.flush()
        subprocess.run(
            [*launch, str(ROOT / "train.py"), *args, "--output", str(output)],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    batch *= gpus  # records count global batches
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    windows = steady_windows(records)
    seconds = [n * batch / r["img_per_s"] for n, r in windows]
    rate = sum(n for n, _ in windows) * batch / sum(seconds)
    starts = epoch_starts(records, rate, batch)

    def mean(field: str) -> float:
        return sum(r.get(field, 0.0) * s for (_, r), s in zip(windows, seconds, strict=True)) / sum(seconds)

    busy = sorted({k for _, r in windows for k in r if k.startswith("busy_")})
    ranks = rank_figures(windows)
    later = sum(n for n, _ in windows[1:]) * batch  # images after the first window, when "cropped" was read
    cropped = windows[-1][1].get("cropped", 0) - windows[0][1].get("cropped", 0)
    return {
        "img_per_s": rate,
        "data_wait": mean("data_wait"),
        "seconds": sum(seconds),
        "epoch_start": sum(starts) / len(starts) if starts else 0.0,
        "host_cpu": cpu.busy(windows[0][1]["time"] - seconds[0], windows[-1][1]["time"]),
        **{k: mean(k) for k in busy},  # rank 0's feed threads, fraction of the time working
        "cropped": cropped / later if later else 0.0,  # share of the images cropped in the workers (cpu_share.py)
        "ranks": ranks,
        "invalid": invalid_because(ranks),
    }


def measure(
    model: Model,
    data: str,
    workers: str,
    work: Path,
    log: Path,
    gpus: int = 1,
    ais: str | None = None,
    extra: dict[str, list[str]] | None = None,
    dali_loop: bool = True,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ceiling, then each end-to-end variant (and the first one reading from ``ais``, and
    the first one again with each of the ``extra`` train.py options), then DALI's own loop where
    DALI is installed and ``dali_loop``, as each is measured."""
    common = ["--arch", model.arch, "--batch-size", str(model.batch), "--image-size", str(model.size)]
    common += ["--epochs", "1000", "--log-every", "10", "--keep-last", "1"]
    common += ["--compile", "--compile-mode", model.compile] if model.compile else ["--no-compile"]
    common += ["--epoch-size", str(model.epoch_size)] if model.epoch_size else []
    ceiling = [*common, "--synthetic", "--max-steps", str(model.steps)]
    yield "ceiling", train(ceiling, model.batch, work / "ceiling", log, gpus)
    variants = [(f"{decode} decode", data, decode, []) for decode in model.decodes]
    variants += [("ais://", ais, model.decodes[0], [])] if ais else []
    variants += [(name, data, model.decodes[0], options) for name, options in (extra or {}).items()]
    for variant, location, decode, options in variants:
        e2e = [*common, "--data", location, "--workers", workers, "--decode", decode, *options]
        e2e += ["--max-steps", str(model.e2e_steps)]
        yield variant, train(e2e, model.batch, work / variant.split()[0].strip(":/"), log, gpus)
    if dali_loop and torch.cuda.is_available() and dali_decode.available():
        yield "DALI ceiling", dali(model, data, log, gpus, synthetic=True)
        yield "DALI", dali(model, data, log, gpus, synthetic=False)


def dali(model: Model, data: str, log: Path, gpus: int, synthetic: bool) -> dict[str, float]:
    """One bench/dali_train.py run (under torchrun for several GPUs); its steady global img/s."""
    launch = [sys.executable]
    if gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
    args = ["--data", data, "--arch", model.arch, "--batch-size", str(model.batch), "--image-size", str(model.size)]
    args += ["--steps", str(model.e2e_steps), "--warmup", str(model.e2e_steps // 3), "--log-every", "10"]
    args += (["--synthetic"] if synthetic else []) + ([] if model.compile else ["--no-compile"])
    with log.open("a") as out:
        out.write(f"\n$ {gpus} × dali_train.py {' '.join(args)}\n")
        out.flush()
        run = subprocess.run(
            [*launch, str(ROOT / "bench" / "dali_train.py"), *args], check=True, stdout=subprocess.PIPE, stderr=out
        )
    r = json.loads(run.stdout.decode().strip().splitlines()[-1])
    seconds = len(r["windows"]) * 10 * model.batch * gpus / r["img_per_s"]
    return {"img_per_s": r["img_per_s"], "data_wait": r["data_wait"], "seconds": seconds, "epoch_start": 0.0}


def stage_rates(data: str, batch: int, size: int, workers: int) -> dict[str, float]:
    """Per-stage rates for one training batch of the shards on this machine's GPU, in img/s."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from webdataset.tariterators import group_by_keys, tar_file_expander

    shard = sorted(Path(data).glob("*.tar"))[0]
    with shard.open("rb") as stream:
        samples = group_by_keys(tar_file_expander([{"url": str(shard), "stream": stream}]))
        jpegs = [s["jpg"] for _, s in zip(range(batch), samples, strict=False)]
    device = torch.device("cuda")
    crops = [encode_for_device(raw, random.Random(i)) for i, raw in enumerate(jpegs)]
    encoded = pin_encoded(encode_batch(crops))
    augments = [Augment(policy) for policy in POLICIES] + [Augment(erase=0.1)]
    decoded = {  # the same batch, each with plans for one augmentation
        a: decode_encoded(encode_batch(crops, [a.draw(random.Random(i), size) for i in range(len(crops))]), device)
        for a in [NO_AUGMENT, *augments]
    }
    jpeg_list = list(encoded.blob.split(encoded.sizes))
    pixels = torch.empty(len(jpegs), size, size, 3, dtype=torch.uint8, pin_memory=True)

    def rate(fn: object, repeat: int = 10) -> float:
        fn()  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return repeat * len(jpegs) / (time.perf_counter() - start)

    start = time.perf_counter()
    for raw in jpegs[:64]:
        decode_on_cpu(raw, size, random.Random(0))
    pil = 64 / (time.perf_counter() - start)
    return {
        "nvJPEG decode": rate(lambda: decode_jpeg(jpeg_list, mode=ImageReadMode.RGB, device=device)),
        "nvJPEG decode + crop/resize/flip/normalise": rate(lambda: decode_on_device(encoded, size, device, True)),
        **{
            f"crop/resize/flip/normalise, augment: {a}": rate(
                lambda a=a: crop_decoded(decoded[a], size, device, True, a)
            )
            for a in decoded
        },
        "H2D copy of decoded uint8 (pinned)": rate(lambda: pixels.to(device, non_blocking=True)),
        "PIL decode + crop/resize/flip, 1 core": pil,
        **{
            f"loader alone, {d} decode, {where}": loader_rate(data, d, workers, batch, size, where == "on GPU")
            for d in DECODES
            for where in ("host batches", "on GPU")
        },
    }


def loader_rate(data: str, decode: str, workers: int, batch: int, size: int, on_device: bool) -> float:
    """Images per second from the training loader alone, no training: host batches (workers +
    batching), or batches ready on the device (+ the feed's copy or GPU decode)."""
    shards = one_source(load_manifest(open_store(data)).split("train"), data)
    spec = LoaderSpec(world=1, rank=0, batch=batch, seed=0, image_size=size, decode=decode)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # pinned batches, as in training
    feeding = Feeding(workers, device, channels_last=True)
    loader = TrainLoader(shards, "resampled", spec, feeding, 2000, epoch_size=70 * batch)  # (resampled: any shards)
    loader.set_epoch(0)
    stream = iter(loader) if on_device else loader.host_batches()
    for _ in range(10):  # workers start, buffer fills
        next(stream)
    _sync()
    start = time.perf_counter()
    batches = min(60, len(loader) - 10)  # within one epoch
    for _ in range(batches):
        next(stream)
    _sync()
    elapsed = time.perf_counter() - start
    stream.close()  # stops the feed threads
    return batches * batch / elapsed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_variants(values: tuple[str, ...]) -> dict[str, list[str]]:
    """``NAME=OPTIONS`` → {NAME: the train.py options}."""
    out = {}
    for value in values:
        name, eq, options = value.partition("=")
        if not eq or not name.strip():
            raise click.BadParameter(f"{value!r}: give NAME=OPTIONS, e.g. 'augmented=--auto-augment ta_wide'")
        out[name.strip()] = shlex.split(options)
    return out


@click.command()
@click.option("--preset", default="cpu", type=click.Choice(list(PRESETS)), show_default=True)
@click.option("--data", help="shard location (default: generate shards for the preset)")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), help="keep shards and runs here")
@click.option("--workers", default="auto", show_default=True, help="DataLoader workers per process (train.py's)")
@click.option("--gpus", default="1", show_default=True, help="GPU counts to run each model on, e.g. 1,2,4 (torchrun)")
@click.option("--ais-targets", default=0, show_default=True, help="add the ais:// rows (needs ./run ais-install)")
@click.option(
    "--variant",
    "variants",
    multiple=True,
    metavar="NAME=OPTIONS",
    help="add an end-to-end row with these train.py options, e.g. 'augmented=--auto-augment ta_wide' (repeatable)",
)
@click.option(
    "--dali-loop/--no-dali-loop",
    default=True,
    help="where DALI is installed, also DALI's own pipeline and loop (bench/dali_train.py)",
)
@click.option("--image-size", type=click.IntRange(16, 2048), help="train at this size, not the preset's (both rows)")
@click.option("--breakdown/--no-breakdown", default=True, help="per-stage rates on the GPU, after the runs")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), help="also write the numbers here")
def main(
    preset: str,
    data: str | None,
    work: Path | None,
    workers: str,
    gpus: str,
    ais_targets: int,
    variants: tuple[str, ...],
    dali_loop: bool,
    image_size: int | None,
    breakdown: bool,
    json_out: Path | None,
) -> None:
    """Prints a row per run as it is measured, each rank's step times, data wait and GPU (SM clock,
    temperature, throttle reasons) under it, and marks a row INVALID where a GPU was slowed by heat
    or power: such a figure is not the cards'."""
    p = PRESETS[preset]
    if image_size:  # e.g. the fast recipe's 160 and 192 px, against a ceiling at the same size
        p = dataclasses.replace(p, models=tuple(dataclasses.replace(m, size=image_size) for m in p.models))
    counts = [int(n) for n in gpus.split(",")]
    extra = parse_variants(variants)
    stage_workers = int(workers) if workers.isdigit() else min(16, os.cpu_count() or 1)
    if data and ais_targets:
        raise click.UsageError("--ais-targets converts the shards it generates: leave out --data")
    with (
        tempfile.TemporaryDirectory() as tmp,
        aistore(Path(tmp) / "ais", ais_targets) if ais_targets else nullcontext() as playground,
    ):
        root = work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = data or make_shards(root, p, os.cpu_count() or 1)
        ais = None
        if playground:
            os.environ["AIS_ENDPOINT"] = playground.endpoint  # for the converter and train.py
            ais = to_ais(root / "tree", root, stage_workers)
        log = root / "train-runs.log"
        results: dict[str, Any] = {"preset": preset, "device": _device(), "workers": workers, "models": []}
        # rows are printed as they are measured: a run cut short still reports what it got
        click.echo(f"{results['device']} × {max(counts)}, {os.cpu_count()} cores, workers {workers}")
        click.echo(
            f"{'model':34} {'gpus':>4} {'variant':12} {'img/s':>8} {'data wait':>10} {'ratio':>6} "
            f"{'scaling':>8} {'secs':>5} {'epoch start':>11} {'host cpu':>8}"
        )
        single: dict[str, float] = {}  # variant → its 1-GPU rate, for the scaling column
        for model in p.models:
            name = f"{model.arch} bs{model.batch} {model.size}px {model.compile or 'eager'}"
            for n in counts:
                ceilings: dict[bool, dict] = {}  # ours, DALI's: each loader's ratio is to its own loop's
                runs = measure(model, data, workers, root / f"{model.arch}-{n}", log, n, ais, extra, dali_loop)
                for variant, r in runs:
                    ceiling = ceilings.setdefault(variant.startswith("DALI"), r)
                    ratio = r["img_per_s"] / ceiling["img_per_s"]
                    if n == 1:
                        single[f"{name} {variant}"] = r["img_per_s"]
                    one = single.get(f"{name} {variant}")
                    scaling = r["img_per_s"] / (n * one) if one else float("nan")
                    click.echo(row_line(f"{name:34} {n:4} {variant:12}", r, ceiling, ratio, scaling))
                    if r.get("ranks"):
                        click.echo(describe_ranks(r["ranks"]))
                    results["models"].append(
                        {"model": name, "gpus": n, "variant": variant, **r, "ratio": ratio, "scaling": scaling}
                    )
                    if json_out:
                        json_out.write_text(json.dumps(results, indent=2))
        if breakdown and torch.cuda.is_available():
            stages = stage_rates(data, 256, 224, stage_workers)
            results["breakdown"] = stages
            click.echo("\nper stage, batch 256 → 224 px (img/s):")
            for k, v in stages.items():
                click.echo(f"  {k:50} {v:10.0f}")
        if json_out:
            json_out.write_text(json.dumps(results, indent=2))


def row_line(what: str, r: dict[str, Any], ceiling: dict[str, Any], ratio: float, scaling: float) -> str:
    """A measured row of the table: ``what`` (model, GPUs, variant), then the run's figures."""
    busy = "  ".join(f"{k[5:]} {v:.2f}" for k, v in r.items() if k.startswith("busy_"))
    invalid = r.get("invalid") or (ceiling.get("invalid") and f"its ceiling: {ceiling['invalid']}")
    return (
        f"{what} {r['img_per_s']:8.1f} {r['data_wait']:10.3f} {ratio:6.3f} "
        f"{scaling:8.3f} {r['seconds']:5.0f} {r['epoch_start']:+10.2f}s {r.get('host_cpu', 0):8.2f}"
        + (f"  busy: {busy}" if busy else "")
        + (f"  cropped in workers {r['cropped']:.2f}" if r.get("cropped") else "")
        + (f"  INVALID ({invalid})" if invalid else "")
    )


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
