#!/usr/bin/env python3
"""AIStore's GetBatch (``/v1/ml/moss``) for a global sample-level shuffle, in one run.

An AIStore playground on loopback (tools/ais_local.py) holds generated shards of ~110 KB
JPEGs. For each reader count (threads, as DataLoader workers would be), rows of samples/s,
MiB/s and CPU seconds per GiB:

- whole shards streamed through the ``ais://`` store and split into samples: what the
  epoch modes read today (a shuffle only within a buffer of samples);
- GetBatch: batches of random samples drawn from every shard (a global shuffle), each
  sample's ``.jpg`` and ``.cls`` by archive path, one request per batch;
- GetBatch of the same sizes, samples in shard order (no shuffle): the cost of a request
  without the cost of finding a member at random in its shard;
- one GET per member (``?archpath=``): the naive global shuffle.

The GetBatch rows are checked: every sample read once, its bytes equal to the shard's.
"""

from __future__ import annotations

import os
import random
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
from aistore.sdk import Client
from aistore.sdk.archive_config import ArchiveConfig
from servers import aistore
from shard_reads import make_shards

from imagenet_ais.storage import open_store

BUCKET = "bench-get-batch"
Sample = tuple[str, str]  # (shard, key)


def shard_samples(directory: Path, shard: str) -> dict[str, bytes]:
    """A local shard's members by name (the reference the GetBatch bytes are checked against)."""
    with tarfile.open(directory / shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


def stream_shards(store_url: str) -> Callable[[list[str]], tuple[int, int]]:
    store = open_store(store_url)

    def read(shards: list[str]) -> tuple[int, int]:
        samples = size = 0
        for name in shards:
            with store.open(name) as f, tarfile.open(fileobj=f, mode="r|") as tar:
                for member in tar:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    size += len(data)
                    samples += member.name.endswith(".jpg")
        return samples, size

    return read


def get_batch(
    client: Client, reference: dict[str, dict[str, bytes]]
) -> Callable[[list[list[Sample]]], tuple[int, int]]:
    bucket = client.bucket(BUCKET)

    def read(batches: list[list[Sample]]) -> tuple[int, int]:
        samples = size = 0
        for batch in batches:
            request = client.batch(bucket=bucket)
            for shard, key in batch:
                request.add(shard, archpath=f"{key}.jpg")
                request.add(shard, archpath=f"{key}.cls")
            wanted = [(shard, f"{key}.{ext}") for shard, key in batch for ext in ("jpg", "cls")]
            got = [content for _, content in request.get()]
            if len(got) != len(wanted):
                raise click.ClickException(f"GetBatch returned {len(got)} members for {len(wanted)}")
            for (shard, member), content in zip(wanted, got, strict=True):
                if content != reference[shard][member]:
                    raise click.ClickException(f"GetBatch returned other bytes for {shard}/{member}")
                size += len(content)
            samples += len(batch)
        return samples, size

    return read


def get_each(client: Client) -> Callable[[list[Sample]], tuple[int, int]]:
    bucket = client.bucket(BUCKET)

    def read(samples: list[Sample]) -> tuple[int, int]:
        size = 0
        for shard, key in samples:
            for ext in ("jpg", "cls"):
                reader = bucket.object(shard).get_reader(archive_config=ArchiveConfig(archpath=f"{key}.{ext}"))
                size += len(reader.read_all())
        return len(samples), size

    return read


def timed(read: Callable[[list], tuple[int, int]], work: list, readers: int) -> tuple[int, int, float, float]:
    """``work`` dealt round-robin to ``readers`` threads: (samples, bytes, wall s, CPU s)."""
    parts = [work[i::readers] for i in range(readers)]
    wall, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(readers) as pool:
        results = list(pool.map(read, parts))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return sum(r[0] for r in results), sum(r[1] for r in results), wall, cpu


@click.command()
@click.option("--shards", default=32, show_default=True)
@click.option("--per-shard", default=150, show_default=True, help="samples of ~110 KB each")
@click.option("--readers", default="1,4", show_default=True, help="threads reading at once, e.g. 1,4")
@click.option("--batches", default="64,256", show_default=True, help="samples per GetBatch request")
@click.option("--each", default=600, show_default=True, help="samples read one GET per member")
@click.option("--targets", default=1, show_default=True, help="AIStore targets")
def main(shards: int, per_shard: int, readers: str, batches: str, each: int, targets: int) -> None:
    with tempfile.TemporaryDirectory(prefix="get-batch-") as tmp:
        work = Path(tmp)
        (work / "shards").mkdir()
        manifest = make_shards(work / "shards", shards, per_shard)
        names = [s.name for s in manifest.splits["train"].shards]
        reference = {name: shard_samples(work / "shards", name) for name in names}
        samples = [
            (name, member[: -len(".jpg")]) for name in names for member in reference[name] if member.endswith(".jpg")
        ]
        with aistore(work / "ais", targets) as playground:
            endpoint = os.environ["AIS_ENDPOINT"] = playground.endpoint
            store = open_store(f"ais://{BUCKET}")
            for name in names:
                store.put_file(work / "shards" / name, name, keep=True)
            client = Client(endpoint)
            click.echo(f"{len(samples)} samples in {shards} shards, {os.cpu_count()} cores, AIS targets {targets}")
            rng = random.Random(0)
            for n in [int(r) for r in readers.split(",")]:
                timed(stream_shards(f"ais://{BUCKET}"), names, n)  # warm-up: connections, target page cache
                rows = [("whole shards, streamed (ais:// store)", timed(stream_shards(f"ais://{BUCKET}"), names, n))]
                for size in [int(b) for b in batches.split(",")]:
                    shuffled = rng.sample(samples, len(samples))  # one global shuffle: each sample once
                    for label, order in (("random samples", shuffled), ("samples in shard order", samples)):
                        groups = [order[i : i + size] for i in range(0, len(order), size)]
                        read = timed(get_batch(client, reference), groups, n)
                        rows.append((f"GetBatch, {size} {label} a request", read))
                rows.append(
                    (
                        f"one GET per member, {each} random samples",
                        timed(get_each(client), rng.sample(samples, each), n),
                    )
                )
                base = rows[0][1][0] / rows[0][1][2]
                click.echo(
                    f"\n{n} reader(s)\n| | samples/s | MiB/s | of streaming | CPU s/GiB |\n|---|---|---|---|---|"
                )
                for label, (count, size_, wall, cpu) in rows:
                    rate = count / wall
                    click.echo(
                        f"| {label} | {rate:,.0f} | {size_ / wall / 2**20:,.0f} | {rate / base:.2f} | "
                        f"{cpu / (size_ / 2**30):.2f} |"
                    )


if __name__ == "__main__":
    main()
