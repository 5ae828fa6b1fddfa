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
import numbers
import os
import posixpath
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal

from imagenet_ais.errors import ConfigError, DataError
from imagenet_ais.shards.labels import LabelRule
from imagenet_ais.shards.manifest import Manifest, ShardInfo, SplitInfo

# exact mode: a source's passes an epoch at most (its shards are listed once per pass: 1e9 is no plan)
MAX_PASSES = 1000


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
    """``weight`` (any real number: int, float, numpy's, Fraction) as a float above 0, else a
    one-line ConfigError naming ``location``."""
    try:
        value = float(weight) if isinstance(weight, numbers.Real) and not isinstance(weight, bool) else math.nan
    except OverflowError:  # (an int or Fraction beyond a float's range)
        value = math.inf
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
    """What two spellings of one location share: a directory's real path (links, '//' and '.'
    resolved), an HTTP URL's host in lower case and path less '.' and repeated or last '/' (as
    the server reads it), another URL less its last '/'. Other spellings still (localhost for
    127.0.0.1, a copy) are told by their manifests (``mixed``)."""
    scheme, sep, rest = location.partition("://")
    if not sep or scheme == "file":
        return os.path.realpath(rest if sep else location)
    if scheme in ("http", "https"):
        host, _, path = rest.partition("/")
        return f"{scheme}://{host.lower()}{posixpath.normpath(re.sub('/+', '/', f'/{path}')).rstrip('/')}"
    return location.rstrip("/")


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
    # per source: the rule its labels are read by, and its class names' indices (for labels that are names)
    rules: list[LabelRule] = field(default_factory=lambda: [LabelRule()])
    class_ids: list[dict[str, int]] = field(default_factory=lambda: [{}])

    @property
    def samples(self) -> int:
        """Samples an exact epoch takes; a resampled one's shards' count."""
        return sum(self.taken) if self.taken is not None else sum(self.counts)

    @property
    def mixed(self) -> bool:
        """Whether these are a mixture's: several sources, or one by a weight other than 1."""
        return len(self.locations) > 1 or self.weights != [1.0]

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
        return f"{self.locations[self.source[shard]].rstrip('/')}/{self.names[shard]}"

    def rule(self, shard: int) -> LabelRule:
        """The rule ``shard``'s labels are read by."""
        return self.rules[self.source[shard]]

    def label_of(self, shard: int, sample: dict) -> int:
        """A sample's label in the merged classes (labels.py reads it by its source's rule); a
        ValueError (DataError) where its manifest has no such class."""
        return self.label(shard, self.rule(shard).index(sample, self.class_ids[self.source[shard]]))

    def label(self, shard: int, label: int) -> int:
        """A label of ``shard`` in the merged classes; one its manifest does not have: DataError."""
        remap = self.remaps[self.source[shard]]
        if remap is None:
            return label
        if not 0 <= label < len(remap):
            raise DataError(f"label {label} is not among its manifest's {len(remap)} classes")
        return remap[label]


def one_source(
    split: SplitInfo, location: str, remap: list[int] | None = None, manifest: Manifest | None = None
) -> Shards:
    """The shards of one location, as they are (their labels mapped by ``remap``, if any; read
    by ``manifest``'s rule)."""
    rule, ids = _reading(manifest)
    return Shards(
        [s.name for s in split.shards], [s.samples for s in split.shards], [(s.bytes, s.sha256) for s in split.shards],
        [0] * len(split.shards), [location], [remap], [{s.name: s for s in split.shards}], rules=[rule],
        class_ids=[ids],
    )  # fmt: skip


def _reading(manifest: Manifest | None) -> tuple[LabelRule, dict[str, int]]:
    """How a source's labels are read: its manifest's rule, and its classes by name."""
    if manifest is None:
        return LabelRule(), {}
    return manifest.label_rule(), {c: i for i, c in enumerate(manifest.classes)}


def shards_of(
    sources: list[Source], manifests: list[Manifest], split: str, mode: str, classes: list[str] | None
) -> tuple[Shards, list[str]]:
    """The shards ``split`` of ``sources`` reads, and the classes its labels are in (merged, or ``classes``)."""
    locations = [s.location for s in sources]
    merged = merged_classes(manifests, locations, classes)
    if len(sources) == 1 and sources[0].weight == 1:
        at, manifest = manifests[0].shards_location(locations[0]), manifests[0]
        return one_source(manifest.split(split), at, remap(manifest.classes, merged), manifest), merged
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
    by their counts within a source: so by count / the sum of its shards' squared counts).
    A mixture in which a source would count twice, or get no samples, is a one-line ConfigError."""
    names: list[str] = []
    counts: list[int] = []
    listed: list[tuple[int, str]] = []
    source_of: list[int] = []
    taken: list[int] = []
    copy_of: list[int] = []
    draws: list[float] = []
    splits = [m.split("train") for m in manifests]
    _check_apart(sources, splits)
    shares = _shares(sources, splits) if mode != "exact" else [1.0] * len(sources)
    for s, (source, split) in enumerate(zip(sources, splits, strict=True)):
        squares = sum(sh.samples**2 for sh in split.shards)
        passes = _passes(source, split) if mode == "exact" else [[sh.samples for sh in split.shards]]
        for copy, takes in enumerate(passes):
            for shard, k in zip(split.shards, takes, strict=True):
                names.append(shard.name)
                counts.append(shard.samples)
                listed.append((shard.bytes, shard.sha256))
                source_of.append(s)
                taken.append(k)
                copy_of.append(copy)
                # a draw is a whole shard, by its count: its source's draws give its share of the samples
                draws.append(shares[s] * shard.samples / squares)
    remaps = [remap(m.classes, classes) for m in manifests]
    infos = [{sh.name: sh for sh in split.shards} for split in splits]
    rules, ids = zip(*map(_reading, manifests), strict=True)
    at = [m.shards_location(s.location) for s, m in zip(sources, manifests, strict=True)]
    return Shards(
        names, counts, listed, source_of, at, remaps, infos, draws=draws if mode != "exact" else None,
        taken=taken if mode == "exact" else None, copies=copy_of if mode == "exact" else None,
        weights=[s.weight for s in sources], rules=list(rules), class_ids=list(ids),
    )  # fmt: skip


def _check_apart(sources: list[Source], splits: list[SplitInfo]) -> None:
    """Each source holds training samples, and shards no other source holds under another
    spelling (a link, localhost for 127.0.0.1, a copy: the same names, sizes and SHA-256s)."""
    seen: dict[tuple[tuple[str, int, str], ...], str] = {}
    for source, split in zip(sources, splits, strict=True):
        if split.samples == 0:
            raise ConfigError(f"{source.location}: its training split has no samples: leave it out of the mixture")
        shards = tuple((sh.name, sh.bytes, sh.sha256) for sh in split.shards)
        if shards in seen:
            raise ConfigError(
                f"{source.location}: given twice in the mixture (as {seen[shards]}: its manifest lists the same "
                "shards, names, sizes and SHA-256s): give each shard set once, with the weight it should have"
            )
        seen[shards] = source.location


def _passes(source: Source, split: SplitInfo) -> list[list[int]]:
    """The samples of each shard an exact epoch takes, per pass over the source: its whole
    passes, then its part (a run of that share of each shard). A weight above ``MAX_PASSES``,
    or too small to take one sample, is a one-line ConfigError."""
    weight, total = source.weight, split.samples
    if weight > MAX_PASSES:
        raise ConfigError(
            f"{source.location}: weight {weight:g} in exact mode takes each sample {weight:g} times an epoch: give "
            f"{MAX_PASSES} or less (or resampled epochs, where a weight is a share of the samples)"
        )
    whole, part = divmod(weight, 1.0)
    counts = [sh.samples for sh in split.shards]
    passes = [_apportioned(counts, round(share * total)) for share in [1.0] * int(whole) + [part]]
    if not (passes := [p for p in passes if any(p)]):  # (a part too small for a sample is no pass)
        raise ConfigError(
            f"{source.location}: weight {weight:g} takes none of its {total} samples an exact epoch ({weight:g} × "
            f"{total} rounds to 0): give it {_rounded_up(1 / total)} or more (one sample an epoch)"
        )
    return passes


def _shares(sources: list[Source], splits: list[SplitInfo]) -> list[float]:
    """Each source's share of a resampled epoch's samples: its weight's share of the weights
    (scaled by the largest first, so that no sum overflows nor a share underflows). A share of
    less than one in as many samples as the sources hold is a one-line ConfigError."""
    top = max(s.weight for s in sources)
    scaled = [s.weight / top for s in sources]
    held, whole = sum(split.samples for split in splits), sum(scaled)
    for source, weight in zip(sources, scaled, strict=True):
        if held * weight / whole < 1:
            least = top * (whole - weight) / (held - 1)  # (held > 1: each source holds samples)
            raise ConfigError(
                f"{source.location}: weight {source.weight:g} draws {held * weight / whole:.2g} of every {held} "
                f"samples: give it {_rounded_up(least)} or more (one in {held})"
            )
    return [weight / whole for weight in scaled]


def _rounded_up(value: float) -> str:
    """``value`` to 3 significant digits, rounded up (a least weight that gives what it says)."""
    exact = Decimal(repr(value))  # (as it reads: 0.1 is 0.1, not the float's 0.1000000000000000055)
    step = Decimal(1).scaleb(exact.adjusted() - 2)
    return f"{float((exact / step).to_integral_value(ROUND_CEILING) * step):.3g}"


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
