#!/usr/bin/env python3
"""What one ImageNet epoch's data costs, per store: bytes read and requests sent, without and
with ``--cache-dir``, measured on shards of ImageNet's real size against the real servers this
machine runs, then scaled to ImageNet's shard counts with the loader's own plans.

ImageNet itself is not needed: a few shards shaped like the Hugging Face hub's
``timm/imagenet-1k-wds`` (each sample ``KEY.jpg``, ``KEY.cls``, ``KEY.json``; random bytes in the
``.jpg``: nothing is decoded) go into each store, and each is read as a DataLoader worker reads it:

- through the store alone (``process_store(location)``, ``size``, ``open`` read to the end), the
  store's ``requests`` before and after;
- through the worker's own ``ShardStream._samples`` (loader/worker.py), its counts taken from the
  loader's shared READS: a piece of the whole shard, the two pieces a cut between ranks makes of
  it, a read abandoned halfway (an epoch ending while a worker is in the middle of a shard), and
  with the node's cache (``ShardCache``) a first read (fetched) and a second (a hit).

What the counts say is checked against what each server says it answered: nginx's access log
(``./run serve``), AIStore's Prometheus counters (``/metrics`` of the playground's proxy and
target), moto's request log (S3), fake-gcs-server's request log (GCS). The S3 API of the same
AIStore (``/s3``) is read too.

Then the loader's plans for ImageNet's 1,024 train and 64 val shards (``exact_assignment``,
``contiguous_assignment``, each worker's ``resampled_pieces``) give the shard reads of an epoch at
each topology, and the per-read counts measured here turn them into bytes and requests per store.
Every server started is stopped on the way out. About 1.5-2.5 minutes on 2 cores.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import boto3
import click
import requests
import servers
import webdataset as wds
from google.cloud import storage
from google.cloud.storage.fileio import DEFAULT_CHUNK_SIZE
from servers import free_port

from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.sampling import Piece, contiguous_assignment, exact_assignment, resampled_pieces
from imagenet_ais.loader.worker import LoaderSpec, ShardStream
from imagenet_ais.shards.cache import ShardCache
from imagenet_ais.shards.convert import file_sha256
from imagenet_ais.shards.manifest import ShardInfo, SplitInfo
from imagenet_ais.storage import open_store, process_store

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".cache" / "bin"

# ImageNet-1k as the hub's timm/imagenet-1k-wds holds it: imagenet1k-train-{0000..1023}.tar and
# imagenet1k-validation-{00..63}.tar (docs/shards.md, "The layouts it knows"; index's pattern)
TRAIN_SHARDS, VAL_SHARDS = 1024, 64
# ILSVRC2012's 1,281,167 training images (the --epoch-size of bench/RESULTS.md's ImageNet-long
# epochs, docs/training.md) and its 50,000 validation images (README: convert makes "~1,282 + 50"
# shards of 1,000)
TRAIN_IMAGES, VAL_IMAGES = 1_281_167, 50_000
# ImageNet's mean JPEG, ~110 KB (../shared/notes/performance-anchors.md and aistore.md;
# bench/shard_reads.py's shards), each image's size drawn uniformly around it (only the mean
# matters here: bytes and requests a shard)
MEAN_IMAGE, IMAGE_SPREAD = 110_000, 80_000
# S3 Standard's GET-class request price in us-east-1 (GET and HEAD alike), per 1,000 requests:
# c3x.dev/blog/s3-request-fees-explained's 2026 table of aws.amazon.com/s3/pricing ("GET, HEAD,
# SELECT (Tier 2): $0.0004 per 1,000"); the AWS page is the authority
S3_GET_PER_1000 = 0.0004

# google-cloud-storage's BlobReader (GCSStore.open) GETs an object a range of this size at a time
GCS_CHUNK = DEFAULT_CHUNK_SIZE

LOG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+\\?" (\d{3}) (\S+)')  # combined/common log format


# ------------------------------------------------------------------------------------------
# shards


def make_shards(dest: Path, shards: int, scale: float) -> SplitInfo:
    """``shards`` train shards of the hub's layout, each with ImageNet's mean count of samples
    (× ``scale``, for a quick try), random bytes for JPEGs around the mean size."""
    rng = random.Random(0)
    noise = rng.randbytes(1 << 21)  # sliced at random offsets: distinct bytes, no RNG per image
    per_shard = max(2, round(TRAIN_IMAGES / TRAIN_SHARDS * scale))
    split = SplitInfo()
    for s in range(shards):
        path = dest / f"imagenet1k-train-{s:04d}.tar"
        with wds.TarWriter(str(path)) as tar:
            for i in range(per_shard):
                size = rng.randint(MEAN_IMAGE - IMAGE_SPREAD, MEAN_IMAGE + IMAGE_SPREAD)
                at = rng.randrange(len(noise) - size)
                key = f"n{s:04d}_{i:05d}"
                label = rng.randrange(1000)
                meta = f'{{"label": {label}, "filename": "{key}.JPEG", "width": 500, "height": 375}}'
                tar.write({"__key__": key, "jpg": noise[at : at + size], "cls": str(label).encode(), "json": meta})
        split.shards.append(ShardInfo(path.name, per_shard, path.stat().st_size, file_sha256(path), "bench"))
    return split


# ------------------------------------------------------------------------------------------
# what the servers say they answered


class Seen:
    """What a server says it answered since a mark: requests by method, and bytes where it says."""

    def mark(self) -> object:
        raise NotImplementedError

    def since(self, mark: object) -> tuple[Counter[str], int | None]:
        raise NotImplementedError

    def lines(self, mark: object) -> list[str]:
        """The server's own lines since ``mark`` (where it writes them), for --verbose."""
        return []


@dataclass
class LogSeen(Seen):
    """A request log in the common format (nginx, moto's werkzeug, fake-gcs-server); ``ignore``:
    paths that are not the store's requests (a health check)."""

    path: Path
    ignore: str = r"^$"
    logs_bytes: bool = True  # (fake-gcs-server logs 0 for a streamed download)

    def _lines(self) -> list[str]:
        return self.path.read_text(errors="replace").splitlines() if self.path.exists() else []

    def mark(self) -> object:
        return len(self._lines())

    def since(self, mark: object) -> tuple[Counter[str], int | None]:
        methods: Counter[str] = Counter()
        sent, known = 0, True
        assert isinstance(mark, int)
        for line in self._lines()[mark:]:
            if (m := LOG_LINE.search(line)) and not re.search(self.ignore, m[2]):
                methods[m[1]] += 1
                known &= m[4].isdigit()
                sent += int(m[4]) if m[4].isdigit() else 0
        return methods, sent if known and methods and self.logs_bytes else None

    def lines(self, mark: object) -> list[str]:
        assert isinstance(mark, int)
        return [m[0] for line in self._lines()[mark:] if (m := LOG_LINE.search(line))]


@dataclass
class AISSeen(Seen):
    """AIStore's own counters (each node's Prometheus ``/metrics``): the target's GETs, their
    bytes and HEADs, and the proxy's GETs (those it redirected to the target). The target counts
    a GET once its body went out whole (one abandoned midway: not), and its S3 API's HEADs not."""

    nodes: list[tuple[str, str]]  # (role, URL)

    def _counts(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for role, url in self.nodes:
            for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
                name, value = line.partition("{")[0].split(" ")[0], line.rpartition(" ")[2]
                if name in ("ais_target_get_count", "ais_target_get_bytes", "ais_target_head_count"):
                    out[name] += int(float(value))
                elif name == "ais_proxy_get_count":
                    out[f"{role} {name}"] += int(float(value))
        return out

    def mark(self) -> object:
        return self._counts()

    def since(self, mark: object) -> tuple[Counter[str], int | None]:
        now, before = self._counts(), mark
        assert isinstance(before, Counter)
        methods: Counter[str] = Counter()
        methods["GET"] = now["ais_target_get_count"] - before["ais_target_get_count"]
        methods["HEAD"] = now["ais_target_head_count"] - before["ais_target_head_count"]
        methods["proxy GET (redirected)"] = now["proxy ais_proxy_get_count"] - before["proxy ais_proxy_get_count"]
        return +methods, now["ais_target_get_bytes"] - before["ais_target_get_bytes"]


# ------------------------------------------------------------------------------------------
# servers (each stopped in its finally)


@contextmanager
def nginx(shards: Path, work: Path) -> Iterator[tuple[str, Seen]]:
    port = free_port()
    with servers.nginx(shards, work, port) as url:
        yield url, LogSeen(work / "serve" / str(port) / "access.log")


@contextmanager
def aistore(work: Path) -> Iterator[tuple[str, Seen]]:
    with servers.aistore(work / "ais") as playground:
        yield playground.endpoint, AISSeen([(n.role, f"http://127.0.0.1:{n.port}") for n in playground.nodes()])


@contextmanager
def process(argv: list[str], log: Path, ready: Callable[[], bool]) -> Iterator[None]:
    """A server process, its output in ``log``, once ``ready()``; terminated (then killed) at the end."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise click.ClickException(f"{argv[0]} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            urllib.request.urlopen(url, timeout=1).close()
        except OSError as e:
            return bool(getattr(e, "code", None))  # an HTTP error is an answer
        return True

    return ready


@contextmanager
def moto(work: Path) -> Iterator[tuple[str, Seen]]:
    port = free_port()
    log = work / "moto.log"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with process(argv, log, _answers(f"http://127.0.0.1:{port}/moto-api/")):
        yield f"http://127.0.0.1:{port}", LogSeen(log, ignore=r"^/moto-api")


@contextmanager
def fake_gcs(work: Path) -> Iterator[tuple[str, Seen]]:
    port = free_port()
    log = work / "gcs.log"
    argv = [
        str(BIN / "fake-gcs-server"),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "filesystem",
        "-filesystem-root",
        str(work / "gcs"),
        "-external-url",
        f"http://127.0.0.1:{port}",
        "-public-host",
        f"127.0.0.1:{port}",
        "-log-level",
        "info",
    ]  # fmt: skip  (its info level logs each request it answers)
    with process(argv, log, _answers(f"http://127.0.0.1:{port}/storage/v1/b")):
        yield f"http://127.0.0.1:{port}", LogSeen(log, logs_bytes=False)


@contextmanager
def environment(settings: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------------
# the reads


@dataclass
class Read:
    """One read and what it cost: as counted (the store's ``requests``, or the loader's READS) and
    as the server saw it."""

    what: str
    requests: int
    read_bytes: int
    cache_bytes: int
    served: Counter[str]
    served_bytes: int | None
    seconds: float
    lines: list[str] = field(default_factory=list)


@dataclass
class Store:
    name: str
    location: str
    seen: Seen
    settings: dict[str, str] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)


def _settle(seen: Seen, mark: object) -> tuple[Counter[str], int | None]:
    """The server's counts once they stop moving (nginx logs an abandoned GET once it notices)."""
    last = seen.since(mark)
    for _ in range(20):
        time.sleep(0.25)
        if (now := seen.since(mark)) == last:
            return now
        last = now
    return last


def raw_read(store: Store, name: str) -> Read:
    """``size`` then ``open`` read to the end, as ``ShardStream._open`` does without a cache."""
    s = process_store(store.location)
    mark, before, began = store.seen.mark(), s.requests, time.perf_counter()
    s.size(name)
    got = 0
    with s.open(name) as f:
        while block := f.read(1 << 20):
            got += len(block)
    took = time.perf_counter() - began
    served, served_bytes = _settle(store.seen, mark)
    what = "store: size + open, read whole"
    return Read(what, s.requests - before, got, 0, served, served_bytes, took, store.seen.lines(mark))


def worker_read(
    store: Store, split: SplitInfo, piece: Piece, what: str, cache: Path | None = None, stop_after: int = 0
) -> Read:
    """``piece`` read by the loader worker's own code; ``stop_after`` samples: the read abandoned
    there (the generator closed, as when the epoch ends mid-shard)."""
    shards = one_source(split, store.location)
    caches = [ShardCache(cache, store.location, None, shards.infos[0]) if cache else None]
    spec = LoaderSpec(world=1, rank=0, batch=1, seed=0, image_size=224, shards=shards, caches=caches)
    stream = ShardStream(spec, "exact")
    mark, began = store.seen.mark(), time.perf_counter()
    # (a generator: closing it is what the epoch's end does to a worker's read in progress)
    samples = cast(Generator[tuple[int, dict], None, None], stream._samples(piece))
    for n, _ in enumerate(samples, 1):
        if n == stop_after:
            break
    samples.close()
    took = time.perf_counter() - began
    counts = stream.signals.read_counts()[0]
    served, served_bytes = _settle(store.seen, mark)
    requests, read, cached = counts["read_requests"], counts["read_bytes"], counts["cache_bytes"]
    return Read(what, requests, read, cached, served, served_bytes, took, store.seen.lines(mark))


def measure(store: Store, split: SplitInfo, cache_root: Path) -> None:
    """Shard 0 whole, and in the two pieces a cut between ranks makes of it; shard 1 abandoned
    halfway; shard 2 through the node's cache, twice."""
    n = split.shards[0].samples
    with environment(store.settings):
        store.reads.append(raw_read(store, split.shards[0].name))
        for piece, what in (
            (Piece(0, 0, n), "worker: a piece of the whole shard"),
            (Piece(0, 0, n // 2), "worker: a piece ending mid-shard"),
            (Piece(0, n // 2, n), "worker: a piece starting mid-shard"),
        ):
            store.reads.append(worker_read(store, split, piece, what))
        abandoned = "worker: a read abandoned halfway (the epoch ended)"
        store.reads.append(worker_read(store, split, Piece(1, 0, n), abandoned, stop_after=n // 2))
        cache, third = cache_root / store.name, Piece(2, 0, split.shards[2].samples)
        store.reads.append(worker_read(store, split, third, "worker + cache: first read (fetched)", cache))
        store.reads.append(worker_read(store, split, third, "worker + cache: second read (a hit)", cache))
        shutil.rmtree(cache, ignore_errors=True)


def redirects(endpoint: str, name: str) -> str:
    """What AIStore's proxy answers an object's HEAD and GET with (the SDK follows a redirect)."""
    url = f"{endpoint}/v1/objects/bench/{name}"
    head = requests.head(url, allow_redirects=False, timeout=10)
    with requests.get(url, allow_redirects=False, stream=True, timeout=10) as get:
        said = [f"{r.status_code} {r.headers.get('Location', '')[:40]}".rstrip() for r in (head, get)]
    return f"AIStore's proxy answers a HEAD of an object with {said[0]}, a GET with {said[1]}"


def upload(store: Store, shards: Path, split: SplitInfo) -> None:
    with environment(store.settings):
        s = open_store(store.location)
        for shard in split.shards:
            s.put_file(shards / shard.name, shard.name, keep=True)


# ------------------------------------------------------------------------------------------
# ImageNet's epochs, from the loader's sampling


def imagenet_counts(shards: int, images: int) -> list[int]:
    """Samples per shard, as even as they go (the hub's shards hold 1,251 or 1,252 train images)."""
    return [images // shards + (i < images % shards) for i in range(shards)]


@dataclass
class Epochs:
    """Shard reads and fetches over a run's epochs at ``nodes`` × ``ranks`` (exact mode)."""

    nodes: int
    ranks: int
    batch: int
    epochs: int
    pieces: list[int] = field(default_factory=list)  # train shard reads of each epoch (all ranks)
    split: list[int] = field(default_factory=list)  # of them, pieces of a shard cut between ranks
    unread: list[int] = field(default_factory=list)  # shards no rank reads (the line's tail sitting out)
    fetched: list[int] = field(default_factory=list)  # shards the nodes' caches fetch (new to that node)
    val_pieces: int = 0
    val_fetched: int = 0

    def run(self) -> Epochs:
        counts = imagenet_counts(TRAIN_SHARDS, TRAIN_IMAGES)
        world = self.nodes * self.ranks
        cached: list[set[int]] = [set() for _ in range(self.nodes)]
        for epoch in range(self.epochs):
            ranks, _ = exact_assignment(counts, world, self.batch, seed=0, epoch=epoch)
            pieces = [p for rank in ranks for p in rank]
            per_shard = Counter(p.shard for p in pieces)
            self.pieces.append(len(pieces))
            self.split.append(sum(n for n in per_shard.values() if n > 1))
            self.unread.append(TRAIN_SHARDS - len(per_shard))
            new = 0
            for node in range(self.nodes):  # a node's ranks share its cache: one fetch per shard and node
                mine = {p.shard for r in ranks[node * self.ranks : (node + 1) * self.ranks] for p in r}
                new += len(mine - cached[node])
                cached[node] |= mine
            self.fetched.append(new)
        val = contiguous_assignment(imagenet_counts(VAL_SHARDS, VAL_IMAGES), world)
        self.val_pieces = sum(len(r) for r in val)
        self.val_fetched = sum(
            len({p.shard for r in val[node * self.ranks : (node + 1) * self.ranks] for p in r})
            for node in range(self.nodes)
        )
        return self


@dataclass
class Resampled:
    """Resampled epochs (train.py's default mode) at ``nodes`` × ``ranks`` with ``workers``
    DataLoader workers a rank, from the workers' own streams (``resampled_pieces``, named as
    worker.py names them: ``seed:epoch:restart:rank:worker``). Each worker makes whole batches,
    handed out in turn, of nominal_steps a rank; it reads ``ahead`` samples more than it hands
    over (its shuffle buffer, filled before the first sample leaves, and the DataLoader's
    prefetched batches), which the epoch's end leaves unused, and its last shard partway."""

    nodes: int
    ranks: int
    workers: int
    batch: int
    ahead: int
    whole: list[int] = field(default_factory=list)  # shards read whole, each epoch
    partial: list[int] = field(default_factory=list)  # shards left partway
    partial_samples: list[int] = field(default_factory=list)  # the samples read of those
    fetched: list[int] = field(default_factory=list)  # shards new to a node's cache (summed over nodes)

    def run(self, epochs: int = 2) -> Resampled:
        counts = imagenet_counts(TRAIN_SHARDS, TRAIN_IMAGES)
        steps = math.ceil(TRAIN_IMAGES / (self.nodes * self.ranks * self.batch))  # (engine.nominal_steps)
        cached: list[set[int]] = [set() for _ in range(self.nodes)]
        for epoch in range(epochs):
            whole = partial = partial_samples = new = 0
            for node in range(self.nodes):
                seen: set[int] = set()
                for rank in range(node * self.ranks, (node + 1) * self.ranks):
                    for worker in range(self.workers):
                        need = (steps // self.workers + (worker < steps % self.workers)) * self.batch + self.ahead
                        draws = resampled_pieces(counts, f"0:{epoch}::{rank}:{worker}")
                        while need > 0:
                            piece = next(draws)
                            seen.add(piece.shard)
                            if need >= piece.stop:
                                whole += 1
                            else:
                                partial, partial_samples = partial + 1, partial_samples + need
                            need -= piece.stop
                new += len(seen - cached[node])
                cached[node] |= seen
            self.whole.append(whole)
            self.partial.append(partial)
            self.partial_samples.append(partial_samples)
            self.fetched.append(new)
        return self


@dataclass
class PerRead:
    """A store's measured requests: a whole-shard read (``size`` then the GET) of ``size`` bytes, a
    cache fetch of one, a read abandoned after ``partial_size`` bytes; ``chunk``: where the store's
    reader GETs an object a range at a time (GCS's BlobReader), the range's size, so that reads of
    other sizes can be counted."""

    name: str
    read: int
    fetch: int
    partial: int
    size: float
    partial_size: float
    chunk: int = 0

    def _gets(self, size: float) -> int:
        return math.ceil(size / self.chunk) if self.chunk else 1

    def at(self, measured: int, size: float, partial: bool = False) -> int:
        """``measured`` requests (of a read as large as the one measured) for a read of ``size`` bytes."""
        was = self.partial_size if partial else self.size
        return measured - self._gets(was) + self._gets(size) if measured else 0


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def imagenet_table(
    per: list[PerRead], sample_bytes: float, batch: int, workers: int, ahead: int, topologies: list[tuple[int, int]]
) -> list[str]:
    """Per topology: one epoch's train and validation reads, bytes and requests per store, in exact
    and resampled mode, without the cache and with it (its first and second epochs)."""
    val_counts = imagenet_counts(VAL_SHARDS, VAL_IMAGES)
    shard, val = sample_bytes * TRAIN_IMAGES / TRAIN_SHARDS, sample_bytes * VAL_IMAGES / VAL_SHARDS
    out = []
    for nodes, ranks in topologies:
        e = Epochs(nodes, ranks, batch, epochs=90).run()
        r = Resampled(nodes, ranks, workers, batch, ahead).run()
        later = ", ".join(f"{i + 1}: {e.fetched[i]}" for i in (1, 2, 3, 9, 29))
        out += [
            f"\n### {nodes} node{'s' if nodes > 1 else ''} × {ranks} ranks, batch {batch} a rank",
            f"- exact: {e.pieces[0]:,} train shard reads in epoch 1 ({e.split[0]} of them pieces of shards cut "
            f"between ranks, each read whole; {e.unread[0]} shards unread, the line's tail); val: {e.val_pieces} "
            f"reads of its {VAL_SHARDS} shards. With --cache-dir, train shards new to a node fetched in epoch 1: "
            f"{e.fetched[0]:,}; in epoch {later}; over 90 epochs {sum(e.fetched):,} (each node its own copy of each)",
            f"- resampled, {workers} workers a rank, each reading {ahead:,} samples ahead (its shuffle buffer and "
            f"prefetched batches): {r.whole[0]:,} train shards read whole and {r.partial[0]:,} partway "
            f"({r.partial_samples[0] / max(1, r.partial[0]):,.0f} samples of each, on average); with --cache-dir "
            f"{r.fetched[0]:,} fetched in epoch 1 (drawn with replacement: not every shard), {r.fetched[1]:,} in "
            "epoch 2",
            "",
            "| | exact, no cache | exact, --cache-dir epoch 1 | epoch 2 | resampled, no cache | "
            "resampled, --cache-dir epoch 1 | epoch 2 |",
            "|---|---|---|---|---|---|---|",
        ]
        val_read = sum(len(x) for x in contiguous_assignment(val_counts, nodes * ranks))
        assert val_read == e.val_pieces
        exact = e.pieces[0] * shard + e.val_pieces * val
        resampled = r.whole[0] * shard + r.partial_samples[0] * sample_bytes + e.val_pieces * val
        first_val = e.val_fetched * val
        columns = [
            exact, e.fetched[0] * shard + first_val, e.fetched[1] * shard,
            resampled, r.fetched[0] * shard + first_val, r.fetched[1] * shard,
        ]  # fmt: skip
        out.append("| bytes read | " + " | ".join(_gb(c) for c in columns) + " |")
        part = r.partial_samples[0] * sample_bytes / max(1, r.partial[0])
        for p in per:
            counts = [
                e.pieces[0] * p.at(p.read, shard) + e.val_pieces * p.at(p.read, val),
                e.fetched[0] * p.at(p.fetch, shard) + e.val_fetched * p.at(p.fetch, val),
                e.fetched[1] * p.at(p.fetch, shard),
                r.whole[0] * p.at(p.read, shard)
                + r.partial[0] * p.at(p.partial, part, partial=True)
                + e.val_pieces * p.at(p.read, val),
                r.fetched[0] * p.at(p.fetch, shard) + e.val_fetched * p.at(p.fetch, val),
                r.fetched[1] * p.at(p.fetch, shard),
            ]
            out.append(f"| {p.name}: requests | " + " | ".join(f"{c:,}" for c in counts) + " |")
            if p.name == "s3 (moto)":
                price = [f"${c * S3_GET_PER_1000 / 1000:.4f}" for c in counts]
                out.append("| S3 GET class at $0.0004 / 1,000 | " + " | ".join(price) + " |")
    return out


# ------------------------------------------------------------------------------------------


def _served(r: Read) -> str:
    said = ", ".join(f"{n} {m}" for m, n in sorted(r.served.items())) or "nothing"
    return said + (f"; {r.served_bytes:,} B sent" if r.served_bytes is not None else "")


def _fill(
    key: str, candidates: dict[str, Store], shards: Path, split: SplitInfo, ais_url: str, moto_url: str, ais_full: bool
) -> bool:
    """Store ``key``'s bucket made and the shards put in it (nginx serves the folder itself);
    whether AIStore's bucket holds them now (``ais-s3`` reads the objects ``ais`` put there)."""
    store = candidates[key]
    if key in ("ais", "ais-s3") and not ais_full:
        with environment(candidates["ais"].settings):
            from aistore.sdk import Client

            Client(ais_url).bucket("bench").create(exist_ok=True)
            upload(candidates["ais"], shards, split)
        print(redirects(ais_url, split.shards[0].name), flush=True)
        return True
    if key == "s3":
        with environment(store.settings):
            boto3.session.Session().client("s3", endpoint_url=moto_url).create_bucket(Bucket="bench-moto")
        upload(store, shards, split)
    elif key == "gcs":
        with environment(store.settings):
            storage.Client().create_bucket("bench")
        upload(store, shards, split)
    return ais_full


def _per_read(store: Store, mean: float, verbose: bool) -> PerRead:
    """``store``'s reads as a table's rows (with the server's request lines where ``verbose``), and
    what a read costs there, for the ImageNet table."""
    for r in store.reads:
        print(
            f"| {store.name} | {r.what} | {r.requests} | {r.read_bytes:,} | {r.cache_bytes:,} | "
            f"{_served(r)} | {r.seconds:.2f} |"
        )
        for line in r.lines if verbose else []:
            print(f"|   | {line.replace('|', '/')} | | | | | |")
    fetch = next(r for r in store.reads if "fetched" in r.what)
    left = next(r for r in store.reads if "abandoned" in r.what)
    chunk = GCS_CHUNK if store.location.startswith("gs://") else 0
    whole = store.reads[1]  # the worker's piece of a whole shard
    # a store's first read in a process may cost more than the next ones (GCS: one GET of the
    # bucket's metadata), as the raw read (the first) and the worker's (the next) tell; the
    # cache's store is a new one, its fetch a first read: that once a process is left out
    first = store.reads[0].requests - whole.requests
    if first:
        print(f"{store.name}: {first} request(s) once a process, on its first read (left out below)")
    return PerRead(store.name, whole.requests, fetch.requests - first, left.requests, mean, left.read_bytes, chunk)


@click.command()
@click.option("--shards", default=3, show_default=True, help="train shards made (at least 3)")
@click.option("--scale", default=1.0, show_default=True, help="shard size against ImageNet's (a quick try: 0.05)")
@click.option("--batch", default=256, show_default=True, help="batch a rank, for the epochs' plan (train.py's)")
@click.option("--workers", default=14, show_default=True, help="DataLoader workers a rank, for resampled mode")
@click.option(
    "--shuffle-buffer", default=2000, show_default=True, help="train.py's --shuffle-buffer, for resampled mode"
)
@click.option("--topologies", default="1x8,8x8", show_default=True, help="nodes x ranks a node, for the epochs' plans")
@click.option("--stores", default="http,ais,ais-s3,s3,gcs", show_default=True, help="which stores to read")
@click.option("--verbose", is_flag=True, help="each read's request lines, as the server logged them")
def main(
    shards: int,
    scale: float,
    batch: int,
    workers: int,
    shuffle_buffer: int,
    topologies: str,
    stores: str,
    verbose: bool,
) -> None:
    wanted = stores.split(",")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="data-cost-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # run as root, ./run serve's nginx workers read as nobody
        (work / "shards").mkdir(mode=0o755)
        split = make_shards(work / "shards", max(3, shards), scale)
        mean = split.bytes / len(split.shards)
        per_sample = split.bytes / split.samples
        print(
            f"{len(split.shards)} shards of {split.shards[0].samples:,} samples, {mean / 1e6:.1f} MB each "
            f"({per_sample / 1e3:.1f} kB a sample: a {MEAN_IMAGE / 1e3:.0f} kB JPEG, its .cls, .json and tar headers); "
            f"made in {time.perf_counter() - began:.0f} s",
            flush=True,
        )
        measured: list[Store] = []
        aistore_filled = False
        with (
            nginx(work / "shards", work) as (http_url, http_seen),
            aistore(work) if {"ais", "ais-s3"} & set(wanted) else _nothing() as (ais_url, ais_seen),
            moto(work) if "s3" in wanted else _nothing() as (moto_url, moto_seen),
            fake_gcs(work) if "gcs" in wanted else _nothing() as (gcs_url, gcs_seen),
        ):
            keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
            candidates = {
                "http": Store("http (nginx)", http_url, http_seen),
                "ais": Store("ais", "ais://bench", ais_seen, {"AIS_ENDPOINT": ais_url}),
                "ais-s3": Store(
                    "s3 (AIStore /s3)", "s3://bench", ais_seen, {"AWS_ENDPOINT_URL": f"{ais_url}/s3", **keys}
                ),
                "s3": Store("s3 (moto)", "s3://bench-moto", moto_seen, {"AWS_ENDPOINT_URL": moto_url, **keys}),
                "gcs": Store("gcs (fake-gcs-server)", "gs://bench", gcs_seen, {"STORAGE_EMULATOR_HOST": gcs_url}),
            }
            for key in wanted:
                store = candidates[key]
                t = time.perf_counter()
                aistore_filled = _fill(key, candidates, work / "shards", split, ais_url, moto_url, aistore_filled)
                up = time.perf_counter() - t
                measure(store, split, work / "cache")
                print(f"{store.name}: uploaded in {up:.0f} s, read in {time.perf_counter() - t - up:.0f} s", flush=True)
                measured.append(store)
        print(f"\nmeasured in {time.perf_counter() - began:.0f} s; shard {mean / 1e6:.1f} MB\n")
        print("| store | read | requests counted | read_bytes | cache_bytes | the server answered | s |")
        print("|---|---|---|---|---|---|---|")
        per = [_per_read(store, mean, verbose) for store in measured]
        shard, val = per_sample * TRAIN_IMAGES / TRAIN_SHARDS, per_sample * VAL_IMAGES / VAL_SHARDS
        print(
            f"\nImageNet (the bytes a sample measured here × its counts): {TRAIN_SHARDS} train shards of "
            f"{shard / 1e6:.1f} MB ({_gb(shard * TRAIN_SHARDS)}), {VAL_SHARDS} val shards of {val / 1e6:.1f} MB "
            f"({_gb(val * VAL_SHARDS)}); requests a read as measured above, GCS's with one GET a "
            f"{GCS_CHUNK >> 20} MiB range of each read's size"
        )
        ahead = shuffle_buffer + 2 * batch  # (the DataLoader's prefetch_factor 2: engine.py)
        grid = [(int(n), int(r)) for n, _, r in (t.partition("x") for t in topologies.split(","))]
        print("\n".join(imagenet_table(per, per_sample, batch, workers, ahead, grid)))
        print(f"\ntook {time.perf_counter() - began:.0f} s")


@contextmanager
def _nothing() -> Iterator[tuple[str, Seen]]:
    yield "", Seen()


if __name__ == "__main__":
    main()
