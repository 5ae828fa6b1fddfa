"""``imagenet_shards.py reshard``: a shuffled copy of a shard set, its samples moved as they are.

Shards written in class order (the webdataset project's ImageNet example) give batches of one
or two classes whatever a loader's buffer does. A reshard draws one permutation of each split's
samples and writes them anew, ``maxcount`` to a shard, every member's name and bytes as they
were (nothing decoded or re-encoded).

Two passes, both in worker processes and both resumable:

1. each source shard is read once (checked against its manifest's size and SHA-256 as it
   streams) into a spool file on local disk, its samples ordered by the new shard they go to,
   with an index of where each is;
2. each new shard is made of its samples' slices of the spool files, in the permutation's
   order, hashed as it is written, and put at DST (verified as every write of a store is).

A spool file and its index appear under their names only once complete; a new shard's record
goes to DST's ``_reshard/`` once it is up. A rerun takes both again where the settings are the
same. The manifest is written last; the spool is removed then.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from concurrent.futures import as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from webdataset.tariterators import base_plus_ext, group_by_keys

from imagenet_ais.children import worker_pool
from imagenet_ais.errors import ConfigError, DataError
from imagenet_ais.shards import progress
from imagenet_ais.shards.index import absolute
from imagenet_ais.shards.labels import LabelRule
from imagenet_ais.shards.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, load_manifest
from imagenet_ais.shards.members import members
from imagenet_ais.storage import HashingReader, Store, open_store, process_store
from imagenet_ais.storage.locks import lock_dest

JOURNAL = "_reshard/"  # all ours: a record per new shard put up, gone once the manifest is up
PLAN = "reshard"


@dataclass(frozen=True)
class Job:
    """One split's reshard, as each worker needs it."""

    src: str  # where the source shards are
    split: str
    seed: int
    maxcount: int
    offsets: tuple[int, ...]  # each source shard's first sample's position in the split
    total: int
    spool: str
    rule: LabelRule
    classes: tuple[str, ...]

    def place(self, position: int) -> tuple[int, int]:
        """The new shard a sample at ``position`` goes to, and its place there."""
        rank = _permutation(self.seed, self.split, self.total)[position]
        return divmod(rank, self.maxcount)

    @property
    def shards(self) -> int:
        return math.ceil(self.total / self.maxcount)


_PERMUTATIONS: dict[tuple[int, str, int], list[int]] = {}


def _permutation(seed: int, split: str, total: int) -> list[int]:
    """Each position's rank in the split's shuffled order (made once per process)."""
    key = (seed, split, total)
    if key not in _PERMUTATIONS:
        order = list(range(total))
        random.Random(f"reshard:{seed}:{split}").shuffle(order)
        ranks = [0] * total
        for rank, position in enumerate(order):
            ranks[position] = rank
        _PERMUTATIONS[key] = ranks
    return _PERMUTATIONS[key]


def _grouped(stream: HashingReader, rule: LabelRule) -> Iterator[tuple[dict, list[tuple[str, bytes]]]]:
    """A shard's samples as the loader groups them (the members the rule reads, through
    webdataset's grouping), each with every member of its key as stored (name, bytes): the
    others (a ``.json`` the rule does not read, say) go along."""
    named: dict[tuple[str, str], str] = {}  # (key, extension as grouped) → the member's name
    others: dict[str, list[tuple[str, bytes]]] = {}

    def files() -> Iterator[dict]:
        for name, data in members(cast(BinaryIO, stream)):  # (tarfile only reads it)
            key, ext = base_plus_ext(name)
            if key is None:
                continue  # (no sample's: the loader passes it over too)
            if rule.wanted(name):
                named[key, ext.lower()] = name
                yield {"fname": name, "data": data, "__url__": ""}
            else:
                others.setdefault(key, []).append((name, data))

    for sample in group_by_keys(files()):
        key = sample["__key__"]
        held = [(named[key, ext], data) for ext, data in sample.items() if not ext.startswith("__")]
        yield sample, held + others.pop(key, [])


def spool_shard(job: Job, shard: int, info: ShardInfo) -> None:
    """Pass 1 for one source shard (in a worker process): its usable samples into spool file
    ``shard``, ordered by (new shard, place), with their index beside it."""
    index_path = Path(job.spool, f"{shard}.json")
    if index_path.exists():
        return
    store = process_store(job.src)
    placed = []
    with store.open(info.name) as raw:
        stream = HashingReader(raw)
        usable = 0
        for sample, held in _grouped(stream, job.rule):
            key = sample["__key__"]
            if job.rule.problem(sample):
                continue  # (rejected when it was indexed: never trained, never counted)
            label = job.rule.index(sample, {c: i for i, c in enumerate(job.classes)})
            placed.append((*job.place(job.offsets[shard] + usable), key, label, held))
            usable += 1
        stream.read_to_end()
    if (stream.count, stream.sha.hexdigest()) != (info.bytes, info.sha256) or usable != info.samples:
        raise DataError(
            f"{job.src}/{info.name}: not what its manifest lists ({stream.count:,} bytes, {usable} samples): changed "
            "since it was indexed; index it again, then reshard"
        )
    placed.sort(key=lambda p: (p[0], p[1]))
    entries, offset = [], 0
    data_path = Path(job.spool, f"{shard}.data")
    with open(f"{data_path}.partial", "wb") as out:
        for new, place, key, label, held in placed:
            sizes = [len(d) for _, d in held]
            for _, data in held:
                out.write(data)
            entries.append([new, place, key, label, offset, [[n, s] for (n, _), s in zip(held, sizes, strict=True)]])
            offset += sum(sizes)
    os.replace(f"{data_path}.partial", data_path)
    Path(f"{index_path}.partial").write_text(json.dumps(entries))
    os.replace(f"{index_path}.partial", index_path)


def write_shard(job: Job, dst: str, name: str, pieces: list[list]) -> tuple[ShardInfo, dict[str, int]]:
    """Pass 2 for one new shard (in a worker process): its samples from the spool, in their
    places, as a tar put at ``dst``; its entry and its counts per class."""
    store = process_store(dst)
    tmp = store.scratch_file(name)
    per_class: dict[str, int] = {}
    pieces.sort(key=lambda p: p[0])
    keys: set[str] = set()
    with tarfile.open(tmp, "w") as tar:
        for _, shard, offset, label, files, key in pieces:
            # a key another source shard had too (tools that number each shard's samples from 0):
            # its members renamed by their shard, or the loader would group the two as one
            again = key in keys
            keys.add(key)
            with open(Path(job.spool, f"{shard}.data"), "rb") as spool:
                spool.seek(offset)
                for member, size in files:
                    folder, slash, base = member.rpartition("/")
                    info = tarfile.TarInfo(f"{folder}{slash}s{shard}-{base}" if again else member)
                    info.size, info.mode, info.mtime = size, 0o444, 0
                    tar.addfile(info, io.BytesIO(spool.read(size)))
            per_class[str(label)] = per_class.get(str(label), 0) + 1
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    entry = ShardInfo(name, len(pieces), tmp.stat().st_size, digest.hexdigest(), PLAN)
    store.put_file(tmp, name)
    return entry, per_class


def reshard(
    src: str, dst: str, *, maxcount: int = 1000, seed: int = 0, workers: int = 1, spool: str | None = None
) -> Manifest:
    """A shuffled copy of the shards at ``src`` (a manifest's location) at ``dst``: see the module."""
    if maxcount < 1:
        raise ConfigError(f"--maxcount {maxcount}: give 1 or more samples a shard")
    source = load_manifest(open_store(src))
    shards_at = source.shards_location(src)
    if absolute(dst) in (absolute(src), absolute(shards_at)):
        raise ConfigError(f"{dst}: it holds the shards to reshard: give another location")
    out = open_store(dst)
    spool_root = Path(spool or tempfile.gettempdir(), f"imagenet-reshard-{_digest(src, dst, seed, maxcount)}")
    with lock_dest(out) as lock:
        if out.exists(MANIFEST):
            raise ConfigError(f"{dst} holds a manifest already: reshard to an empty one")
        splits, counts = {}, {}
        for split, info in source.splits.items():
            job = _job(source, shards_at, split, seed, maxcount, spool_root)
            splits[split], counts[split] = _reshard_split(job, info, out, workers)
            splits[split].rejected = list(info.rejected)
        lock.check()
        made = {"made_by": "reshard", "from": src, "seed": seed, "maxcount": maxcount, "was": source.source}
        manifest = Manifest(
            source.classes, splits, made, labels=source.labels, class_counts=counts
        )  # (the members are as they were: so is the rule that reads their labels)
        out.write_bytes(MANIFEST, manifest.to_json().encode())
        for name in out.list(JOURNAL):
            out.delete(name)
    shutil.rmtree(spool_root, ignore_errors=True)
    return manifest


def _job(source: Manifest, shards_at: str, split: str, seed: int, maxcount: int, spool: Path) -> Job:
    info = source.splits[split]
    offsets, total = [], 0
    for shard in info.shards:
        offsets.append(total)
        total += shard.samples
    folder = spool / split
    folder.mkdir(parents=True, exist_ok=True)
    return Job(
        shards_at, split, seed, maxcount, tuple(offsets), total, str(folder), source.label_rule(), tuple(source.classes)
    )


def _reshard_split(job: Job, info: SplitInfo, out: Store, workers: int) -> tuple[SplitInfo, list[dict[str, int]]]:
    """Both passes over one split; its new shards and their counts per class, in order."""
    names = [f"imagenet-{job.split}-{i:06d}.tar" for i in range(job.shards)]
    done = _records(out, job)
    with worker_pool(workers) as pool:
        futures = [pool.submit(spool_shard, job, i, shard) for i, shard in enumerate(info.shards)]
        with progress.bar(len(futures), f"reshard {job.split}: read", "shards") as bar:
            for future in as_completed(futures):
                future.result()
                bar.update()
        pieces: list[list[list]] = [[] for _ in names]
        for shard in range(len(info.shards)):
            for new, place, key, label, offset, files in json.loads(Path(job.spool, f"{shard}.json").read_text()):
                pieces[new].append([place, shard, offset, label, files, key])
        writes = [pool.submit(write_shard, job, out.url, n, pieces[i]) for i, n in enumerate(names) if n not in done]
        with progress.bar(len(names), f"reshard {job.split}: write", "shards") as bar:
            bar.update(len(names) - len(writes))
            for written in as_completed(writes):
                entry, per_class = written.result()
                done[entry.name] = (entry, per_class)
                out.write_bytes(_record_name(job, entry.name), json.dumps([entry.__dict__, per_class]).encode())
                bar.update()
    return SplitInfo([done[n][0] for n in names]), [done[n][1] for n in names]


def _records(out: Store, job: Job) -> dict[str, tuple[ShardInfo, dict[str, int]]]:
    """New shards a former run put up with these settings, while they are there at their size."""
    found = {}
    prefix = f"{JOURNAL}{job.split}-"
    for record in out.list(prefix):
        try:
            fields, per_class = json.loads(out.read_bytes(record))
            entry = ShardInfo(**fields)
        except (ValueError, TypeError):
            continue
        if record == _record_name(job, entry.name) and out.exists(entry.name) and out.size(entry.name) == entry.bytes:
            found[entry.name] = (entry, per_class)
    return found


def _record_name(job: Job, name: str) -> str:
    return f"{JOURNAL}{job.split}-{_digest(job.src, job.seed, job.maxcount, job.total)}-{name}.json"


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:12]
