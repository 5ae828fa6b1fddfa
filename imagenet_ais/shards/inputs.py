"""What convert reads from SRC: the classes, every file of a split, and the plan of its shards.

Every file under a split folder is either planned into a shard or rejected with a reason, and
a class or split left with no samples is an error unless allowed: nothing is dropped unsaid.
Shards are planned up front (a seeded shuffle cut by --maxcount/--maxsize), so each one can be
built in its own process, named before it exists, and recognised on a re-run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from imagenet_ais.errors import DataError, NotFound

TAR_OVERHEAD = 1536  # header + padding for the two members of a sample, for --maxsize planning
Rejected = dict[str, str]  # {"path": relative to SRC, "reason": ...}


class Input(NamedTuple):
    rel: str  # path relative to SRC
    key: str
    cls: int  # class index
    size: int  # size and mtime as planned: a file changed since is a different input
    mtime_ns: int


@dataclass(frozen=True)
class Stored:
    """How images are stored: those whose longer side is over ``max_side`` resized to it (the
    aspect kept) and encoded at ``quality``, as are the few that are no RGB or gray JPEG; the
    others keep their bytes. None: every image at its own size."""

    max_side: int | None = None
    quality: int = 95


AS_GIVEN = Stored()  # every image at its own size


@dataclass
class ShardPlan:
    name: str
    items: list[Input]
    stored: Stored = AS_GIVEN

    @property
    def digest(self) -> str:
        # (the default's digest is what it was before Stored: shards made then are kept)
        what = repr(self.items) + (repr(self.stored) if self.stored != AS_GIVEN else "")
        return hashlib.sha256(what.encode()).hexdigest()[:16]


def shard_name(split: str, index: int) -> str:
    return f"imagenet-{split}-{index:06d}.tar"


def list_classes(src: Path) -> list[str]:
    train = src / "train"
    if not train.is_dir():
        raise NotFound(f"{train} not found: SRC must hold train/<wnid>/ folders (ImageFolder layout)")
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    if not classes:
        raise NotFound(f"{train} has no class folders: arrange it as train/<wnid>/<file>")
    return classes


def _unreadable(path: str, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "a symlink loop: point it at an image or remove it"
    if e.errno == errno.ENOENT and os.path.islink(path):
        return f"a broken symlink (to {os.readlink(path)}): point it at an image or remove it"
    return f"{type(e).__name__}: {e.strerror}"


class Seen:
    """What convert has met so far, across splits, so that nothing is read twice: a link to a
    folder inside SRC is not followed, and a folder or file reached twice (a link from outside
    SRC, a hard link) is read once."""

    def __init__(self, src: Path):
        self.src = Path(os.path.realpath(src))
        self.ids: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) → where it was met, under SRC

    def link_inside(self, path: str | Path) -> str | None:
        """Where the symlink ``path`` points under SRC; None when it is no link or points outside."""
        if not os.path.islink(path):
            return None
        real = Path(os.path.realpath(path))
        return str(real.relative_to(self.src)) if real.is_relative_to(self.src) else None

    def first(self, st: os.stat_result, where: str) -> str | None:
        """None the first time a file or folder is met (noting it as ``where``); else where that was."""
        key = (st.st_dev, st.st_ino)
        if key in self.ids:
            return self.ids[key]
        self.ids[key] = where
        return None


Found = tuple[str, os.stat_result, bool]  # a file's path under SRC, its stat, whether it is a symlink


def _walk(folder: str, rel: str, seen: Seen, files: list[Found], rejected: list[Rejected]) -> None:
    """The files below a class folder, subfolders included (as ImageFolder reads them)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        rejected.append({"path": rel, "reason": _unreadable(folder, e)})
        return
    for entry in entries:
        where = f"{rel}/{entry.name}"
        try:
            st = os.stat(entry.path)
        except OSError as e:
            rejected.append({"path": where, "reason": _unreadable(entry.path, e)})
            continue
        if not stat.S_ISDIR(st.st_mode):
            if stat.S_ISREG(st.st_mode):
                files.append((where, st, entry.is_symlink()))
            else:
                rejected.append({"path": where, "reason": "not a regular file (a pipe, socket or device)"})
        elif (target := seen.link_inside(entry.path)) is not None:
            reason = f"a link to the folder {target} inside SRC: links within SRC are not followed"
            rejected.append({"path": where, "reason": reason})
        elif first := seen.first(st, where):
            reason = f"a link to the folder {first}: its files are read there, not twice"
            rejected.append({"path": where, "reason": reason})
        else:
            _walk(entry.path, where, seen, files, rejected)


def read_split(
    src: Path, split: str, classes: list[str], seen: Seen
) -> tuple[list[tuple[str, int, os.stat_result]], list[Rejected]]:
    """(path, class index, stat) of every file of a split, and what was rejected before reading."""
    root = src / split
    if not root.is_dir():
        raise NotFound(f"{root} not found: create it or leave {split!r} out of --splits")
    index = {wnid: i for i, wnid in enumerate(classes)}
    rejected: list[Rejected] = []
    entries = sorted(root.iterdir())
    folders = [p for p in entries if p.is_dir()]
    if not folders and entries:
        raise DataError(
            f"{root} holds {len(entries)} files and no class folders (the raw ILSVRC2012 val layout?): "
            f"arrange them as {split}/<wnid>/<file> (e.g. with ILSVRC2012's valprep.sh), "
            f"or leave {split!r} out of --splits"
        )
    for stray in (p for p in entries if p not in folders):
        try:
            stray.stat()
            reason = f"not in a class folder: move it into {split}/<wnid>/"
        except OSError as e:
            reason = _unreadable(str(stray), e)
        rejected.append({"path": f"{split}/{stray.name}", "reason": reason})
    for folder in folders:  # all of them first, so that a link below one to another is seen as such
        if folder.name not in index:
            raise DataError(f"{folder}: class {folder.name!r} is not among the train classes")
        same = seen.link_inside(folder) or seen.first(folder.stat(), f"{split}/{folder.name}")
        if same:
            raise DataError(
                f"{folder} is the same folder as {src / same} (a symlink): its images would be read "
                "twice, under two labels or in two splits; make it a folder of its own (nothing was changed)"
            )
    found: list[tuple[int, Found]] = []
    for folder in folders:
        below: list[Found] = []
        _walk(str(folder), f"{split}/{folder.name}", seen, below, rejected)
        found.extend((index[folder.name], f) for f in below)
    files: list[tuple[str, int, os.stat_result]] = []
    # One image, one sample: a file met twice (a symlink, a hard link) is stored once, preferably
    # where it really is (its folder tells its class), and the other path is rejected.
    for cls, (path, st, _) in sorted(found, key=lambda f: f[1][2]):  # real files first, else in order
        if first := seen.first(st, path):
            rejected.append({"path": path, "reason": f"the same file as {first} (a link): stored once, there"})
        else:
            files.append((path, cls, st))
    return files, rejected


def plan_split(
    src: Path, split: str, classes: list[str], seed: int, maxcount: int, maxsize: int, seen: Seen, stored: Stored
) -> tuple[list[ShardPlan], list[Rejected]]:
    files, rejected = read_split(src, split, classes, seen)
    random.Random(f"{seed}:{split}").shuffle(files)
    plans: list[ShardPlan] = []
    used: set[str] = set()
    items: list[Input] = []
    size = 0
    for rel, cls, st in files:
        if items and (len(items) >= maxcount or size + st.st_size + TAR_OVERHEAD > maxsize):
            plans.append(ShardPlan(shard_name(split, len(plans)), items, stored))
            items, size = [], 0
        items.append(Input(rel, unique_key(rel, used), cls, st.st_size, st.st_mtime_ns))
        size += st.st_size + TAR_OVERHEAD
    if items:
        plans.append(ShardPlan(shard_name(split, len(plans)), items, stored))
    return plans, rejected


def check_counts(split: str, classes: list[str], labels: Iterable[int]) -> None:
    """A split, or a class within it, with no samples is an error: training would silently
    skip validation or never see the class."""
    counts = Counter(labels)
    hint = "or pass --allow-empty to convert without them"
    if not counts:
        raise DataError(f"{split} has no samples: add images to {split}/<wnid>/, {hint}")
    if empty := [wnid for i, wnid in enumerate(classes) if not counts[i]]:
        more = f" and {len(empty) - 1} more classes" if len(empty) > 1 else ""
        raise DataError(
            f"{split}/{empty[0]}{more} has no samples (the folder is missing or empty, or every file in it "
            f"was rejected): add images, {hint}"
        )


def unique_key(rel: str, used: set[str]) -> str:
    """A member-safe key: no '/', '..' or '.' (webdataset splits keys at the first dot)."""
    base = re.sub(r"[^A-Za-z0-9_-]", "_", Path(rel).name.split(".")[0]) or "sample"
    key, n = base, 1
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key
