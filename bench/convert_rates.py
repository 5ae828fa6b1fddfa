#!/usr/bin/env python3
"""``imagenet_shards.py convert`` into AIStore against into a local directory, in one run.

Generates an ImageNet-like tree (500×375 JPEGs, ~110 KB), then converts it twice with the same
workers: into a local directory (the ceiling) and into an AIStore playground on loopback
(tools/ais_local.py), where every shard is uploaded and verified by the target's checksum, and
again with ``--read-back`` (every shard also downloaded and SHA-256 compared). Prints seconds
and the ratio.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from servers import aistore

ROOT = Path(__file__).resolve().parent.parent


def convert(tree: Path, dest: str, workers: int, env: dict[str, str], *extra: str) -> float:
    # Each conversion starts with nothing left to write back (the generated tree, the previous
    # conversion): in run AA, AIS uploads stalled for seconds at a time behind such writes.
    os.sync()
    start = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "imagenet_shards.py"), "convert", str(tree), dest, "--splits", "train"]
    subprocess.run([*cmd, "--workers", str(workers), *extra], check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


@click.command()
@click.option("--images", default=4000, show_default=True, help="in 100 classes")
@click.option("--workers", default=2, show_default=True)
@click.option("--targets", default=1, show_default=True, help="AIStore targets")
def main(images: int, workers: int, targets: int) -> None:
    with tempfile.TemporaryDirectory(prefix="convert-rates-") as tmp:
        work, tree = Path(tmp), Path(tmp) / "tree"
        synth = [sys.executable, str(ROOT / "imagenet_shards.py"), "synth", str(tree), "--classes", "100"]
        synth += ["--train-per-class", str(images // 100), "--val-per-class", "0", "--size", "500", "375"]
        subprocess.run([*synth, "--quality", "95", "--workers", str(workers)], check=True, stdout=subprocess.DEVNULL)
        with aistore(work / "ais", targets) as playground:
            env = {**os.environ, "AIS_ENDPOINT": playground.endpoint}
            local = convert(tree, str(work / "shards"), workers, env)
            ais = convert(tree, "ais://bench-convert", workers, env)
            read_back = convert(tree, "ais://bench-convert-read-back", workers, env, "--read-back")
    click.echo(f"{images} images, {workers} workers, {os.cpu_count()} cores, AIS targets {targets}")
    click.echo(f"| into a local directory: the ceiling | {local:.1f} s | 1 |")
    click.echo(f"| into AIStore (uploaded, verified) | {ais:.1f} s | {local / ais:.2f} |")
    click.echo(f"| into AIStore with --read-back | {read_back:.1f} s | {local / read_back:.2f} |")


if __name__ == "__main__":
    main()
