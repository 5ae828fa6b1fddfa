"""``imagenet_shards.py verify``: every shard read back in worker processes and checked against its
manifest entry (size, SHA-256, members), every image decoded and every label in range.

It reads what training reads (labels.py: the images, and the member the manifest's label rule
names) and passes over text members of other tools (``.txt``, ``.json``), as training does; any
other member is refused (a ``.pyd`` or ``.pickle`` would even be unpickled by another reader).
"""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import as_completed

from PIL import Image

from imagenet_ais.children import worker_pool
from imagenet_ais.shards import progress
from imagenet_ais.shards.labels import IMAGE_EXTS, LabelRule
from imagenet_ais.shards.manifest import (
    ShardInfo,
    load_manifest,
)
from imagenet_ais.shards.members import members
from imagenet_ais.storage import open_store, process_store

TEXT_EXTS = ("cls", "txt", "json")  # what a sample may hold beside its image: plain text, never run
HOLDS = f"a sample holds an image (.{', .'.join(IMAGE_EXTS)}) and text (.{', .'.join(TEXT_EXTS)}) only"


def check_shard(
    dest_url: str, info: ShardInfo, classes: list[str], rule: LabelRule, rejected: frozenset[str] = frozenset()
) -> str | None:
    """None when the shard matches its manifest entry, every image decodes and every label is
    one of ``classes`` (read by ``rule``), but for the samples its manifest lists as
    ``rejected`` (index's: not counted, never read); else the problem (in a worker process)."""
    store = process_store(dest_url)
    if problem := info.problem(store):
        return problem
    exts: dict[str, set[str]] = {}  # key → the extensions of its members
    labels: dict[str, bytes] = {}  # key → its label member's bytes
    try:
        with store.open(info.name) as f:
            for name, data in members(f):  # every header judged as training judges it
                key, _, ext = name.partition(".")
                if "/" in name or ".." in name or not key:
                    return f"bad member name {name!r}"
                if (ext := ext.lower()) not in (*IMAGE_EXTS, *TEXT_EXTS):
                    return f"unexpected member {name!r}: {HOLDS}"
                if ext in exts.setdefault(key, set()):
                    return f"duplicate key {key!r}: {name} is in the shard twice"
                exts[key].add(ext)
                if ext in IMAGE_EXTS:
                    with Image.open(io.BytesIO(data)) as img:
                        img.load()
                elif ext == rule.member:
                    labels[key] = data
    except (OSError, ValueError, tarfile.TarError, Image.DecompressionBombError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    # (others passed over, as in training)
    read = [key for key, found in exts.items() if found & set(rule.exts) and key not in rejected]
    for key in read:
        if problem := _sample_problem(key, exts[key], labels.get(key), classes, rule):
            return problem
    if len(read) != info.samples:
        return f"{len(read)} samples != manifest {info.samples}"
    return None


def _sample_problem(key: str, exts: set[str], label: bytes | None, classes: list[str], rule: LabelRule) -> str | None:
    """Why training could not take the sample ``key`` (its members' extensions, its label
    member's bytes), else None."""
    if not exts & set(IMAGE_EXTS):
        return f"sample {key!r} lacks its image (.{', .'.join(IMAGE_EXTS)})"
    if label is None:
        return f"sample {key!r} lacks its .{rule.member}"
    try:
        index = rule.index({rule.member: label}, {name: i for i, name in enumerate(classes)})
    except ValueError:
        index = -1
    if not 0 <= index < len(classes):
        shown = label[:20].decode(errors="replace")
        return f"{key}.{rule.member}: label {shown!r} is not a class of the manifest (0..{len(classes) - 1})"
    return None


def verify(dest_url: str, workers: int) -> dict[str, str]:
    """Problems by shard name (empty when all is well)."""
    manifest = load_manifest(open_store(dest_url))
    shards_at = manifest.shards_location(dest_url)
    rejected: dict[str, set[str]] = {}  # shard → the keys index rejected in it ("SHARD#KEY")
    for split in manifest.splits.values():
        for path in (r.get("path", "") for r in split.rejected):
            shard, hash_, key = path.partition("#")
            if hash_:
                rejected.setdefault(shard, set()).add(key)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    problems: dict[str, str] = {}
    rule = manifest.label_rule()
    with worker_pool(workers) as pool:
        futures = {
            pool.submit(check_shard, shards_at, s, manifest.classes, rule, frozenset(rejected.get(s.name, ()))): s
            for s in shards
        }
        with progress.bar(len(futures), f"verify {dest_url}", "shards") as bar:
            for future in as_completed(futures):
                if problem := future.result():
                    problems[futures[future].name] = problem
                bar.update()
    return problems
