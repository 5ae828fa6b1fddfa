"""Make, index, reshard, check, describe and copy ImageNet WebDataset shards: synth, convert, index, reshard,
verify, summary, preload."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import click

from imagenet_ais.cli.one_line import one_line
from imagenet_ais.shards import cache, convert, index, labels, layouts, reshard, synth, verify
from imagenet_ais.shards.inputs import Stored
from imagenet_ais.shards.manifest import Manifest, SplitInfo, brace_pattern, load_manifest
from imagenet_ais.shards.quality import quality_line
from imagenet_ais.storage import open_store


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    raise AssertionError("unreachable")


def _shards(listed: list) -> str:
    return f"{len(listed)} shard{'' if len(listed) == 1 else 's'}"  # ("1 shards" before)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers_option(auto: Callable[[], int], what: str) -> Callable[[Callable], Callable]:
    """``--workers``: a count, or ``auto`` (the default, as train.py's), which ``auto()`` sizes."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> int:
        if value == "auto":
            return auto()
        if value.isdigit() and int(value) >= 1:
            return int(value)
        raise click.BadParameter(f"{value!r} is neither 'auto' nor a count of 1 or more")

    return click.option("--workers", default="auto", show_default=True, callback=parse, help=what)


CPU_WORKERS = workers_option(_cpus, "processes; auto: this machine's CPUs")


@click.group()
def cli() -> None:
    """ImageNet ⇄ WebDataset shards."""


@cli.command("synth")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--classes", default=10, show_default=True, type=click.IntRange(min=1), help="number of classes")
@click.option("--train-per-class", default=100, show_default=True, type=click.IntRange(min=0))
@click.option("--val-per-class", default=20, show_default=True, type=click.IntRange(min=0))
@click.option("--seed", default=0, show_default=True)
@click.option("--with-bad", is_flag=True, help="also write a truncated, an empty and a non-image file to train/")
@click.option(
    "--size",
    type=(click.IntRange(min=1), click.IntRange(min=1)),
    help="fix every picture's WIDTH HEIGHT (ImageNet-like: 500 375)",
)
@click.option("--quality", type=click.IntRange(1, 100), help="JPEG quality (ImageNet-like: 95) [default: 75-95]")
@CPU_WORKERS
def synth_cmd(
    out: Path,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    seed: int,
    with_bad: bool,
    size: tuple[int, int] | None,
    quality: int | None,
    workers: int,
) -> None:
    """Write a learnable synthetic tree in the ImageNet layout to OUT."""
    counts = synth.make_tree(out, classes, train_per_class, val_per_class, seed, with_bad, size, quality, workers)
    click.echo(f"{out}: {counts['train']} train and {counts['val']} val files in {classes} classes")


@cli.command("convert")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@click.option("--splits", default="train,val", show_default=True, help="comma-separated split folders of SRC")
@click.option("--maxcount", default=1000, show_default=True, type=click.IntRange(min=1), help="samples per shard")
@click.option("--maxsize", default=int(1e9), show_default=True, type=click.IntRange(min=1), help="bytes per shard")
@CPU_WORKERS
@click.option("--seed", default=0, show_default=True, help="seed of the cross-shard shuffle")
@click.option("--allow-empty", is_flag=True, help="convert even when a split or a class of it ends up with no samples")
@click.option(
    "--read-back",
    is_flag=True,
    help="read each uploaded shard back in full and compare its SHA-256 (by default a checksum the storage "
    "computed of what it stored is compared: AIStore's xxhash, GCS's crc32c)",
)
@click.option(
    "--max-side",
    type=click.IntRange(min=32, max=8192),
    metavar="N",
    help="store images whose longer side is over N px resized to N (the aspect kept); smaller ones keep their bytes",
)
@click.option(
    "--quality",
    default=95,
    show_default=True,
    type=click.IntRange(1, 100),
    help="JPEG quality of the images stored re-encoded (resized, or no RGB or gray JPEG)",
)
def convert_cmd(
    src: Path,
    dest: str,
    splits: str,
    maxcount: int,
    maxsize: int,
    workers: int,
    seed: int,
    allow_empty: bool,
    read_back: bool,
    max_side: int | None,
    quality: int,
) -> None:
    """Convert the ImageFolder tree SRC into shuffled shards and a manifest at DEST.

    Re-running resumes: shards already complete and verified at DEST are kept (rebuilt where
    the settings differ, --max-side and --quality among them).
    """
    with one_line():
        split_list = [s for s in splits.split(",") if s]
        stored = Stored(max_side, quality)
        manifest = convert.convert(
            src, dest, split_list, maxcount, maxsize, workers, seed, allow_empty, read_back, stored=stored
        )
    click.echo(_stored(manifest).removeprefix("; "))
    for split in manifest.splits.values():
        _echo_rejected(split)
    for name, split in manifest.splits.items():  # last, where they are seen: what each split holds, and lost
        rejected = f"{len(split.rejected)} rejected" + (" (listed above and in the manifest)" if split.rejected else "")
        click.echo(f"{name}: {split.samples} samples in {_shards(split.shards)}, {rejected}")
    _echo_quality(dest, manifest)


@cli.command("verify")
@click.argument("dest")
@CPU_WORKERS
def verify_cmd(dest: str, workers: int) -> None:
    """Re-read every shard at DEST against its manifest; exit 1 naming each bad shard."""
    with one_line():
        problems = verify.verify(dest, workers)
        stored = _stored(load_manifest(open_store(dest)))
    for name, problem in sorted(problems.items()):
        click.echo(f"BAD {dest}/{name}: {problem}", err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{dest}: all shards match the manifest and decode{stored}")


@cli.command("preload")
@click.argument("url")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--splits", help="comma-separated splits to copy [default: all in the manifest]")
@workers_option(lambda: 8, "parallel downloads; auto: 8")
def preload_cmd(url: str, dest: Path, splits: str | None, workers: int) -> None:
    """Copy the shards at URL to the local directory DEST (e.g. a node's SSD), then train with --data DEST.

    Every shard is checked against the manifest; re-running after an interruption keeps what
    is already there and intact. The manifest is written last: DEST is usable once it is there.
    """
    with one_line():
        manifest = cache.preload(url, dest, [s for s in splits.split(",") if s] if splits else None, workers)
    for name, split in manifest.splits.items():
        click.echo(f"{dest}: {name}: {_shards(split.shards)}, {split.samples} samples, {_human(split.bytes)}")


@cli.command("index")
@click.argument("location")
@click.option(
    "--manifest-to",
    metavar="LOCATION",
    help="write the manifest there (a directory or bucket) where LOCATION is read-only; train with --data LOCATION",
)
@click.option(
    "--split",
    "splits",
    multiple=True,
    metavar="NAME=PATTERN",
    help="a split's shards: a glob or brace pattern relative to LOCATION (repeatable) [default: from the shards' "
    "names, or the hub's _info.json]",
)
@click.option("--label", default="cls", show_default=True, help=f"the member holding each label: {labels.RULES}")
@click.option(
    "--classes",
    "classes_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="class names, one per line: line i names class index i [default: the names the labels are, sorted, else "
    "the indices]",
)
@workers_option(lambda: 8, "parallel shard reads; auto: 8")
def index_cmd(
    location: str, manifest_to: str | None, splits: tuple[str, ...], label: str, classes_file: Path | None, workers: int
) -> None:
    """Write a manifest for the WebDataset shards at LOCATION that another tool made, in place.

    Each shard is read once (counted, SHA-256 hashed, its samples' labels read); none is
    written, moved or deleted. Re-running after an interruption goes on where it stopped.
    """
    with one_line():
        patterns = [layouts.split_option(s) for s in splits]
        manifest = index.index(
            location,
            manifest_to=manifest_to,
            patterns=patterns,
            label=label,
            classes_file=classes_file,
            workers=workers,
        )
    data_at = manifest_to or location
    click.echo(f"{data_at}: {len(manifest.classes)} classes; {_origin(manifest)}")
    for name, split in manifest.splits.items():
        click.echo(f"{name}: {split.samples} samples in {_shards(split.shards)}, {len(split.rejected)} rejected")
        _echo_rejected(split, most=20)
    _echo_quality(manifest.shards_location(data_at), manifest)
    click.echo(f"train with --data {data_at}")


def _origin(manifest: Manifest) -> str:
    """Where a manifest came from, as summary and index say it."""
    source = manifest.source
    if source.get("made_by") == "reshard":
        return f"made by reshard from {source.get('from')}, labels from {manifest.labels}"
    if source.get("made_by") != "index":
        return "made by convert"
    where = f", shards at {manifest.shards_at}" if manifest.shards_at else ""
    return f"made by index ({source.get('layout')}), labels from {manifest.labels}{where}"


@cli.command("reshard")
@click.argument("src")
@click.argument("dst")
@click.option("--maxcount", default=1000, show_default=True, type=click.IntRange(min=1), help="samples per new shard")
@click.option("--seed", default=0, show_default=True, help="seed of the permutation")
@click.option(
    "--spool",
    type=click.Path(file_okay=False, path_type=Path),
    help="local folder for the samples between the two passes (as much free space as the shards take) "
    "[default: the system's temp folder]",
)
@CPU_WORKERS
def reshard_cmd(src: str, dst: str, maxcount: int, seed: int, spool: Path | None, workers: int) -> None:
    """Write a shuffled copy of the shards at SRC (converted or indexed) to DST.

    Samples are moved as they are, every member's name and bytes kept: nothing is decoded or
    re-encoded. Re-running after an interruption goes on where it stopped.
    """
    with one_line():
        manifest = reshard.reshard(
            src, dst, maxcount=maxcount, seed=seed, workers=workers, spool=str(spool) if spool else None
        )
    for name, split in manifest.splits.items():
        click.echo(f"{dst}: {name}: {split.samples} samples in {_shards(split.shards)}")
    _echo_quality(dst, manifest)


@cli.command("summary")
@click.argument("dest")
def summary_cmd(dest: str) -> None:
    """Print each split of DEST as a brace pattern with counts and sizes."""
    with one_line():
        manifest = load_manifest(open_store(dest))
    click.echo(f"{dest}: {len(manifest.classes)} classes{_stored(manifest)}; {_origin(manifest)}")
    for name, split in manifest.splits.items():
        pattern = brace_pattern([s.name for s in split.shards])
        click.echo(
            f"{name}: {pattern}  shards={len(split.shards)} samples={split.samples} "
            f"size={_human(split.bytes)} rejected={len(split.rejected)}"
        )
        _echo_rejected(split, most=20)
    _echo_quality(manifest.shards_location(dest), manifest)


def _stored(manifest: Manifest) -> str:
    """How the manifest says its images were stored (nothing where it does not: made by an older
    convert, or by index)."""
    side, jpeg_quality = manifest.source.get("max_side"), manifest.source.get("quality")
    if side:
        return f"; images stored at most {side} px a side, JPEG quality {jpeg_quality}"
    if jpeg_quality:
        return f"; images stored as they are, those re-encoded (no RGB or gray JPEG) at JPEG quality {jpeg_quality}"
    return ""


def _echo_rejected(split: SplitInfo, most: int | None = None) -> None:
    """The inputs convert (or the samples index) rejected from ``split``, each with its reason (the first ``most``)."""
    for r in split.rejected[:most]:
        click.echo(f"  rejected {r['path']}: {r['reason']}")
    if most is not None and len(split.rejected) > most:
        click.echo(f"  ... and {len(split.rejected) - most} more (the manifest lists them all)")


def _echo_quality(location: str, manifest: Manifest) -> None:
    """How well the train split's shards mix its classes (quality.py), where its manifest counted them."""
    if line := quality_line(location, manifest.class_counts.get("train", [])):
        click.echo(f"train: {line}")


if __name__ == "__main__":  # python -m imagenet_ais.cli.shards
    cli()
