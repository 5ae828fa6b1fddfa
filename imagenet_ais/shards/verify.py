"""``imagenet_shards.py verify``: every shard read back in worker processes and checked against its
manifest entry (size, SHA-256, members), every image decoded and every label in range."""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import as_completed

from PIL import Image

from imagenet_ais.children import worker_pool
from imagenet_ais.shards import progress
from imagenet_ais.shards.manifest import (
    ShardInfo,
    load_manifest,
)
from imagenet_ais.shards.members import members
from imagenet_ais.storage import open_store, process_store


def check_shard(dest_url: str, info: ShardInfo, num_classes: int) -> str | None:
    """None when the shard matches its manifest entry and every image decodes; else the problem
    (in a worker process)."""
    store = process_store(dest_url)
    if problem := info.problem(store):
        return problem
    samples: dict[str, set[str]] = {}
    try:
        with store.open(info.name) as f:
            for name, data in members(f):
                key, _, ext = name.partition(".")
                if "/" in name or ".." in name or not key:
                    return f"bad member name {name!r}"
                if ext not in ("jpg", "cls"):  # a .pyd or .pickle would even be unpickled by a reader
                    return f"unexpected member {name!r}: a shard holds only <key>.jpg and <key>.cls"
                if ext in samples.setdefault(key, set()):
                    return f"duplicate key {key!r}: {name} is in the shard twice"
                samples[key].add(ext)
                if ext == "jpg":
                    with Image.open(io.BytesIO(data)) as img:
                        img.load()
                elif (label := _label(data)) is None or not 0 <= label < num_classes:
                    shown = data[:20].decode(errors="replace")
                    return f"{name}: label {shown!r} is not a class of the manifest (0..{num_classes - 1})"
    except (OSError, ValueError, tarfile.TarError, Image.DecompressionBombError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if incomplete := [k for k, exts in samples.items() if len(exts) < 2]:
        return f"sample {incomplete[0]!r} lacks its .{({'jpg', 'cls'} - samples[incomplete[0]]).pop()}"
    if len(samples) != info.samples:
        return f"{len(samples)} samples != manifest {info.samples}"
    return None


def _label(data: bytes) -> int | None:
    try:
        return int(data)
    except ValueError:
        return None


def verify(dest_url: str, workers: int) -> dict[str, str]:
    """Problems by shard name (empty when all is well)."""
    store = open_store(dest_url)
    manifest = load_manifest(store)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    problems: dict[str, str] = {}
    with worker_pool(workers) as pool:
        futures = {pool.submit(check_shard, dest_url, s, len(manifest.classes)): s for s in shards}
        with progress.bar(len(futures), f"verify {dest_url}", "shards") as bar:
            for future in as_completed(futures):
                if problem := future.result():
                    problems[futures[future].name] = problem
                bar.update()
    return problems
