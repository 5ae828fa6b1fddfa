"""Which shards of a location make which split, for ``index``: from ``--split NAME=PATTERN``, from
the Hugging Face hub's ``_info.json``, or from the words in the shards' names.

The hub's ``timm/imagenet-1k-wds`` names its shards ``imagenet1k-train-0000.tar`` and
``imagenet1k-validation-00.tar`` (with an ``_info.json`` listing them); the webdataset project's
ImageNet example ``imagenet-train-000000.tar`` and ``imagenet-val-000000.tar``. A name whose
words (split at ``-``, ``_`` and ``.``) hold ``train``, ``val``, ``validation`` or ``test`` is
that split's; ``validation`` is read as ``val``, the split training validates on.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass

from braceexpand import braceexpand

from imagenet_ais.errors import ConfigError, DataError, NotFound
from imagenet_ais.storage import Store, is_inside

INFO = "_info.json"  # the hub's description of a WebDataset repository
SPLIT_WORDS = {"train": "train", "val": "val", "validation": "val", "test": "test"}
KNOWN = (  # layouts worth naming: (name, a shard name of theirs)
    ("timm/imagenet-1k-wds (Hugging Face hub)", re.compile(r"imagenet(1k|12k|22k)-(train|validation)-\d+\.tar")),
    ("webdataset's ImageNet example", re.compile(r"imagenet-(train|val)-\d{6}\.tar")),
)


@dataclass
class Layout:
    """Each split's shards, in the order they are listed, and how they were found."""

    splits: dict[str, list[str]]
    found_by: str

    def describe(self) -> str:
        names = [n for shards in self.splits.values() for n in shards]
        known = next((name for name, pattern in KNOWN if names and all(pattern.fullmatch(_base(n)) for n in names)), "")
        return f"{known}, {self.found_by}" if known else self.found_by


def split_option(text: str) -> tuple[str, str]:
    """``--split NAME=PATTERN`` → (name, pattern); ``validation`` is named ``val``."""
    name, eq, pattern = text.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z0-9_]+", name) or not pattern:
        raise ConfigError(f"--split {text!r}: give NAME=PATTERN, e.g. train='imagenet1k-train-{{0000..1023}}.tar'")
    return SPLIT_WORDS.get(name, name), pattern


def find_layout(store: Store, patterns: list[tuple[str, str]]) -> Layout:
    """The splits at ``store``: ``patterns`` (brace and glob patterns relative to it) where given,
    else its ``_info.json``, else its ``.tar`` names. None found is a one-line ConfigError."""
    if patterns:
        layout = Layout(_by_patterns(store, patterns), "--split patterns")
    elif store.exists(INFO):
        layout = Layout(_from_info(store), INFO)
    else:
        layout = Layout(_by_names(_listed(store)), "split names in the shards' names")
    if not any(layout.splits.values()):
        raise ConfigError(
            f"{store.url}: no shards found by {layout.found_by}: name each split's shards with --split NAME=PATTERN"
        )
    _check_disjoint(layout.splits)
    return layout


def _listed(store: Store) -> list[str]:
    try:
        return store.list()
    except ConfigError:  # (http: no listing)
        raise ConfigError(
            f"{store.url} cannot be listed: name each split's shards with --split NAME=PATTERN "
            "(e.g. --split train='imagenet1k-train-{0000..1023}.tar')"
        ) from None


def _by_patterns(store: Store, patterns: list[tuple[str, str]]) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {}
    listed: list[str] | None = None
    for split, pattern in patterns:
        names = []
        for expanded in braceexpand(pattern):
            if any(c in expanded for c in "*?["):
                listed = _listed(store) if listed is None else listed
                matched = [n for n in listed if fnmatch.fnmatchcase(n, expanded)]
                if not matched:
                    raise NotFound(f"{store.url}: no shard matches {expanded!r} (of --split {split}={pattern})")
                names += matched
            else:
                names.append(expanded)
        splits.setdefault(split, []).extend(_inside(n, store) for n in names)
    return splits


def _from_info(store: Store) -> dict[str, list[str]]:
    """The hub's ``_info.json``: ``{"splits": {NAME: {"filenames": [...], ...}}}``."""
    where = f"{store.url}/{INFO}"
    try:
        info = json.loads(store.read_bytes(INFO))
        splits = {
            SPLIT_WORDS.get(name, name): [_inside(n, store) for n in split["filenames"]]
            for name, split in info["splits"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(
            f"{where}: unreadable ({type(e).__name__}: {e}); name the splits with --split NAME=PATTERN instead"
        ) from None
    return splits


def _by_names(names: list[str]) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {}
    for name in names:
        if not name.endswith(".tar") or name.startswith("_"):
            continue
        words = {SPLIT_WORDS[w] for w in re.split(r"[-_.]", _base(name)) if w in SPLIT_WORDS}
        if len(words) == 1:
            splits.setdefault(words.pop(), []).append(name)
    return {split: sorted(shards, key=_natural) for split, shards in splits.items()}


def _check_disjoint(splits: dict[str, list[str]]) -> None:
    owner: dict[str, str] = {}
    for split, names in splits.items():
        for name in names:
            if name in owner:
                raise ConfigError(
                    f"{name} is in the {owner[name]} split and in {split}"
                    + (" twice" if owner[name] == split else "")
                    + ": name each shard in one split, once"
                )
            owner[name] = split


def _inside(name: object, store: Store) -> str:
    if not isinstance(name, str) or not is_inside(name) or not name.isprintable():
        raise ConfigError(f"{name!r} is not the name of a shard inside {store.url}")
    return name


def _base(name: str) -> str:
    return name.rpartition("/")[2]


def _natural(name: str) -> list[int | str]:
    """``a-2.tar`` before ``a-10.tar``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
