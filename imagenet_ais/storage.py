"""Storage URLs: where shards and manifests live, behind one small interface.

A location is a directory-like URL: a local path or ``file://``, or ``ais://bucket/prefix``.
Writes are all-or-nothing: an object appears under its final name only once it is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    def put_file(self, src: Path, name: str) -> None: ...  # consumes src
    def scratch_file(self, name: str) -> Path: ...


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


class AISStore:
    """``ais://bucket[/prefix]`` on the AIStore cluster at ``AIS_ENDPOINT`` (token: ``AIS_AUTHN_TOKEN``).

    Reads stream through the SDK and resume an interrupted GET where it broke off; writes are
    verified by reading the object back (size and SHA-256) before they count.
    """

    MULTIPART_THRESHOLD = 256 << 20  # larger uploads go in parts of MULTIPART_PART
    MULTIPART_PART = 64 << 20
    MAX_RESUME = 10  # re-GETs from the last offset per stream before a read fails

    def __init__(self, url: str):
        from aistore.sdk import Client  # imported here: local-only runs never need the SDK

        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "ais" or not bucket:
            raise ValueError(f"bad AIStore URL {url!r}: expected ais://bucket[/prefix]")
        endpoint = os.environ.get("AIS_ENDPOINT")
        if not endpoint:
            raise ValueError(f"{url}: set AIS_ENDPOINT to the cluster's URL (e.g. http://aistore-proxy:51080)")
        self.url = url.rstrip("/")
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.bucket = Client(endpoint, token=os.environ.get("AIS_AUTHN_TOKEN") or None).bucket(bucket)
        self._bucket_ready = False

    def _obj(self, name: str):
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"invalid object name {name!r} in {self.url}")
        return self.bucket.object(self.prefix + name)

    def exists(self, name: str) -> bool:
        try:
            self._obj(name).head()
        except Exception as e:
            if _not_found(e):
                return False
            raise
        return True

    def size(self, name: str) -> int:
        return int(self._obj(name).head().size)

    def list(self, prefix: str = "") -> list[str]:
        try:
            entries = self.bucket.list_objects_iter(prefix=self.prefix + prefix)
            return sorted(e.name[len(self.prefix) :] for e in entries)
        except Exception as e:
            if _not_found(e):  # no bucket yet
                return []
            raise

    def delete(self, name: str) -> None:
        try:
            self._obj(name).delete()
        except Exception as e:
            if not _not_found(e):
                raise

    def open(self, name: str) -> BinaryIO:
        return self._obj(name).get_reader().as_file(max_resume=self.MAX_RESUME)

    def read_bytes(self, name: str) -> bytes:
        return self._obj(name).get_reader().read_all()

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self.scratch_file(name)
        tmp.write_bytes(data)
        self.put_file(tmp, name)

    def put_file(self, src: Path, name: str) -> None:
        """Upload, then read back and compare size and SHA-256; a bad copy is deleted."""
        try:
            if not self._bucket_ready:
                self.bucket.create(exist_ok=True)
                self._bucket_ready = True
            obj = self._obj(name)
            size = src.stat().st_size
            if size > self.MULTIPART_THRESHOLD:
                self._put_multipart(obj, src)
            else:
                obj.get_writer().put_file(src)
            want, got = stream_sha256(src.open("rb")), stream_sha256(self.open(name))
            stored = self.size(name)
            if (stored, got) != (size, want):
                self.delete(name)
                raise OSError(f"{self.url}/{name}: upload verification failed (size {stored}/{size}, sha256 mismatch)")
        finally:
            src.unlink(missing_ok=True)

    def _put_multipart(self, obj, src: Path) -> None:
        upload = obj.multipart_upload().create()
        try:
            with src.open("rb") as f:
                for number, part in enumerate(iter(lambda: f.read(self.MULTIPART_PART), b""), start=1):
                    upload.add_part(number).put_content(part)
            upload.complete()
        except BaseException:
            with contextlib.suppress(Exception):
                upload.abort()
            raise

    def scratch_file(self, name: str) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=f".{Path(name).name}.", suffix=".partial")
        os.close(fd)
        return Path(tmp)


def _not_found(e: Exception) -> bool:
    """An AIStore 404: no such object or bucket (a HEAD's 404 carries no error body to tell which)."""
    from aistore.sdk.errors import AISError

    return isinstance(e, AISError) and e.status_code == 404


def stream_sha256(stream: BinaryIO) -> str:
    """SHA-256 of everything left in ``stream``, which is closed afterwards."""
    h = hashlib.sha256()
    with stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def open_store(url: str) -> Store:
    """The store for a location URL; unsupported schemes fail with a one-line reason."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return LocalStore(url)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "ais":
        return AISStore(url)
    raise ValueError(f"unsupported storage URL {url!r}: use a local directory, file:// or ais://bucket/prefix")
