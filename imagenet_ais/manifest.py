"""manifest.json: the one file that says which shards make a dataset.

Written last by the converter, read first by everything else. A reader that finds a
manifest can rely on every shard it names being complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from imagenet_ais.storage import Store

MANIFEST = "manifest.json"
FORMAT = "imagenet-ais-shards"
VERSION = 1


@dataclass
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str
    plan: str  # digest of the inputs this shard was built from (resume matches on it)


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

    def to_json(self) -> str:
        splits = {
            name: {"samples": split.samples, "bytes": split.bytes, **asdict(split)}
            for name, split in self.splits.items()
        }
        doc = {"format": FORMAT, "version": VERSION, "classes": self.classes, "splits": splits, "source": self.source}
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} manifest")
            if doc.get("version") != VERSION:
                raise ValueError(f"manifest version {doc.get('version')} (this tool reads {VERSION})")
            splits = {
                name: SplitInfo([ShardInfo(**s) for s in split["shards"]], list(split["rejected"]))
                for name, split in doc["splits"].items()
            }
            return cls(list(doc["classes"]), splits, dict(doc.get("source", {})))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: unreadable manifest ({e}); re-run `imagenet_shards.py convert`") from e

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise ValueError(f"manifest has no {name!r} split (it has: {', '.join(self.splits) or 'none'})")
        return self.splits[name]


def load_manifest(store: Store) -> Manifest:
    if not store.exists(MANIFEST):
        raise FileNotFoundError(
            f"no {MANIFEST} in {store.url}: point --data at a directory made by `imagenet_shards.py convert`"
        )
    return Manifest.from_json(store.read_bytes(MANIFEST).decode(), f"{store.url}/{MANIFEST}")


def brace_pattern(names: list[str]) -> str:
    """``a-000.tar, a-001.tar, a-002.tar`` → ``a-{000..002}.tar`` (the seeds' shardsum)."""
    if not names:
        return "(no shards)"
    parsed = [re.fullmatch(r"(.*?)(\d+)(\D*)", n) for n in names]
    if all(parsed):
        heads = {(m.group(1), m.group(3), len(m.group(2))) for m in parsed}
        numbers = sorted(int(m.group(2)) for m in parsed)
        if len(heads) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            head, tail, width = heads.pop()
            if len(numbers) == 1:
                return names[0]
            return f"{head}{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}{tail}"
    return " ".join(names)
