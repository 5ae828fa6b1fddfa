"""``imagenet_shards.py index``: a manifest for WebDataset shards another tool wrote, where they are.

Each shard is read once, in worker processes: its bytes counted and hashed (SHA-256), its
members judged by their headers (members.py), its samples grouped by key as the loader groups
them and judged by the label rule (labels.py): a sample without an image or a readable label is
listed as rejected, with its reason, and not counted. The shards are never written, moved or
deleted. The manifest goes beside them, or to another location (``manifest_to``) where theirs
is read-only; it then names where the shards are (``Manifest.shards_at``).

An interrupted index goes on where it stopped: each shard's result is a record in ``_index/``
at the manifest's location, taken again while its shard's size and the settings are the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

from webdataset.tariterators import base_plus_ext, group_by_keys

from imagenet_ais.children import worker_pool
from imagenet_ais.errors import ConfigError, DataError, NotFound
from imagenet_ais.shards import progress
from imagenet_ais.shards.labels import LabelRule
from imagenet_ais.shards.layouts import Layout, find_layout
from imagenet_ais.shards.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo
from imagenet_ais.shards.members import members
from imagenet_ais.storage import HashingReader, Store, is_local, open_store, process_store
from imagenet_ais.storage.locks import lock_dest

JOURNAL = "_index/"  # all ours: a record per shard indexed, gone once the manifest is up
PLAN = "indexed"  # a ShardInfo's plan: made by no plan of ours


@dataclass
class ShardIndex:
    """What one read of a shard found: its bytes, its usable samples' labels (JSON-encoded raw
    values → count), the samples rejected; or, for a shard that cannot be read, the problem."""

    name: str
    bytes: int
    sha256: str = ""
    samples: int = 0
    labels: dict[str, int] = field(default_factory=dict)
    rejected: list[dict[str, str]] = field(default_factory=list)
    problem: str = ""


def index_shard(location: str, name: str, rule: LabelRule) -> ShardIndex:
    """Read shard ``name`` of ``location`` once (in a worker process)."""
    store = process_store(location)
    size = store.size(name)
    found = ShardIndex(name, size)
    keys: dict[str, bool] = {}  # every key seen → whether a member the rule reads has it
    errors: list[Exception] = []
    try:
        raw = store.open(name)
    except OSError as e:  # (the store's reads after their retries)
        found.problem = f"could not be read ({e})"
        return found
    with raw:
        stream = HashingReader(raw)
        for sample in group_by_keys(_files(stream, name, rule, keys, errors), handler=errors.append):
            if problem := rule.problem(sample):
                found.rejected.append({"path": f"{name}#{sample['__key__']}", "reason": problem})
                continue
            found.samples += 1
            label = json.dumps(rule.value(sample))
            found.labels[label] = found.labels.get(label, 0) + 1
        if not errors:
            stream.read_to_end()
    if errors:
        found.problem = f"unreadable from sample {found.samples + len(found.rejected)} on ({errors[0]})"
    elif stream.count != size:
        found.problem = f"read {stream.count:,} bytes, its size is {size:,}: changed while it was read"
    found.sha256 = stream.sha.hexdigest()
    found.rejected += [
        {"path": f"{name}#{key}", "reason": f"no image or .{rule.member} member"}
        for key, read in keys.items()
        if not read
    ]
    return found


def _files(
    stream: HashingReader, name: str, rule: LabelRule, keys: dict[str, bool], errors: list[Exception]
) -> Iterator[dict]:
    """The members the rule reads, as the loader takes them (worker.py), noting every key seen."""
    try:
        for member, data in members(cast(BinaryIO, stream)):  # (tarfile only reads it)
            key, ext = base_plus_ext(member)
            if key is None:
                continue
            wanted = ext.lower() in rule.exts
            keys[key] = keys.get(key, False) or wanted
            if wanted:
                yield {"fname": member, "data": data, "__url__": name}
    except Exception as e:  # the storage SDKs raise their own errors mid-read; tarfile its own
        errors.append(e)


def index(
    location: str,
    *,
    manifest_to: str | None = None,
    patterns: list[tuple[str, str]] | None = None,
    label: str = "cls",
    classes_file: Path | None = None,
    workers: int = 1,
) -> Manifest:
    """Index the shards at ``location`` (see the module's docstring); the manifest written."""
    rule = LabelRule.parse(label)
    given = _classes_file(classes_file) if classes_file else None
    store, dest = open_store(location), open_store(manifest_to) if manifest_to else None
    shards_at = absolute(location) if dest else ""
    dest = dest or store
    _writable(dest, manifest_to is not None)
    layout = find_layout(store, patterns or [])
    settings = hashlib.sha256(json.dumps([shards_at or location, str(rule)]).encode()).hexdigest()[:16]
    with lock_dest(dest) as lock:
        _not_converted(dest)
        found = _read_all(store, dest, layout, rule, settings, workers)
        lock.check()
        manifest = _manifest(layout, found, rule, given, shards_at, classes_file)
        dest.write_bytes(MANIFEST, manifest.to_json().encode())
        for name in dest.list(JOURNAL):
            dest.delete(name)
    return manifest


def _read_all(
    store: Store, dest: Store, layout: Layout, rule: LabelRule, settings: str, workers: int
) -> dict[str, ShardIndex]:
    """Every shard of the layout read (or its record of an interrupted run taken again)."""
    names = [n for shards in layout.splits.values() for n in shards]
    found = _records(store, dest, settings)
    todo = [n for n in names if n not in found]
    for name in todo:
        if not store.exists(name):
            raise NotFound(f"{store.url}/{name}: no such shard (named by {layout.found_by})")
    if len(todo) < len(names):
        print(f"index: {len(names) - len(todo)} shards indexed before, {len(todo)} to go", flush=True)
    with worker_pool(workers) as pool:
        futures = [pool.submit(index_shard, store.url, name, rule) for name in todo]
        with progress.bar(sum(store.size(n) for n in todo), f"index {store.url}", "B", unit_scale=True) as bar:
            for future in as_completed(futures):
                shard = future.result()
                dest.write_bytes(_record_name(shard.name), json.dumps([settings, asdict(shard)]).encode())
                found[shard.name] = shard
                bar.update(shard.bytes)
    return found


def _records(store: Store, dest: Store, settings: str) -> dict[str, ShardIndex]:
    """The records of an interrupted run with these settings, each while its shard's size is the
    same (a shard changed since is read again, and said so)."""
    found: dict[str, ShardIndex] = {}
    for record in dest.list(JOURNAL):
        try:
            made_with, fields = json.loads(dest.read_bytes(record))
            shard = ShardIndex(**fields)
        except (ValueError, TypeError):
            continue  # (a record from another version, or cut short: read the shard again)
        if made_with != settings or not store.exists(shard.name):
            continue
        if store.size(shard.name) != shard.bytes:
            print(f"index: {store.url}/{shard.name} changed since it was indexed: reading it again", flush=True)
            continue
        found[shard.name] = shard
    return found


def _record_name(shard: str) -> str:
    return f"{JOURNAL}{hashlib.sha256(shard.encode()).hexdigest()[:24]}.json"


def _manifest(
    layout: Layout,
    found: dict[str, ShardIndex],
    rule: LabelRule,
    given: list[str] | None,
    shards_at: str,
    classes_file: Path | None,
) -> Manifest:
    """The manifest of what was found: the classes (``given``, else from the labels), each
    split's readable shards and its counts per class, what was rejected."""
    values = {json.loads(v) for shard in found.values() for v in shard.labels}
    classes = _classes(values, given)
    index_of = {c: i for i, c in enumerate(classes)}
    splits: dict[str, SplitInfo] = {}
    counts: dict[str, list[dict[str, int]]] = {}
    for split, names in layout.splits.items():
        splits[split], counts[split] = SplitInfo(), []
        for name in names:
            shard = found[name]
            splits[split].rejected += shard.rejected
            if shard.problem:
                splits[split].rejected.append({"path": name, "reason": f"left out: {shard.problem}"})
                continue
            splits[split].shards.append(ShardInfo(name, shard.samples, shard.bytes, shard.sha256, PLAN))
            per_class: dict[str, int] = {}
            for value, n in shard.labels.items():
                raw = json.loads(value)
                cls = str(raw if isinstance(raw, int) else index_of[raw])
                per_class[cls] = per_class.get(cls, 0) + n
            counts[split].append(per_class)
        if not splits[split].samples:
            raise DataError(f"the {split} split has no sample the label rule {rule} can read (see its rejected list)")
    source: dict[str, object] = {"made_by": "index", "layout": layout.describe(), "labels": str(rule)}
    if classes_file:
        source["classes_from"] = classes_file.name
    return Manifest(classes, splits, source, labels=str(rule), shards_at=shards_at, class_counts=counts)


def _classes(values: set[int | str], given: list[str] | None) -> list[str]:
    """The class names: ``given``'s (which must cover every label), else the names the labels
    are, sorted, else the indices written as names."""
    indices = sorted(v for v in values if isinstance(v, int))
    names = sorted(v for v in values if isinstance(v, str))
    if given is not None:
        if indices and indices[-1] >= len(given):
            raise ConfigError(f"label {indices[-1]} is past the {len(given)} classes of --classes: give the whole list")
        if missing := [n for n in names if n not in given]:
            raise ConfigError(f"label {missing[0]!r} (and {len(missing) - 1} more) is not in --classes: add it")
        return given
    if indices and names:
        raise ConfigError(
            f"the labels are class indices ({indices[0]}, ...) and names ({names[0]!r}, ...): give --classes FILE, "
            "one name per line, line i naming index i"
        )
    return names or [str(i) for i in range(indices[-1] + 1 if indices else 0)]


def _classes_file(path: Path) -> list[str]:
    """``--classes FILE``: one name per line (blank lines and surrounding spaces ignored)."""
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise ConfigError(f"--classes {path}: no class names in it (one per line)")
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"--classes {path}: {twice!r} is named twice: one line per class")
    return names


def _writable(dest: Store, elsewhere: bool) -> None:
    """A one-line ConfigError where the manifest cannot be written at ``dest`` (http)."""
    try:
        dest.list(JOURNAL)
    except ConfigError:
        raise ConfigError(
            f"{dest.url} is read-only: give --manifest-to a location to write the manifest to (a directory, or "
            "ais://, gs://, s3://), and train with --data that location"
            if not elsewhere
            else f"--manifest-to {dest.url}: read-only; give a directory or a bucket"
        ) from None


def _not_converted(dest: Store) -> None:
    """A location whose manifest ``convert`` wrote is left as it is: its shards are ours already."""
    if not dest.exists(MANIFEST):
        return
    try:
        made_by = json.loads(dest.read_bytes(MANIFEST)).get("source", {}).get("made_by")
    except (ValueError, AttributeError):
        made_by = None
    if made_by != "index":
        raise ConfigError(
            f"{dest.url} holds a manifest index did not write: its shards need no index (or give --manifest-to "
            "another location)"
        )


def absolute(location: str) -> str:
    """``location`` as a URL any process can open: a directory's absolute path."""
    return os.path.abspath(location.removeprefix("file://")) if is_local(location) else location.rstrip("/")
