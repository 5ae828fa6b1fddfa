"""Storage URLs: where shards and manifests live, behind one small interface.

A location is a directory-like URL (a local path or ``file://`` here; ``ais://`` and
``gs://`` plug in behind the same methods). Writes are all-or-nothing: an object appears
under its final name only once it is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol


class Store(Protocol):
    url: str

    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, name: str) -> None: ...
    def open(self, name: str) -> BinaryIO: ...
    def read_bytes(self, name: str) -> bytes: ...
    def write_bytes(self, name: str, data: bytes) -> None: ...
    def put_file(self, src: Path, name: str) -> None: ...
    def scratch_file(self, name: str) -> Path: ...
    def shard_url(self, name: str) -> str: ...


class LocalStore:
    """A directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        if not name or name.startswith("/") or ".." in Path(name).parts:
            raise ValueError(f"invalid object name {name!r} in {self.url}")
        return self.root / name

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def size(self, name: str) -> int:
        return self._path(name).stat().st_size

    def list(self, prefix: str = "") -> list[str]:
        """Object names under the root that start with ``prefix`` (recursive, like a bucket)."""
        if not self.root.is_dir():
            return []
        names = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(n for n in names if n.startswith(prefix) and not n.endswith(".partial"))

    def delete(self, name: str) -> None:
        path = self._path(name)
        path.unlink(missing_ok=True)
        for parent in path.parents:  # drop folders the deletion left empty, like a bucket would
            if parent == self.root or any(parent.iterdir()):
                break
            parent.rmdir()

    def open(self, name: str) -> BinaryIO:
        return self._path(name).open("rb")

    def read_bytes(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self.scratch_file(name)
        tmp.write_bytes(data)
        self.put_file(tmp, name)

    def put_file(self, src: Path, name: str) -> None:
        """Move ``src`` under ``name`` atomically (fsync, then rename)."""
        dest = self._path(name)
        if src.stat().st_dev != self.root.stat().st_dev:
            tmp = self.scratch_file(name)
            shutil.copyfile(src, tmp)
            src.unlink()
            src = tmp
        src.chmod(0o644)
        with src.open("rb") as f:
            os.fsync(f.fileno())
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def scratch_file(self, name: str) -> Path:
        """A new empty file to build ``name`` in: hidden, in the root (so the final rename
        stays on one file system); a killed writer leaves it here, never under a final name."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{Path(name).name}.", suffix=".partial")
        os.close(fd)
        return Path(tmp)

    def shard_url(self, name: str) -> str:
        return str(self._path(name))


def open_store(url: str) -> Store:
    """The store for a location URL; unsupported schemes fail with a one-line reason."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return LocalStore(url)
    if scheme == "file":
        return LocalStore(rest)
    raise ValueError(
        f"unsupported storage URL {url!r}: use a local directory "
        "(ais:// and gs:// destinations are not available in this build yet)"
    )
