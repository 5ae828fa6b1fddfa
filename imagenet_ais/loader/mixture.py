"""Several shard sets trained as one, each by its weight: the training split the engine reads.

A source is a shard location and a weight. Its classes are merged with the others' by name (the
first source's in its order, then each new name as it first appears), and its labels remapped to
the merged list. What a weight means:

- resampled epochs draw each source's samples in proportion to its weight (Streaming's
  ``proportion``, webdataset's ``RandomMix``): with weights 3 and 1, three quarters of an epoch's
  samples are the first source's, whatever their sizes. An epoch is, unless ``epoch_size`` says
  otherwise, as many samples as the sources hold together.
- exact epochs take weight × samples of each source, every epoch: its whole part as that many
  passes over every sample (Streaming's ``repeat``), the rest as a run of that share of each shard,
  drawn again each epoch (its ``choose``). Weight 1 is every sample once, 2 each twice, 0.25 a
  quarter of them, a different quarter each epoch.

The engine sees one list of shards. In exact mode a source of weight 2.5 lists its shards three
times: two whole copies and one of which each epoch takes a run (``Shards.runs``), so the
positions of an epoch (sampling.py) name a copy's samples apart from another's, and carry over
to any world size as a single source's do.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from imagenet_ais.errors import ConfigError, DataError
from imagenet_ais.shards.manifest import Manifest, ShardInfo, SplitInfo


@dataclass(frozen=True)
class Source:
    """A shard location and its weight in the mixture."""

    location: str
    weight: float = 1.0


def sources_of(given: object) -> list[Source]:
    """``ShardLoader``'s location: one location, or several as ``(location, weight)`` pairs or
    bare locations (weight 1). A bad weight or a location given twice is a one-line ConfigError."""
    if isinstance(given, str | os.PathLike):
        return [Source(os.fspath(given))]
    if not isinstance(given, Sequence) or not given:
        raise ConfigError(f"location={given!r}: give a shard location, or a list of them as (location, weight) pairs")
    sources = [_source(item) for item in given]
    seen: dict[str, str] = {}
    for source in sources:
        key = _same(source.location)
        if key in seen:
            raise ConfigError(
                f"{source.location}: given twice in the mixture (as {seen[key]}): give each location once, "
                "with the weight it should have"
            )
        seen[key] = source.location
    return sources


def _source(item: object) -> Source:
    if isinstance(item, str | os.PathLike):
        return Source(os.fspath(item))
    if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], str | os.PathLike)):
        raise ConfigError(f"{item!r} in the mixture: give (location, weight) pairs or locations")
    return Source(os.fspath(item[0]), checked_weight(item[1], os.fspath(item[0])))


def checked_weight(weight: object, location: str) -> float:
    """``weight`` as a float above 0, else a one-line ConfigError naming ``location``."""
    value = float(weight) if isinstance(weight, int | float) and not isinstance(weight, bool) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{location}: weight {weight!r} in the mixture: give a number above 0 (e.g. 1, 0.5, 2)")
    return value


def parse_source(text: str) -> Source:
    """A command line's ``LOCATION[:WEIGHT]``: the weight is what follows the last colon, where
    that is a number and not a URL's port (``http://host:8080`` is a location)."""
    head, colon, tail = text.rpartition(":")
    if not colon or not head or "/" in tail or head.endswith(":/") or _bare_host(head):
        return Source(text)
    try:
        weight = float(tail)
    except ValueError:
        return Source(text)
    return Source(head, checked_weight(weight, head))


def _bare_host(head: str) -> bool:
    """``scheme://host`` with no path: what follows its colon is a port."""
    scheme, sep, rest = head.partition("://")
    return bool(sep) and scheme.isalpha() and "/" not in rest


def _same(location: str) -> str:
    """What two spellings of one location share (a directory's absolute path, a URL less its last '/')."""
    if "://" in location and not location.startswith("file://"):
        return location.rstrip("/")
    return os.path.abspath(location.removeprefix("file://"))


def merged_classes(manifests: list[Manifest], locations: list[str], given: list[str] | None = None) -> list[str]:
    """The classes of several manifests merged by name: ``given`` (which must hold them all), or
    the first manifest's in its order, then each new name as it first appears. A manifest that
    names a class twice is a one-line ConfigError: its labels would not say which is meant."""
    for manifest, location in zip(manifests, locations, strict=True):
        if len(set(manifest.classes)) < len(manifest.classes):
            twice = next(c for c in manifest.classes if manifest.classes.count(c) > 1)
            raise ConfigError(
                f"{location}: its manifest names class {twice!r} more than once, so its labels cannot be mapped "
                "by name to the other sources': convert it with one name per class"
            )
    if given is not None:
        for manifest, location in zip(manifests, locations, strict=True):
            if missing := [c for c in manifest.classes if c not in given]:
                raise ConfigError(
                    f"{location}: class {missing[0]!r} (and {len(missing) - 1} more) is not among the {len(given)} "
                    "classes given: train on a list that holds every class of the data"
                )
        return list(given)
    merged = dict.fromkeys(c for manifest in manifests for c in manifest.classes)
    return list(merged)


@dataclass
class Shards:
    """A training or validation split as the engine reads it: the shards of one source or of a
    mixture, each with its source (its location and label map) and, in exact mode, a share of it
    each epoch."""

    names: list[str]
    counts: list[int]
    listed: list[tuple[int, str]]  # each shard's bytes and SHA-256 in its manifest
    source: list[int]  # each shard's source (an index into ``locations``)
    locations: list[str]
    remaps: list[list[int] | None]  # per source: its label → the merged list's (None: the same)
    infos: list[dict[str, ShardInfo]]  # per source: its shards by name (the node's cache checks them)
    draws: list[float] | None = None  # resampled: each shard's chance to be drawn (None: by its count)
    taken: list[int] | None = None  # exact: samples of each shard an epoch takes (None: all)
    copies: list[int] | None = None  # exact: which pass over its source each shard is (0 the first)
    weights: list[float] = field(default_factory=lambda: [1.0])

    @property
    def samples(self) -> int:
        """Samples an exact epoch takes; a resampled one's shards' count."""
        return sum(self.taken) if self.taken is not None else sum(self.counts)

    @property
    def bytes(self) -> int:
        return sum(b for b, _ in self.listed)

    def runs(self, shard: int, seed: int, epoch: int) -> list[range]:
        """The samples of ``shard`` epoch ``epoch`` takes: all, or a run of ``taken`` of them from a
        point drawn for the epoch (wrapping round the shard's end)."""
        count = self.counts[shard]
        take = count if self.taken is None else self.taken[shard]
        if take >= count:
            return [range(count)]
        start = random.Random(f"choose:{seed}:{epoch}:{shard}").randrange(count)
        end = start + take
        return [range(start, min(end, count)), *([range(end - count)] if end > count else [])]

    def drawn_as(self, shard: int, key: str) -> str:
        """The name a sample's crop, flip and augmentation are drawn by (with the seed and epoch):
        its key, and in a second or later pass over its source in one epoch, the pass's number."""
        copy = self.copies[shard] if self.copies else 0
        return f"{key}#{copy}" if copy else key

    def where(self, shard: int) -> str:
        return f"{self.locations[self.source[shard]]}/{self.names[shard]}"

    def label(self, shard: int, label: int) -> int:
        """A label of ``shard`` in the merged classes; one its manifest does not have: DataError."""
        remap = self.remaps[self.source[shard]]
        if remap is None:
            return label
        if not 0 <= label < len(remap):
            raise DataError(f"label {label} is not among its manifest's {len(remap)} classes")
        return remap[label]


def one_source(split: SplitInfo, location: str, remap: list[int] | None = None) -> Shards:
    """The shards of one location, as they are (their labels mapped by ``remap``, if any)."""
    return Shards(
        [s.name for s in split.shards], [s.samples for s in split.shards], [(s.bytes, s.sha256) for s in split.shards],
        [0] * len(split.shards), [location], [remap], [{s.name: s for s in split.shards}],
    )  # fmt: skip


def shards_of(
    sources: list[Source], manifests: list[Manifest], split: str, mode: str, classes: list[str] | None
) -> tuple[Shards, list[str]]:
    """The shards ``split`` of ``sources`` reads, and the classes its labels are in (merged, or ``classes``)."""
    locations = [s.location for s in sources]
    merged = merged_classes(manifests, locations, classes)
    if len(sources) == 1 and sources[0].weight == 1:
        return one_source(manifests[0].split(split), locations[0], remap(manifests[0].classes, merged)), merged
    if split != "train":
        raise ConfigError(
            f"the {split} split of a mixture of {len(sources)} sources: {split} reads one location; give it alone"
        )
    return mixed(sources, manifests, merged, mode), merged


def mixed(sources: list[Source], manifests: list[Manifest], classes: list[str], mode: str) -> Shards:
    """The training shards of several sources as one list (module docstring): in exact mode a
    source's shards once per whole or part of its weight, each copy's share of its shards in
    ``taken``; in resampled mode once each, with the chance to be drawn that gives its source
    its weight's share of the samples (a shard drawn gives all its samples, and shards are drawn
    by their counts within a source: so by count / the sum of its shards' squared counts)."""
    names: list[str] = []
    counts: list[int] = []
    listed: list[tuple[int, str]] = []
    source_of: list[int] = []
    taken: list[int] = []
    copy_of: list[int] = []
    draws: list[float] = []
    splits = [m.split("train") for m in manifests]
    for s, (source, split) in enumerate(zip(sources, splits, strict=True)):
        total, squares = split.samples, sum(sh.samples**2 for sh in split.shards)
        if total == 0:
            raise ConfigError(f"{source.location}: its training split has no samples: leave it out of the mixture")
        whole, part = divmod(source.weight, 1.0) if mode == "exact" else (1.0, 0.0)
        copies = [1.0] * int(whole) + ([part] if part > 1e-9 else [])
        for copy, share in enumerate(copies):
            shares = _apportioned([sh.samples for sh in split.shards], round(share * total))
            for shard, k in zip(split.shards, shares, strict=True):
                names.append(shard.name)
                counts.append(shard.samples)
                listed.append((shard.bytes, shard.sha256))
                source_of.append(s)
                taken.append(k)
                copy_of.append(copy)
                # a draw is a whole shard, by its count: its source's draws give weight-many samples
                draws.append(source.weight * shard.samples / squares)
    remaps = [remap(m.classes, classes) for m in manifests]
    infos = [{sh.name: sh for sh in split.shards} for split in splits]
    return Shards(
        names, counts, listed, source_of, [s.location for s in sources], remaps, infos,
        draws=draws if mode != "exact" else None, taken=taken if mode == "exact" else None,
        copies=copy_of if mode == "exact" else None, weights=[s.weight for s in sources],
    )  # fmt: skip


def _apportioned(counts: list[int], total: int) -> list[int]:
    """``total`` split among shards in proportion to their ``counts`` (largest remainders): each
    shard's share of a part-copy, so the copy takes exactly ``total`` samples."""
    whole = sum(counts)
    exact = [c * total / whole for c in counts]
    shares = [math.floor(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: shares[i] - exact[i])[: total - sum(shares)]:
        shares[i] += 1
    return shares


def remap(theirs: list[str], merged: list[str]) -> list[int] | None:
    """Each of ``theirs``' indices in ``merged`` (None: the same)."""
    index = {c: i for i, c in enumerate(merged)}
    indices = [index[c] for c in theirs]
    return None if indices == list(range(len(theirs))) else indices
