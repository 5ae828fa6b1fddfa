"""manifest.json: the one file that says which shards make a dataset.

Written last by the converter, read first by everything else. A reader that finds a
manifest can rely on every shard it names being complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import get_type_hints

from imagenet_ais.errors import DataError, NotFound, Refused
from imagenet_ais.shards.labels import LabelRule
from imagenet_ais.storage import Store, is_inside, open_store, stream_sha256

MANIFEST = "manifest.json"
FORMAT = "imagenet-ais-shards"
VERSION = 1
MIN_SAMPLE_BYTES = 1024  # a sample's tar: two members (image, class), each a 512-byte header and a block


@dataclass
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str
    plan: str  # digest of the inputs this shard was built from (resume matches on it)

    def size_problem(self, store: Store) -> str | None:
        """None when ``store`` holds this shard at its size; else what is wrong (cheap: no reading)."""
        if not store.exists(self.name):
            return "missing"
        if (size := store.size(self.name)) != self.bytes:
            return f"size {size} != manifest {self.bytes}"
        return None

    def problem(self, store: Store) -> str | None:
        """None when ``store`` holds this shard intact (its size, then its SHA-256); else what is wrong."""
        if problem := self.size_problem(store):
            return problem
        if (digest := stream_sha256(store.open(self.name))) != self.sha256:
            return f"sha256 {digest[:12]}… != manifest {self.sha256[:12]}…"
        return None


@dataclass
class SplitInfo:
    shards: list[ShardInfo] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


@dataclass
class Manifest:
    classes: list[str]
    splits: dict[str, SplitInfo]
    source: dict[str, object] = field(default_factory=dict)
    labels: str = "cls"  # which member holds a sample's label (labels.py: cls, txt, json:FIELD)
    shards_at: str = ""  # where the shards are, where not beside the manifest (index --manifest-to)
    # per split, each shard's samples by class index ({"12": 300}): what the shuffle-quality figure reads
    class_counts: dict[str, list[dict[str, int]]] = field(default_factory=dict)

    def to_json(self) -> str:
        splits = {
            name: {"samples": split.samples, "bytes": split.bytes, **asdict(split)}
            for name, split in self.splits.items()
        }
        doc = {"format": FORMAT, "version": VERSION, "classes": self.classes, "splits": splits, "source": self.source}
        extra = {"labels": self.labels if self.labels != "cls" else "", "shards_at": self.shards_at}
        doc |= {k: v for k, v in {**extra, "class_counts": self.class_counts}.items() if v}
        return json.dumps(doc, indent=1) + "\n"

    def shards_location(self, at: str) -> str:
        """Where the shards of the manifest found at ``at`` are."""
        return self.shards_at or at

    def label_rule(self) -> LabelRule:
        return LabelRule.parse(self.labels)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
        try:
            doc = _object(json.loads(text), "the file")
            if doc.get("format") != FORMAT:
                raise DataError(f"not a {FORMAT} manifest")
            if doc.get("version") != VERSION:
                raise DataError(f"manifest version {doc.get('version')} (this tool reads {VERSION})")
            classes = doc["classes"]
            if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
                raise DataError(f'"classes" is {_short(classes)}, not a list of class names')
            splits = {}
            for name, split in _object(doc["splits"], '"splits"').items():
                split = _object(split, f"split {name!r}")
                shards = split["shards"]
                if not isinstance(shards, list):
                    raise DataError(f'"shards" of {name!r} is {_short(shards)}, not a list')
                splits[name] = SplitInfo(
                    [_shard(s, f"shard {i} of {name!r}") for i, s in enumerate(shards)],
                    _rejected(split["rejected"], f'"rejected" of {name!r}'),
                )
                _check_shards(splits[name].shards, name)
            extra = _extras(doc, splits)
            return cls(classes, splits, _object(doc.get("source", {}), '"source"'), **extra)
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: unreadable manifest ({e}); re-run `imagenet_shards.py convert`") from e
        except RecursionError:  # (json nested past Python's stack: no manifest is)
            raise DataError(
                f"{where}: unreadable manifest (nested too deep); re-run `imagenet_shards.py convert`"
            ) from None

    def is_demo(self) -> bool:
        """Made from ``synth``'s small pictures of random sizes (the demo): ``./run`` gives such data
        its demo settings (a small model at 64 px), wherever the shards were copied."""
        made = self.source.get("synthetic")
        return isinstance(made, dict) and made.get("size") is None

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise DataError(f"manifest has no {name!r} split (it has: {', '.join(self.splits) or 'none'})")
        return self.splits[name]


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _object(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{what} is {_short(value)}, not an object")
    return value


def _shard(fields: object, where: str) -> ShardInfo:
    """A ShardInfo once each field is there with its declared type (bool is no int here)."""
    fields, hints = _object(fields, where), get_type_hints(ShardInfo)
    for name in [*hints, *fields]:
        if name not in hints or name not in fields:
            raise DataError(f"{where}: {'no' if name in hints else 'unknown field'} {name!r}")
        if not isinstance(value := fields[name], hints[name]) or (hints[name] is int and isinstance(value, bool)):
            raise DataError(f"{where}: {name!r} is {_short(value)}, not {hints[name].__name__}")
    return ShardInfo(**fields)


def _extras(doc: dict, splits: dict[str, SplitInfo]) -> dict:
    """The fields of an indexed set's manifest (index.py), checked: its label rule, where its
    shards are, its class counts (one {class index: samples} per shard of each split)."""
    labels, shards_at = doc.get("labels", "cls"), doc.get("shards_at", "")
    if not isinstance(labels, str) or not isinstance(shards_at, str):
        raise DataError(f'"labels" or "shards_at" is {_short([labels, shards_at])}, not text')
    LabelRule.parse(labels)
    counts = _object(doc.get("class_counts", {}), '"class_counts"')
    for name, per_shard in counts.items():
        if name not in splits or not isinstance(per_shard, list) or len(per_shard) != len(splits[name].shards):
            raise DataError(f'"class_counts" of {name!r} does not list one object per shard of the split')
        if not all(isinstance(c, dict) and all(_count(k, n) for k, n in c.items()) for c in per_shard):
            raise DataError(f'"class_counts" of {name!r} holds other than {{class: count}} objects')
    return {"labels": labels, "shards_at": shards_at, "class_counts": counts}


def _count(cls: str, samples: object) -> bool:
    """A class count's entry: a class index (digits) and a count (an int, not a bool)."""
    return cls.isascii() and cls.isdigit() and isinstance(samples, int) and not isinstance(samples, bool)


def _rejected(entries: object, what: str) -> list[dict[str, str]]:
    if not isinstance(entries, list) or not all(isinstance(r, dict) for r in entries):
        raise DataError(f"{what} is {_short(entries)}, not a list of objects")
    return entries


def record_json(info: ShardInfo, rejected: list[dict[str, str]]) -> bytes:
    """A journal record: a shard built, and the inputs it rejected (see convert.py)."""
    return json.dumps({"shard": asdict(info), "rejected": rejected}).encode()


def parse_record(data: bytes, where: str) -> tuple[ShardInfo, list[dict[str, str]]]:
    """A journal record, checked field by field as the manifest's shard entries are."""
    try:
        doc = _object(json.loads(data), "the file")
        return _shard(doc.get("shard"), '"shard"'), _rejected(doc.get("rejected"), '"rejected"')
    except ValueError as e:  # (JSON errors are ValueErrors too)
        raise DataError(
            f"{where}: unreadable journal record ({e}): remove it and the shard it names, then run convert again"
        ) from e


def _check_shards(shards: list[ShardInfo], split: str) -> None:
    """Names and counts a reader can trust: each name a path inside the location, no count
    negative, no shard listed twice."""
    seen: set[str] = set()
    for i, shard in enumerate(shards):
        # a store's rule, and more: a manifest names files (no empty or "." parts), each printable
        if not is_inside(shard.name) or {"", "."} & set(shard.name.split("/")) or not shard.name.isprintable():
            raise DataError(f"shard {i} of {split!r}: {shard.name!r} is no name of a file inside the shards' location")
        if shard.samples < 0 or shard.bytes < 0 or shard.samples * MIN_SAMPLE_BYTES > shard.bytes:
            raise DataError(
                f"shard {i} of {split!r}: {shard.samples} samples in {shard.bytes} bytes cannot be (a sample takes at "
                f"least {MIN_SAMPLE_BYTES} bytes of tar): the manifest is damaged; convert again"
            )
        if shard.name in seen:
            raise DataError(f"shard {i} of {split!r}: {shard.name!r} is listed twice")
        seen.add(shard.name)


def load_manifest(store: Store) -> Manifest:
    if not store.exists(MANIFEST):
        raise NotFound(
            f"no {MANIFEST} in {store.url}: give the location of shards made by `imagenet_shards.py convert` (a "
            "directory, or its ais://, gs://, s3:// or http(s):// copy); for WebDataset shards another tool made, "
            "write one with `imagenet_shards.py index LOCATION`"
        )
    return Manifest.from_json(store.read_bytes(MANIFEST).decode(), f"{store.url}/{MANIFEST}")


def brace_pattern(names: list[str]) -> str:
    """``a-000.tar, a-001.tar, a-002.tar`` → ``a-{000..002}.tar`` (the seeds' shardsum)."""
    if not names:
        return "(no shards)"
    parsed = [m for n in names if (m := re.fullmatch(r"(.*?)(\d+)(\D*)", n))]
    if len(parsed) == len(names):
        heads = {(m.group(1), m.group(3), len(m.group(2))) for m in parsed}
        numbers = sorted(int(m.group(2)) for m in parsed)
        if len(heads) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            head, tail, width = heads.pop()
            if len(numbers) == 1:
                return names[0]
            return f"{head}{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}{tail}"
    return " ".join(names)


def is_demo_at(location: str) -> bool:
    """Whether ``location`` holds the demo's shards (see ``Manifest.is_demo``); False where it cannot
    be read: the run that follows says why."""
    try:
        return load_manifest(open_store(location)).is_demo()
    except Refused:
        return False
