#!/usr/bin/env python3
"""Shard read throughput in one run, against the local-disk ceiling measured in the same run.

Rows, for each reader count: local disk (page cache, the ceiling); HTTP from nginx
(./run serve) on loopback without and with the shard cache (epoch 1 cold: download, verify,
keep; epoch 2 warm); and with ``--ais``, from an AIStore playground on loopback
(tools/ais_local.py): a plain HTTP GET of each object (``requests``, 1 MiB chunks) and the
project's ``ais://`` store as training opens it. Each row also gives the reading process's CPU
seconds per GiB; uncached rows are the median of ``--rounds`` interleaved passes. Then the
training loader alone (samples/s out of the DataLoader, workers reading headers only, as for
GPU decode) from local disk and, with ``--ais``, from ``ais://``, in alternation.

Every shard is read whole, in 1 MiB blocks, by ``--readers`` threads at once (like DataLoader
workers each streaming a shard), through the same store and cache code training uses. The
shards are generated: tar files of ~110 KB JPEGs (ImageNet's mean size).
"""

from __future__ import annotations

import io
import os
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import click
import requests
import webdataset as wds
from servers import aistore, nginx
from throughput import loader_rate

from imagenet_ais.shards.cache import ShardCache
from imagenet_ais.shards.convert import file_sha256
from imagenet_ais.shards.manifest import Manifest, ShardInfo, SplitInfo
from imagenet_ais.shards.synth import draw_picture
from imagenet_ais.storage import open_store

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench-shard-reads"


def make_shards(dest: Path, shards: int, per_shard: int) -> Manifest:
    """Shards of ~110 KB JPEGs (a pool of distinct 500×375 pictures, repeated)."""
    rng = random.Random(0)
    pool = []
    for k in range(48):
        buf = io.BytesIO()
        draw_picture(k, rng, (500, 375)).save(buf, "JPEG", quality=95)
        pool.append(buf.getvalue())
    split = SplitInfo()
    for s in range(shards):
        path = dest / f"imagenet-train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as tar:
            for i in range(per_shard):
                tar.write({"__key__": f"{s}-{i}", "jpg": rng.choice(pool), "cls": b"0"})
        split.shards.append(ShardInfo(path.name, per_shard, path.stat().st_size, file_sha256(path), "bench"))
    manifest = Manifest(["c0"], {"train": split})
    (dest / "manifest.json").write_text(manifest.to_json())
    return manifest


def read_all(open_: Callable[[str], io.RawIOBase], names: list[str], readers: int) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds to read every shard whole with ``readers`` threads."""

    def read(name: str) -> None:
        with open_(name) as f:
            while f.read(1 << 20):
                pass

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, names))
    return time.perf_counter() - start, time.process_time() - cpu


def plain_get(endpoint: str, session: requests.Session) -> Callable[[str], io.RawIOBase]:
    """An object as a plain HTTP GET from the proxy (following its redirect to the target)."""

    def open_(name: str) -> io.RawIOBase:
        response = session.get(f"{endpoint}/v1/objects/{BUCKET}/{name}", stream=True, timeout=60)
        response.raise_for_status()
        chunks = response.iter_content(1 << 20)

        class Body(io.RawIOBase):
            def read(self, _size: int = -1) -> bytes:
                return next(chunks, b"")

            def close(self) -> None:
                response.close()
                super().close()

        return Body()

    return open_


@click.command()
@click.option("--shards", default=32, show_default=True)
@click.option("--per-shard", default=150, show_default=True, help="samples of ~110 KB each")
@click.option("--readers", default="1,4", show_default=True, help="shards read at once, e.g. 1,4")
@click.option("--port", default=18181, show_default=True, help="nginx's loopback port")
@click.option("--ais/--no-ais", default=True, show_default=True, help="add the AIStore rows (needs ./run ais-install)")
@click.option("--targets", default=1, show_default=True, help="AIStore targets")
@click.option("--workers", default=2, show_default=True, help="DataLoader workers for the loader-alone rows")
@click.option("--rounds", default=3, show_default=True, help="passes over the sources per reader count (median kept)")
def main(
    shards: int, per_shard: int, readers: str, port: int, ais: bool, targets: int, workers: int, rounds: int
) -> None:
    counts = [int(n) for n in readers.split(",")]
    with tempfile.TemporaryDirectory(prefix="shard-reads-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # run as root, ./run serve's nginx workers read as nobody
        (work / "shards").mkdir()
        manifest = make_shards(work / "shards", shards, per_shard)
        names = [s.name for s in manifest.splits["train"].shards]
        total = manifest.splits["train"].bytes
        local = open_store(str(work / "shards"))
        sources: list[tuple[str, Callable[[str], io.RawIOBase]]] = []
        ais_up = aistore(work / "ais", targets) if ais else nullcontext()
        with nginx(work / "shards", work, port) as url, ais_up as playground:
            endpoint = playground.endpoint if playground else None
            sources.append(("local disk (page cache): the ceiling", local.open))
            sources.append(("HTTP, nginx on loopback, no cache", open_store(url).open))
            if endpoint:
                os.environ["AIS_ENDPOINT"] = endpoint
                store = open_store(f"ais://{BUCKET}")
                for name in [*names, "manifest.json"]:
                    store.put_file(work / "shards" / name, name, keep=True)
                sources.append(("AIS, plain GET (requests, 1 MiB chunks)", plain_get(endpoint, requests.Session())))
                sources.append(("AIS, the ais:// store (as training reads)", store.open))
            click.echo(f"{shards} shards, {total / 2**20:.0f} MiB, {os.cpu_count()} cores, AIS targets {targets}")
            shard_infos = {s.name: s for s in manifest.splits["train"].shards}
            for n in counts:
                read_all(local.open, names, n)  # warm-up: threads, page cache
                # rounds interleaved, the median kept: on a small machine one pass is noisy
                passes = [[read_all(open_, names, n) for _, open_ in sources] for _ in range(rounds)]
                rows = [(label, *_median([p[i] for p in passes])) for i, (label, _) in enumerate(sources)]
                for epoch, state in ((1, "cold"), (2, "warm")):  # a fresh cache per reader count
                    cache = ShardCache(work / f"cache{n}", url, None, shard_infos)
                    read = read_all(lambda name, c=cache: c.open(name)[0], names, n)  # (open: the file, where from)
                    rows.append((f"HTTP + cache, epoch {epoch} ({state})", *read))
                ceiling = total / rows[0][1]
                click.echo(f"\n{n} reader(s)\n| | MiB/s | of ceiling | CPU s/GiB |\n|---|---|---|---|")
                for label, seconds, cpu in rows:
                    rate = total / seconds
                    click.echo(
                        f"| {label} | {rate / 2**20:,.0f} | {rate / ceiling:.2f} | {cpu / (total / 2**30):.2f} |"
                    )
            click.echo(f"\nloader alone ({workers} workers, batch 64, headers only as for GPU decode), samples/s:")
            locations = [("local disk", str(work / "shards"))] + ([("ais://", f"ais://{BUCKET}")] if endpoint else [])
            for _ in range(2):
                for label, location in locations:
                    click.echo(f"  {label:12} {loader_rate(location, 'gpu', workers, 64, 224, False):8.0f}")


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The run of median wall time (with its CPU time)."""
    return sorted(runs)[len(runs) // 2]


if __name__ == "__main__":
    main()
