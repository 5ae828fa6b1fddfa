"""Local copies of remote shards: the verified copy, the shard cache, and preload.

Every copy is checked against the manifest (size and SHA-256) before it appears under its
name, so a shard on local disk is either complete and right or not there at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tarfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from imagenet_ais.errors import DataError
from imagenet_ais.shards import progress
from imagenet_ais.shards.manifest import MANIFEST, Manifest, ShardInfo, load_manifest
from imagenet_ais.shards.members import BadMember, check_headers
from imagenet_ais.storage import LocalStore, Store, download, open_store


def _identity(path: Path, sha256: str) -> str:
    """A copy as verified against a manifest's ``sha256``: a copy with the same identity was
    verified against that digest (a re-converted dataset's new digest, or a file rewritten in
    place, gives another identity, so the copy is checked again)."""
    st = path.stat()
    return f"{sha256} {st.st_ino} {st.st_size} {st.st_mtime_ns}"


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on ``path`` (the kernel drops it when a holder dies); yields whether held."""
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _listing(root: Path) -> list[tuple[Path, int, float]]:
    """(path, size, mtime) of the files under ``root`` that still exist by the time they are looked at."""
    out = []
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            if path.is_file():
                out.append((path, st.st_size, st.st_mtime))
    return out


def _lock_of(path: Path) -> Path:
    """A cached shard's lock file (``.NAME.lock`` beside it); a download's ``.NAME.partial`` shares it."""
    name = path.name[1 : -len(".partial")] if path.name.endswith(".partial") else path.name
    return path.with_name(f".{name}.lock")


def _cached(files: list[tuple[Path, int, float]]) -> list[tuple[Path, int, float]]:
    """The cache's own files among ``files``: shards and downloads with their lock file beside
    them. Anything else under the root (someone's own data in --cache-dir) is neither counted
    against the bound nor evicted."""
    locks = {path for path, _, _ in files if path.name.endswith(".lock")}
    return [f for f in files if f[0] not in locks and _lock_of(f[0]) in locks]


def usage(root: Path) -> int:
    """The bytes under ``root`` that count against the bound, seen as the cache sees them: under
    its lock, so a download renamed meanwhile is counted once, neither twice nor not at all."""
    with _locked(root / ".evict.lock"):
        return sum(size for _, size, _ in _cached(_listing(root)))


def _slug(location: str) -> str:
    """A directory name for a location: ``http://host:8080/x`` → ``http_host_8080_x``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", location).strip("_")


# where ShardCache.open's shard came from
HIT, FETCHED, REFETCHED, STREAMED = "hit", "fetched", "refetched", "streamed"


@dataclass
class ShardCache:
    """Shards of one remote location kept under ``root`` (shared by every location and process
    of a node), at most ``max_bytes`` in all, least recently used evicted first.

    Whoever holds a shard's lock downloads it; other workers and ranks wanting it wait, then
    read the finished copy. A copy is verified against the manifest when it arrives and again
    whenever it changed since (inode, size or mtime: its lock file records the last verified
    state and, by its mtime, the last use); a bad one is fetched again. A shard that cannot
    get room within the bound is streamed, not cached.
    """

    root: Path
    location: str
    max_bytes: int | None
    shards: dict[str, ShardInfo]
    _store: Store | None = field(default=None, init=False, repr=False)

    @property
    def dir(self) -> Path:
        return self.root / _slug(self.location)

    @property
    def requests(self) -> int:
        """The requests its store has sent (for its downloads), in this process."""
        return self._store.requests if self._store else 0

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.location)
        return self._store

    def open(self, name: str, fetching: Callable[[int], object] | None = None) -> tuple[BinaryIO, str]:
        """Shard ``name``, and where it came from: a copy already held (HIT), one fetched now
        (FETCHED; REFETCHED in place of a bad one), or the store's own stream (STREAMED: no room).
        A fetch tells ``fetching`` each block's bytes as they come, also of one that then fails."""
        info, path = self.shards[name], self.dir / name  # (the manifest's names stay inside: manifest.py)
        lock = _lock_of(path)  # also holds what the copy was last verified as
        path.parent.mkdir(parents=True, exist_ok=True)  # (a shard in a subfolder of its location too)
        fetched = FETCHED
        with _locked(lock):
            if path.exists():
                if lock.read_text() == _identity(path, info.sha256) or not info.problem(LocalStore(self.dir)):
                    lock.write_text(_identity(path, info.sha256))
                    return path.open("rb"), HIT
                print(f"warning: cached {path} differs from the manifest: fetching it again", file=sys.stderr)
                path.unlink()
                fetched = REFETCHED
            if not self._make_room(info.bytes, path):
                return self.store.open(name), STREAMED
            download(self.store, info.name, path, info.bytes, info.sha256, fetching, self._publish)
            lock.write_text(_identity(path, info.sha256))  # and its mtime: when it was last used
            return path.open("rb"), fetched

    def _publish(self, partial: Path, path: Path) -> None:
        # under the cache-wide lock: a listing there never sees a rename halfway (readdir may
        # then return both names, or neither, and the bound would be misjudged)
        with _locked(self.root / ".evict.lock"):
            os.replace(partial, path)

    def _make_room(self, need: int, path: Path) -> bool:
        """Evict least recently used shards until ``need`` more bytes fit; reserve them at once
        (an empty partial of full size), all under the cache-wide lock, so the bound holds."""
        if self.max_bytes is None:
            return True
        with _locked(self.root / ".evict.lock"):
            everything = _listing(self.root)  # other downloads rename and drop files meanwhile: a snapshot
            files = _cached(everything)
            used = sum(size for _, size, _ in files)
            used_at = {p: mtime for p, _, mtime in everything if p.name.endswith(".lock")}
            shards = (f for f in files if not f[0].name.startswith("."))
            for victim, size, _ in sorted(shards, key=lambda f: used_at[_lock_of(f[0])]):
                if used + need <= self.max_bytes:
                    break
                # a shard being read or verified right now keeps its lock: skip it
                with _locked(_lock_of(victim), wait=False) as free:
                    if free and victim.exists():
                        victim.unlink()
                        used -= size
            for partial, size, _ in (f for f in files if f[0].name.endswith(".partial")):
                # left by a killed download: its shard's lock is free again
                with _locked(_lock_of(partial), wait=False) as free:
                    if free and partial.exists():
                        partial.unlink()
                        used -= size
            if used + need > self.max_bytes:
                return False
            with path.with_name(f".{path.name}.partial").open("wb") as f:
                f.truncate(need)
            return True


def preload(url: str, dest: Path, splits: list[str] | None, workers: int) -> Manifest:
    """Copy the shards of ``splits`` (default: all) from ``url`` to the directory ``dest``, then
    its manifest (of those splits only). Shards already there and intact are kept: a re-run
    after a kill resumes. Without the manifest, ``dest`` is not a dataset yet."""
    local = LocalStore(dest)
    manifest = load_manifest(open_store(url))
    store = open_store(manifest.shards_location(url))  # (an indexed set's shards may be elsewhere)
    wanted = splits or list(manifest.splits)
    if missing := [s for s in wanted if s not in manifest.splits]:
        raise DataError(f"{url}/{MANIFEST} has no split {missing[0]!r} (it has {', '.join(manifest.splits)})")
    # the copy's manifest: those splits, its shards beside it
    kept = Manifest(
        manifest.classes, {s: manifest.splits[s] for s in wanted}, manifest.source, labels=manifest.labels,
        class_counts={s: c for s, c in manifest.class_counts.items() if s in wanted},
    )  # fmt: skip
    shards = [s for split in kept.splits.values() for s in split.shards]
    dest.mkdir(parents=True, exist_ok=True)
    if local.exists(MANIFEST):  # a dataset's, replaced by this one; anything else is not ours to remove
        try:
            load_manifest(local)
        except ValueError as e:
            why = e.__cause__ or e
            raise DataError(f"{dest}/{MANIFEST} is not a shard manifest ({why}): preload into another DEST") from None
    local.delete(MANIFEST)  # the copy is not complete until it is back
    todo = [s for s in shards if s.problem(local)]
    with (
        progress.bar(sum(s.bytes for s in todo), f"preload → {dest}", "B", unit_scale=True) as bar,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        futures = [pool.submit(_copy_checked, store, s, dest, bar.update) for s in todo]
        for future in as_completed(futures):
            future.result()
    local.write_bytes(MANIFEST, kept.to_json().encode())
    return kept


def _copy_checked(store: Store, info: ShardInfo, dest: Path, progress: Callable[[int], object]) -> None:
    """One shard copied into ``dest`` (its size and SHA-256 checked) with its members judged by
    their headers as training would judge them (members.py); a bad one is named and not kept."""
    download(store, info.name, dest / info.name, info.bytes, info.sha256, progress)
    try:
        check_headers(dest / info.name)
    except (BadMember, tarfile.TarError) as e:
        (dest / info.name).unlink()
        raise DataError(
            f"{store.url}/{info.name}: {e}: not copied (its bytes are the manifest's: it was made so; convert it again)"
        ) from None
