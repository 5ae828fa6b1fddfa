"""A local path or ``file://`` location: a directory, written by fsync and rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from imagenet_ais.storage.base import _checked, _StoreBase


class LocalStore(_StoreBase):
    """A directory on a local or mounted file system, by its absolute path: a relative one
    stays where it was when the store was made, wherever the process moves later."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / _checked(name, self.url)

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
        try:
            path.unlink()
        except FileNotFoundError:
            return  # (its folder may be gone too)
        for parent in path.parents:  # drop folders the deletion left empty, like a bucket would
            if parent == self.root or any(parent.iterdir()):
                break
            parent.rmdir()

    def open(self, name: str) -> BinaryIO:
        return self._path(name).open("rb")

    def read_bytes(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        """Publish ``src`` under ``name`` atomically (fsync, then rename; with once, link)."""
        dest = self._path(name)
        copy = keep or src.stat().st_dev != self.root.stat().st_dev
        tmp = self.scratch_file(name) if copy else src
        try:
            if copy:
                shutil.copyfile(src, tmp)
            tmp.chmod(0o644)
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            dest.parent.mkdir(parents=True, exist_ok=True)
            if once:
                os.link(tmp, dest)  # atomic, and fails rather than replace
                tmp.unlink()
            else:
                os.replace(tmp, dest)
        except BaseException:  # (a full destination): no copy left in it, only under a final name
            if copy or once:
                tmp.unlink(missing_ok=True)
            raise
        if copy and not keep:
            src.unlink()
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
