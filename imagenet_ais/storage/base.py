"""The Store interface, and what the backends share: object names, URL parsing, temp files, checksums."""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import xxhash

from imagenet_ais.errors import ConfigError, DataError, StorageError
from imagenet_ais.storage.scratch import scratch_file

BLOCK = 1 << 20


class Store(Protocol):
    url: str

    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, name: str) -> None: ...
    def delete_if(self, name: str, data: bytes) -> bool: ...  # delete only while it holds data
    def open(self, name: str) -> BinaryIO: ...
    def read_bytes(self, name: str) -> bytes: ...
    def write_bytes(self, name: str, data: bytes) -> None: ...
    # Publishes src under name; src is consumed unless keep. With once, an existing object is
    # never replaced: FileExistsError (the caller decides whether the copy there is the same).
    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None: ...
    def scratch_file(self, name: str) -> Path: ...
    def matches(self, name: str, path: Path) -> bool: ...  # the object exists with path's exact bytes

    requests: int  # requests sent to its server so far, retries included (AIStore's: its reads' HEADs and GETs)


def is_inside(name: str) -> bool:
    """Whether ``name`` is an object name relative to a location: not absolute, no way out of it."""
    return bool(name) and not name.startswith("/") and ".." not in name.split("/")


def _checked(name: str, url: str) -> str:
    """``name``, where it is inside its location (``is_inside``); else a DataError."""
    if not is_inside(name):
        raise DataError(f"invalid object name {name!r} in {url}")
    return name


def _bucket_and_prefix(url: str, scheme: str) -> tuple[str, str]:
    """``scheme://bucket[/prefix]`` → (bucket, "prefix/" or "")."""
    found, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if found != scheme or not bucket:
        raise ConfigError(f"bad storage URL {url!r}: expected {scheme}://bucket[/prefix]")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def check_location(url: str) -> None:
    """A location URL with credentials in it (``http://user:password@host/``) is a one-line
    ConfigError that does not repeat them: they would be written to logs, metrics and config.json."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if sep and "@" in netloc:
        where = f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"
        variables = (
            "SHARDS_HTTP_USER and SHARDS_HTTP_PASSWORD (or SHARDS_HTTP_TOKEN)"
            if scheme in ("http", "https")
            else "its backend's credentials (docs/storage.md)"
        )
        raise ConfigError(
            f"{where}: credentials in a location would be written to logs, metrics and config.json: give it "
            f"without them, and set {variables} instead"
        )


def _blocks(stream: BinaryIO) -> Iterator[bytes]:
    """Everything left in ``stream``, 1 MiB at a time; the stream is closed afterwards."""
    with stream:
        yield from iter(lambda: stream.read(1 << 20), b"")


def _hexdigest(stream: BinaryIO, h: Any) -> str:
    for block in _blocks(stream):
        h.update(block)
    return h.hexdigest()


# AIStore's checksum types this client computes too; "xxhash2" is XXH64 with seed 0
AIS_CHECKSUMS = ("xxhash2", "sha256", "md5")


def file_checksum(path: Path, kind: str) -> str:
    """The hex digest of a file, of one of AIS_CHECKSUMS."""
    return _hexdigest(path.open("rb"), xxhash.xxh64(seed=0) if kind == "xxhash2" else hashlib.new(kind))


class HashingReader:
    """A stream that counts and hashes (SHA-256) every byte read through it: a shard checked
    against its manifest as it is read, with no second pass. ``waited``: the seconds its reads
    took (the store's pace, where it is remote)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.sha, self.count, self.waited = raw, hashlib.sha256(), 0, 0.0

    def read(self, n: int = -1) -> bytes:
        began = time.perf_counter()
        data = self.raw.read(n)
        self.waited += time.perf_counter() - began
        self.sha.update(data)
        self.count += len(data)
        return data

    def read_to_end(self) -> None:
        while self.read(BLOCK):
            pass


def stream_sha256(stream: BinaryIO) -> str:
    """SHA-256 of everything left in ``stream``, which is closed afterwards."""
    return _hexdigest(stream, hashlib.sha256())


def _same_bytes(store: Store, name: str, path: Path) -> bool:
    """By size, then SHA-256 of both (for stores that keep no comparable checksum)."""
    if not store.exists(name) or store.size(name) != path.stat().st_size:
        return False
    return stream_sha256(store.open(name)) == stream_sha256(path.open("rb"))


class _StoreBase(Store):
    """What every store does the same way on top of its own primitives (the rest of Store)."""

    requests = 0  # requests sent to the store's server, retries included (a local directory: none)

    def _sent(self, *_: object, **__: object) -> None:
        """Counts one request (a hook of the store's HTTP session or SDK)."""
        self.requests += 1

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self.scratch_file(name)
        tmp.write_bytes(data)
        self.put_file(tmp, name)

    def scratch_file(self, name: str) -> Path:
        """A new empty temp file to build ``name`` in before it goes up (see scratch.py)."""
        return scratch_file(name)

    def matches(self, name: str, path: Path) -> bool:
        return _same_bytes(self, name, path)

    def delete_if(self, name: str, data: bytes) -> bool:
        """Delete ``name`` if it still holds ``data``; False if not. A read, then a delete: an
        object written between the two is deleted all the same (GCS's override closes that)."""
        if not self.exists(name) or self.read_bytes(name) != data:
            return False
        self.delete(name)
        return True


def download(
    store: Store,
    name: str,
    dest: Path,
    size: int,
    sha256: str | None = None,
    progress: Callable[[int], object] | None = None,
    publish: Callable[[Path, Path], object] = os.replace,
    partial: Path | None = None,
) -> None:
    """``store``'s ``name`` → the local file ``dest``, through ``partial`` (default
    ``.DEST.partial``; sized in full first, so a shard cache's accounting sees the whole file
    from the start), ``publish``-ed (renamed) only once it has ``size`` bytes (and, given, that
    SHA-256); else an OSError, and nothing at ``dest``."""
    partial = partial or dest.with_name(f".{dest.name}.partial")
    digest, got = hashlib.sha256(), 0
    try:
        partial.touch()  # (not "wb": that would zero a reservation the cache made, for a moment)
        with partial.open("r+b") as out, store.open(name) as src:
            out.truncate(size)
            # what has come, block by block: a buffered reader's read() waits for a whole block,
            # and one that fails on the way loses what it had (progress would not see bytes that came)
            read = src.read1 if isinstance(src, io.BufferedReader) else src.read
            for block in iter(lambda: read(BLOCK), b""):
                out.write(block)
                digest.update(block)
                got += len(block)
                if progress:
                    progress(len(block))
            out.truncate(got)
            out.flush()
            os.fsync(out.fileno())
        if got != size or (sha256 and digest.hexdigest() != sha256):
            raise StorageError(
                f"{store.url}/{name}: got {got} bytes that differ from the {size} expected (size or sha256)"
            )
        publish(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
