#!/usr/bin/env python3
"""``index`` (and ``reshard``) against a plain parallel read of the same shards, in one run.

Generates shards of ~110 KB JPEGs (ImageNet's mean size; shard_reads.make_shards) with no
manifest of ours, then, with ``--workers`` readers each:

- from a local directory: the ceiling is every shard read whole in 1 MiB blocks by that many
  threads; then ``index`` (in this process, so no start-up is timed). Each starts from a cold
  page cache where this process may drop it (root on Linux), as a data set larger than memory
  would be read; else both are warm, and said so;
- with ``--ais``, from an AIStore playground on loopback (tools/ais_local.py): the ceiling is a
  plain HTTP GET of each object; then ``index ais://...``;
- ``reshard`` of the indexed directory into another, in MB/s of shards read.

Prints each rate, the ceiling measured beside it and the ratio.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import requests
from servers import aistore
from shard_reads import BUCKET, make_shards, plain_get, read_all

from imagenet_ais.shards.index import index
from imagenet_ais.shards.reshard import reshard
from imagenet_ais.storage import open_store


def cold() -> bool:
    """Drop the page cache (its dirty pages written first); False where this process may not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def row(what: str, nbytes: int, seconds: float, ceiling: float | None = None) -> None:
    rate = nbytes / seconds / 1e6
    against = f" | {nbytes / ceiling / 1e6:.0f} MB/s | {ceiling / seconds:.2f}" if ceiling else " | | "
    click.echo(f"| {what} | {rate:.0f} MB/s{against} |")


@click.command()
@click.option("--shards", default=48, show_default=True)
@click.option("--per-shard", default=200, show_default=True, help="samples a shard (~110 KB each)")
@click.option("--workers", default=2, show_default=True)
@click.option("--ais/--no-ais", default=True, show_default=True, help="also from an AIStore playground")
def main(shards: int, per_shard: int, workers: int, ais: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="index-rate-") as tmp:
        work = Path(tmp)
        data = work / "shards"
        data.mkdir()
        make_shards(data, shards, per_shard)
        (data / "manifest.json").unlink()  # shards another tool made: no manifest of ours
        names = sorted(p.name for p in data.glob("*.tar"))
        nbytes = sum((data / n).stat().st_size for n in names)
        local = open_store(str(data))
        dropped = cold()
        click.echo(
            f"{shards} shards, {nbytes / 1e6:.0f} MB, {workers} workers, {os.cpu_count()} cores, python "
            f"{sys.version.split()[0]}, page cache {'dropped before each' if dropped else 'warm (not root)'}"
        )
        click.echo("| read | rate | ceiling (plain read) | ratio |\n|---|---|---|---|")
        ceiling = read_all(local.open, names, workers)[0]
        cold()
        row("index, local directory", nbytes, timed(lambda: index(str(data), workers=workers)), ceiling)
        if ais:
            with aistore(work / "ais") as playground:
                endpoint = os.environ["AIS_ENDPOINT"] = playground.endpoint
                store = open_store(f"ais://{BUCKET}")  # (its SDK imported only here)
                for name in names:
                    store.put_file(data / name, name, keep=True)
                cold()
                ceiling = read_all(plain_get(endpoint, requests.Session()), names, workers)[0]
                cold()
                run = lambda: index(f"ais://{BUCKET}", manifest_to=str(work / "ais-manifest"), workers=workers)  # noqa: E731
                row("index, AIStore playground", nbytes, timed(run), ceiling)
        cold()
        row(
            "reshard, local directory → local directory",
            nbytes,
            timed(lambda: reshard(str(data), str(work / "resharded"), workers=workers, spool=str(work))),
        )


if __name__ == "__main__":
    main()
