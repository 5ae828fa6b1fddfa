#!/usr/bin/env python3
"""NVIDIA DALI feeding a torchvision ResNet: the reference row our loader has to beat.

What users would run instead of our loader, on the same shards and GPUs as ``train.py``: DALI's
own pipeline as its ResNet-50 example and MLPerf build it (``fn.readers.webdataset`` over the
manifest's train shards, one DALI shard per rank; nvJPEG random-resized-crop decode on the
GPU with part of the batch on the hardware JPEG decoder, ``--hw-load``; resize to
``--image-size``; flip and normalise to FP16 NHWC, which PyTorch sees as a channels_last NCHW
batch without a copy), ``DALIGenericIterator`` into a plain PyTorch loop with train.py's fast
path (channels_last, bf16 autocast, fused SGD with Nesterov momentum 0.9, label smoothing 0.1,
DDP with gradients as bucket views, ``torch.compile`` with CUDA graphs).

It measures steady-state img/s over all ranks: ``--steps`` steps, the first ``--warmup``
(compilation included) not counted, the rest timed in windows of ``--log-every`` steps that
end in ``torch.cuda.synchronize()`` (a window is as slow as its slowest rank), and the data
wait: the fraction of that time spent in ``next(iterator)``. ``--synthetic`` runs the same loop
on one random batch already on the GPU (the loop's ceiling, so DALI's ratio to it is the
comparable number); ``--loader-only`` iterates the pipeline without a model (DALI's own rate).
Rank 0 prints one JSON line, e.g. ``{"loader": "dali", "synthetic": false, "img_per_s": ...}``.

The shard index files are not needed: DALI infers each tar's index when the pipeline starts (a
scan of the tar headers; ``wds2idx`` from the DALI wheel could write them ahead instead).

Run (DALI: ``pip install nvidia-dali-cuda130``; SHARDS holds manifest.json and the
imagenet-train-*.tar shards)::

    python3 bench/dali_train.py --data SHARDS                                    # 1 GPU
    torchrun --nproc-per-node 2 bench/dali_train.py --data SHARDS
    torchrun --nproc-per-node 4 bench/dali_train.py --data SHARDS
    torchrun --nproc-per-node 4 bench/dali_train.py --data SHARDS --synthetic    # the ceiling
    torchrun --nproc-per-node 4 bench/dali_train.py --data SHARDS --loader-only  # DALI alone
    python3 bench/dali_train.py --data SHARDS --arch resnet18 --hw-load 0.9 --threads 8

A hidden ``--device cpu`` runs the whole thing on the CPU (CPU decoder, float32, eager; gloo
under torchrun) to test it without a GPU, and the hidden ``--check`` compares every batch's
labels with the raw ``.cls`` bytes and prints the first batch's layout and value range.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NoReturn

import click
import torch
import torch.distributed as dist
import torchvision
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SYNTHETIC_CLASSES = 1000  # --synthetic without --data, as train.py
LABEL_DIGITS = 9  # longest class index parsed from .cls: 9 decimal digits fit int64 with room


def fail(message: str) -> NoReturn:
    raise SystemExit(f"dali_train.py: error: {message}")


def import_dali() -> ModuleType:
    try:
        import nvidia.dali
    except ImportError as e:
        fail(f"NVIDIA DALI is not importable ({e}): pip install nvidia-dali-cuda130")
    return nvidia.dali


def optional_dali() -> ModuleType | None:
    """DALI if installed (--synthetic runs without it, the version is only reported)."""
    try:
        import nvidia.dali
    except ImportError:
        return None
    return nvidia.dali


def read_train_split(data: Path) -> tuple[list[str], int, int]:
    """The train shards' paths, their sample count and the number of classes (from manifest.json,
    parsed here as JSON since the project's reader is being refactored)."""
    manifest = data / "manifest.json"
    if not manifest.is_file():
        fail(f"no shards found: {manifest} does not exist (make shards with `imagenet_shards.py convert`)")
    try:
        doc = json.loads(manifest.read_text())
        shards = doc["splits"]["train"]["shards"]
        classes = len(doc["classes"])
        paths = [str(data / s["name"]) for s in shards]
        samples = sum(int(s["samples"]) for s in shards)
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{manifest}: no readable train split ({type(e).__name__}: {e})")
    if not paths:
        fail(f"no shards found: {manifest} lists no train shards")
    if missing := [p for p in paths if not os.path.isfile(p)]:
        fail(f"no shards found: {len(missing)} of the {len(paths)} train shards are missing, e.g. {missing[0]}")
    return paths, samples, classes


def build_pipeline(args: SimpleNamespace, shards: list[str], rank: int, world: int, device_id: int | None) -> Any:
    """One rank's DALI pipeline: outputs "data" (batch of HWC images) and "label" (int64), plus
    "raw" (the .cls bytes, zero-padded to the batch's longest) with --check."""
    import_dali()
    from nvidia.dali import fn, pipeline_def, types

    cpu = device_id is None

    @pipeline_def(
        batch_size=args.batch_size,
        num_threads=args.threads,
        device_id=device_id,  # None: a CPU-only pipeline
        seed=1234 + rank,  # each rank its own crops and flips
        prefetch_queue_depth=args.prefetch,
    )
    def pipeline() -> tuple[Any, ...]:
        jpegs, cls = fn.readers.webdataset(
            paths=shards,
            ext=["jpg", "cls"],
            missing_component_behavior="error",
            shard_id=rank,
            num_shards=world,
            # the converter already shuffled samples across shards; the buffer mixes within them
            random_shuffle=True,
            initial_fill=args.initial_fill,
            # every rank the same number of batches per epoch (DDP must not wait on a missing one)
            pad_last_batch=True,
            # each epoch a rank reads the next shard of the split, as DALI's ResNet example does
            stick_to_shard=False,
            name="Reader",
        )
        # the mixed decoder: the hardware JPEG engine for --hw-load of the batch, nvJPEG's CUDA
        # path for the rest; the buffer sizes of DALI's ResNet-50 example, so that ImageNet's
        # largest pictures cause no reallocation mid-run
        gpu_options = {
            "hw_decoder_load": args.hw_load,
            "device_memory_padding": 211025920,
            "host_memory_padding": 140544512,
            "preallocate_width_hint": 5980,
            "preallocate_height_hint": 6430,
        }
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu" if cpu else "mixed",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=100,
            **({} if cpu else gpu_options),
        )
        size = args.image_size
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_TRIANGULAR)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT if cpu else types.FLOAT16,
            output_layout="HWC",  # an NHWC batch: channels_last NCHW after a permute, no copy
            mean=[m * 255 for m in IMAGENET_MEAN],
            std=[s * 255 for s in IMAGENET_STD],
            mirror=fn.random.coin_flip(probability=0.5),
        )
        label = parse_label(cls, fn, types)
        outputs = (images, label if cpu else label.gpu())
        return (*outputs, fn.pad(cls, fill_value=0)) if args.check else outputs

    return pipeline()


def parse_label(cls: Any, fn: Any, types: Any) -> Any:
    """The ASCII decimal in a .cls member (uint8 bytes, e.g. b"42") as an int64 scalar, with DALI's
    own CPU operators (no Python callback, so the pipeline stays asynchronous): the digits are
    right-aligned in a window of LABEL_DIGITS bytes, '0'-padded in front, then weighted by powers
    of ten and summed."""
    length = cls.shape(dtype=types.INT32)  # [n]
    window = fn.slice(
        cls,
        start=length - LABEL_DIGITS,  # negative: the window starts before the first digit
        shape=[LABEL_DIGITS],
        axes=[0],
        out_of_bounds_policy="pad",
        fill_values=ord("0"),
    )
    digits = fn.cast(window, dtype=types.INT64) - ord("0")
    powers = fn.constant(idata=[10**i for i in reversed(range(LABEL_DIGITS))], shape=[LABEL_DIGITS], dtype=types.INT64)
    return fn.reductions.sum(digits * powers, axes=[0], dtype=types.INT64)


class DaliBatches:
    """(images NCHW channels_last, labels) from the DALI iterator, epoch after epoch."""

    def __init__(self, pipeline: Any, check: bool):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        names = ["data", "label", "raw"] if check else ["data", "label"]
        # DROP with the reader's pad_last_batch: a fixed number of full batches per epoch, the
        # same on every rank; auto_reset starts the next epoch after the StopIteration
        self.iterator = DALIGenericIterator(
            [pipeline], names, reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
        )
        self.check = check
        self.checked = 0

    def __len__(self) -> int:
        return len(self.iterator)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out = next(self.iterator)[0]
        except StopIteration:  # an epoch's end; auto_reset has started the next
            out = next(self.iterator)[0]
        x = out["data"].permute(0, 3, 1, 2)
        y = out["label"].view(-1)
        if self.check:
            self.verify(x, y, out["raw"])
        return x, y

    def verify(self, x: torch.Tensor, y: torch.Tensor, raw: torch.Tensor) -> None:
        want = [int(bytes(row).rstrip(b"\0")) for row in raw.cpu().tolist()]
        got = y.cpu().tolist()
        if got != want:
            fail(f"--check: labels {got[:8]}... != .cls values {want[:8]}...")
        if not self.checked:
            print(
                f"--check: x {tuple(x.shape)} {x.dtype} {x.device} channels_last="
                f"{x.is_contiguous(memory_format=torch.channels_last)} range [{x.min():.3f}, {x.max():.3f}] "
                f"channel means {[round(float(m), 3) for m in x.float().mean(dim=(0, 2, 3))]}; "
                f"y {tuple(y.shape)} {y.dtype} {y.device}, first {got[:8]}",
                file=sys.stderr,
            )
        self.checked += len(got)


class SyntheticBatches:
    """One random batch already on the device, in the dtype and layout DALI delivers."""

    def __init__(self, batch: int, size: int, classes: int, device: torch.device, dtype: torch.dtype):
        self.x = torch.randn(batch, size, size, 3, device=device, dtype=dtype).permute(0, 3, 1, 2)
        self.y = torch.randint(0, classes, (batch,), device=device)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def setup_distributed(cuda: bool) -> tuple[int, int, torch.device]:
    """(rank, world, device); a process group when started by torchrun with several processes."""
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world, device


def build_step(
    args: SimpleNamespace, classes: int, world: int, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """train.py's fast path (imagenet_ais/train/loop.py, mirrored rather than imported)."""
    cuda = device.type == "cuda"
    # channels_last as the batches (on the CPU too: DDP's buckets then match the gradients' strides)
    raw_model = torchvision.models.get_model(args.arch, weights=None, num_classes=classes)
    raw_model = raw_model.to(device, memory_format=torch.channels_last)
    params = [p for p in raw_model.parameters() if p.requires_grad]
    groups = [  # as train.py: no weight decay on 1-d parameters (BatchNorm, biases)
        {"params": [p for p in params if p.ndim > 1], "weight_decay": 1e-4},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    # train.py's lr 0.1 per 256 images, held constant here (its schedule is no cost to time)
    lr = 0.1 * args.batch_size * world / 256
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, fused=cuda)
    model: nn.Module = raw_model
    if world > 1:
        # gradients as views into DDP's buckets: no copy into and out of them each step
        model = nn.parallel.DistributedDataParallel(
            raw_model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True
        )
    if args.compile and cuda:
        # as train.py: DDP compiled as one graph (not split at its buckets), static shapes, and
        # CUDA graphs (reduce-overhead) so the step does not wait on Python launching kernels
        torch._dynamo.config.optimize_ddp = False
        model = torch.compile(model, mode="reduce-overhead", dynamic=False)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    model.train()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with autocast():
            loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def measure(
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    step: Callable[[torch.Tensor, torch.Tensor], None] | None,
    args: SimpleNamespace,
    sync: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Seconds and seconds waited in next(batches), per steady window of --log-every steps."""
    seconds: list[float] = []
    waits: list[float] = []
    waited = 0.0
    start = time.perf_counter()
    for i in range(args.steps):
        if i == args.warmup:
            sync()  # the warm-up's queued work is not the window's
            start, waited = time.perf_counter(), 0.0
        t0 = time.perf_counter()
        x, y = batches()
        waited += time.perf_counter() - t0
        if step:
            step(x, y)
        done = i + 1 - args.warmup
        if done > 0 and done % args.log_every == 0:
            sync()
            now = time.perf_counter()
            seconds.append(now - start)
            waits.append(waited)
            start, waited = now, 0.0
    return seconds, waits


@click.command(help=__doc__.split("\n\n")[0], context_settings={"show_default": True})
@click.option(
    "--data", type=click.Path(path_type=Path), help="directory with manifest.json and the imagenet-train-*.tar shards"
)
@click.option("--arch", default="resnet50", help="torchvision model (resnet50, resnet18, ...)")
@click.option("--batch-size", default=256, help="per GPU")
@click.option("--image-size", default=224)
@click.option("--threads", default=6, help="DALI CPU threads per pipeline (per GPU)")
@click.option("--prefetch", default=2, help="DALI prefetch queue depth (batches)")
@click.option("--initial-fill", default=4096, help="the reader's shuffle buffer (samples)")
@click.option("--hw-load", default=0.65, help="share of JPEGs for the hardware decoder (A100/H100)")
@click.option("--steps", default=300, help="total steps, warm-up included")
@click.option("--warmup", default=60, help="steps not timed (compilation included)")
@click.option("--log-every", default=20, help="steps per timed window")
@click.option("--synthetic", is_flag=True, help="one random batch already on the GPU: the ceiling")
@click.option("--loader-only", is_flag=True, help="iterate the DALI pipeline without a model")
@click.option("--compile/--no-compile", default=True, help="torch.compile the model")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", hidden=True)  # testing
@click.option("--check", is_flag=True, hidden=True)  # testing: labels against .cls
def main(**options: Any) -> None:
    args = SimpleNamespace(**options)
    if args.synthetic and args.loader_only:
        raise click.UsageError("--synthetic and --loader-only exclude each other")
    if args.data is None and not args.synthetic:
        raise click.UsageError("--data is required (except with --synthetic)")
    if args.steps - args.warmup < args.log_every or min(args.warmup, args.log_every - 1) < 0:
        raise click.UsageError("--steps must leave at least one --log-every window after --warmup")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        fail("no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False)")
    dali = optional_dali() if args.synthetic else import_dali()
    shards, samples, classes = read_train_split(args.data) if args.data else ([], 0, SYNTHETIC_CLASSES)
    rank, world, device = setup_distributed(cuda)
    try:
        if args.synthetic:
            batches: Callable[[], tuple[torch.Tensor, torch.Tensor]] = SyntheticBatches(
                args.batch_size, args.image_size, classes, device, torch.float16 if cuda else torch.float32
            )
        else:
            pipeline = build_pipeline(args, shards, rank, world, device.index if cuda else None)
            batches = DaliBatches(pipeline, args.check)
            if rank == 0:
                print(
                    f"dali {dali.__version__}: {len(shards)} shards, {samples} samples, "
                    f"{len(batches)} steps per epoch per rank",
                    file=sys.stderr,
                )
        step = None if args.loader_only else build_step(args, classes, world, device)
        sync = torch.cuda.synchronize if cuda else lambda: None
        seconds, waits = measure(batches, step, args, sync)
        # a window is as slow as its slowest rank; the wait is the ranks' mean
        stats = torch.tensor([seconds, [w / s for w, s in zip(waits, seconds, strict=True)]], device=device)
        if world > 1:
            slowest = stats[0].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            stats[0], stats[1] = slowest, stats[1] / world
        seconds, wait_share = stats[0].tolist(), stats[1].tolist()
        images = world * args.batch_size * args.log_every
        if rank == 0:
            record = {
                "loader": "dali",
                "synthetic": args.synthetic,
                "loader_only": args.loader_only,
                "arch": None if args.loader_only else args.arch,
                "gpus": world,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "batch": args.batch_size,
                "image_size": args.image_size,
                "compiled": bool(step and cuda and args.compile),
                "img_per_s": round(images * len(seconds) / sum(seconds), 1),
                "data_wait": round(sum(w * s for w, s in zip(wait_share, seconds, strict=True)) / sum(seconds), 4),
                "windows": [round(images / s, 1) for s in seconds],
                "steps": args.steps,
                "warmup": args.warmup,
                "hw_load": args.hw_load,
                "threads": args.threads,
                "prefetch": args.prefetch,
                "dali_version": dali.__version__ if dali else None,
                "torch": torch.__version__,
            }
            print(json.dumps(record), flush=True)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
