#!/usr/bin/env python3
"""Shard read throughput in one run: local disk (the ceiling), HTTP from nginx (./run serve) on
loopback, and HTTP through the shard cache: epoch 1 (cold: download, verify, keep) and epoch 2
(warm: verify the local copy, read it).

Every shard is read whole, in 1 MiB blocks, by ``--readers`` threads at once (like DataLoader
workers each streaming a shard), through the same store and cache code training uses. The
shards are generated: tar files of incompressible ~110 KB samples (ImageNet's mean JPEG size).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import webdataset as wds

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from imagenet_ais.cache import ShardCache
from imagenet_ais.manifest import Manifest, ShardInfo, SplitInfo
from imagenet_ais.shards import file_sha256
from imagenet_ais.storage import open_store

ROOT = Path(__file__).resolve().parent.parent


def make_shards(dest: Path, shards: int, per_shard: int) -> Manifest:
    rng = random.Random(0)
    split = SplitInfo()
    for s in range(shards):
        path = dest / f"imagenet-train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as tar:
            for i in range(per_shard):
                tar.write({"__key__": f"{s}-{i}", "jpg": rng.randbytes(rng.randint(60_000, 160_000)), "cls": b"0"})
        split.shards.append(ShardInfo(path.name, per_shard, path.stat().st_size, file_sha256(path), "bench"))
    manifest = Manifest(["c0"], {"train": split})
    (dest / "manifest.json").write_text(manifest.to_json())
    return manifest


def read_all(opener, names: list[str], readers: int) -> float:
    """Seconds to read every shard whole with ``readers`` threads."""

    def read(name: str) -> None:
        with opener.open(name) as f:
            while f.read(1 << 20):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, names))
    return time.perf_counter() - start


@click.command()
@click.option("--shards", default=32, show_default=True)
@click.option("--per-shard", default=150, show_default=True, help="samples of ~110 KB each")
@click.option("--readers", default=2, show_default=True, help="shards read at once")
@click.option("--port", default=18181, show_default=True, help="nginx's loopback port")
def main(shards: int, per_shard: int, readers: int, port: int) -> None:
    with tempfile.TemporaryDirectory(prefix="shard-reads-") as tmp:
        work = Path(tmp)
        (work / "shards").mkdir()
        manifest = make_shards(work / "shards", shards, per_shard)
        names = [s.name for s in manifest.splits["train"].shards]
        total = manifest.splits["train"].bytes
        env = {**os.environ, "SERVE_ROOT": str(work / "serve")}
        serve = [str(ROOT / "run"), "serve", str(work / "shards"), "--port", str(port), "--addr", "127.0.0.1"]
        subprocess.run(serve, check=True, env=env, stdout=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            cache = ShardCache(work / "cache", url, None, {s.name: s for s in manifest.splits["train"].shards})
            local = open_store(str(work / "shards"))
            read_all(local, names, readers)  # warm-up: threads, page cache
            rows = [
                ("local disk (page cache): the ceiling", read_all(local, names, readers)),
                ("HTTP, nginx on loopback, no cache", read_all(open_store(url), names, readers)),
                ("HTTP + cache, epoch 1 (cold)", read_all(cache, names, readers)),
                ("HTTP + cache, epoch 2 (warm)", read_all(cache, names, readers)),
            ]
        finally:
            subprocess.run([str(ROOT / "run"), "serve", "--stop"], check=True, env=env, stdout=subprocess.DEVNULL)
    ceiling = total / rows[0][1]
    click.echo(f"{shards} shards, {total / 2**20:.0f} MiB, {readers} readers, {os.cpu_count()} cores")
    click.echo("| | MiB/s | of ceiling |\n|---|---|---|")
    for label, seconds in rows:
        click.echo(f"| {label} | {total / seconds / 2**20:,.0f} | {total / seconds / ceiling:.2f} |")


if __name__ == "__main__":
    main()
