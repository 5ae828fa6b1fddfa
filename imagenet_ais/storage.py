"""Storage URLs: where shards and manifests live, behind one small interface.

A location is a directory-like URL: a local path or ``file://``, ``ais://bucket/prefix``,
``gs://bucket/prefix``, or (read-only) ``http(s)://host[:port]/prefix``.
Writes are all-or-nothing: an object appears under its final name only once it is complete.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Protocol


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


def _checked(name: str, url: str) -> str:
    """An object name relative to a location: no absolute paths, no way out of it."""
    if not name or name.startswith("/") or ".." in name.split("/"):
        raise ValueError(f"invalid object name {name!r} in {url}")
    return name


def _bucket_and_prefix(url: str, scheme: str) -> tuple[str, str]:
    """``scheme://bucket[/prefix]`` → (bucket, "prefix/" or "")."""
    found, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if found != scheme or not bucket:
        raise ValueError(f"bad storage URL {url!r}: expected {scheme}://bucket[/prefix]")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _blocks(stream: BinaryIO):
    """Everything left in ``stream``, 1 MiB at a time; the stream is closed afterwards."""
    with stream:
        yield from iter(lambda: stream.read(1 << 20), b"")


def _same_bytes(store: Store, name: str, path: Path) -> bool:
    """By size, then SHA-256 of both (for stores that keep no comparable checksum)."""
    if not store.exists(name) or store.size(name) != path.stat().st_size:
        return False
    return stream_sha256(store.open(name)) == stream_sha256(path.open("rb"))


class _StoreBase:
    """What every store does the same way on top of its own primitives."""

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self.scratch_file(name)
        tmp.write_bytes(data)
        self.put_file(tmp, name)

    def scratch_file(self, name: str) -> Path:
        """A new empty temp file to build ``name`` in before it goes up."""
        fd, tmp = tempfile.mkstemp(prefix=f".{Path(name).name}.", suffix=".partial")
        os.close(fd)
        return Path(tmp)

    def matches(self, name: str, path: Path) -> bool:
        return _same_bytes(self, name, path)

    def delete_if(self, name: str, data: bytes) -> bool:
        """Delete ``name`` if it still holds ``data``; False if not. A read, then a delete: an
        object written between the two is deleted all the same (GCS's override closes that)."""
        if not self.exists(name) or self.read_bytes(name) != data:
            return False
        self.delete(name)
        return True


class LocalStore(_StoreBase):
    """A directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
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
        if keep or src.stat().st_dev != self.root.stat().st_dev:
            tmp = self.scratch_file(name)
            shutil.copyfile(src, tmp)
            if not keep:
                src.unlink()
            src = tmp
        src.chmod(0o644)
        with src.open("rb") as f:
            os.fsync(f.fileno())
        dest.parent.mkdir(parents=True, exist_ok=True)
        if once:
            try:
                os.link(src, dest)  # atomic, and fails rather than replace
            finally:
                src.unlink()
        else:
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


def _ais_errors(method):
    """The SDK's errors as an OSError naming the object: one line, and picklable (the SDK's and
    requests' errors carry the request, so they cannot come back from a worker process).
    Every wrapped method takes the object name (or prefix) as its last positional argument."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        from aistore.sdk.errors import AISError
        from requests import RequestException

        where = f"{self.url}/{args[-1] if args else ''}"
        try:
            return method(self, *args, **kwargs)
        except AISError as e:
            raise OSError(f"{where}: AIStore answered {e.status_code}: {_ais_message(e)}") from e
        except RequestException as e:
            raise OSError(f"{where}: {e}") from e

    return wrapper


class _ResumingGet(io.BufferedIOBase):
    """An AIStore object's bytes, read off its GET response a chunk at a time and handed out
    from that chunk; a GET that breaks off (a target restarted, a dropped connection, a short
    body) is sent again for the rest, from the byte it stopped at, up to ``max_resume`` times.

    The SDK's file object does the same over its chunk iterator, and ``io.BufferedReader`` over
    urllib3's ``readinto`` copied each megabyte once more: 0.6-0.75 of a plain GET's speed
    (bench/shard_reads.py, RESULTS.md).
    """

    def __init__(self, obj: Any, max_resume: int, chunk: int):
        from http.client import IncompleteRead

        from urllib3.exceptions import ProtocolError, ReadTimeoutError

        self.obj, self.max_resume, self.chunk = obj, max_resume, chunk
        self.broken = (ProtocolError, ReadTimeoutError, IncompleteRead, ConnectionError)
        self.fetched = 0  # bytes taken off the responses so far
        self.resumed = 0
        self.response = obj.get_reader().raw()  # urllib3's response, streaming
        self.data, self.view = b"", memoryview(b"")  # the chunk in hand, and its unread part

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        while True:
            try:
                data = self.response.read(self.chunk)
            except self.broken:
                if self.resumed == self.max_resume:
                    raise
                self.resumed += 1
                self.response.close()
                time.sleep(min(5.0, 0.5 * self.resumed))  # besides the SDK's own retries: a target restarts
                self.response = self.obj.get_reader(byte_range=f"bytes={self.fetched}-").raw()
                continue
            self.fetched += len(data)
            self.data, self.view = data, memoryview(data)
            return bool(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            parts = [bytes(self.view)]
            while self._fill():
                parts.append(self.data)
            self.view = memoryview(b"")
            return b"".join(parts)
        if not self.view and not self._fill():
            return b""
        if size >= len(self.view) and len(self.view) == len(self.data):
            out, self.view = self.data, memoryview(b"")  # the whole chunk: no copy
        else:
            out, self.view = bytes(self.view[:size]), self.view[size:]
        if len(out) < size:  # the chunk ran out: the rest from the next ones
            more = self.read(size - len(out))
            return out + more if more else out
        return out

    read1 = read

    def close(self) -> None:
        if not self.closed:
            self.response.close()
        super().close()


class AISStore(_StoreBase):
    """``ais://bucket[/prefix]`` on the AIStore cluster at ``AIS_ENDPOINT`` (token: ``AIS_AUTHN_TOKEN``).

    Reads stream off the GET response and resume an interrupted GET where it broke off. Writes
    count once verified: the checksum the target computed of what it stored (the bucket's type,
    xxhash2 by default, in the PUT's answer) must equal ours of the file; a multipart upload
    (over MULTIPART_THRESHOLD), or a bucket keeping another checksum type, is read back instead.
    """

    MULTIPART_THRESHOLD = 256 << 20  # larger uploads go in parts of MULTIPART_PART
    MULTIPART_PART = 64 << 20
    MAX_RESUME = 10  # re-GETs from the last offset per stream before a read fails
    READ_CHUNK = 1 << 20  # bytes per network read, at most
    PUT_TRIES = 5  # on top of the SDK's own retries of 429/5xx and network errors

    def __init__(self, url: str):
        from aistore.sdk import Client  # imported here: local-only runs never need the SDK

        bucket, self.prefix = _bucket_and_prefix(url, "ais")
        endpoint = os.environ.get("AIS_ENDPOINT")
        if not endpoint:
            raise ValueError(f"{url}: set AIS_ENDPOINT to the cluster's URL (e.g. http://aistore-proxy:51080)")
        self.url = url.rstrip("/")
        self.bucket = Client(endpoint, token=os.environ.get("AIS_AUTHN_TOKEN") or None).bucket(bucket)
        self._bucket_ready = False

    def _obj(self, name: str):
        return self.bucket.object(self.prefix + _checked(name, self.url))

    @_ais_errors
    def exists(self, name: str) -> bool:
        try:
            self._obj(name).head()
        except Exception as e:
            if _not_found(e):
                return False
            raise
        return True

    @_ais_errors
    def size(self, name: str) -> int:
        return int(self._obj(name).head().size)

    @_ais_errors
    def list(self, prefix: str = "") -> list[str]:
        try:
            entries = self.bucket.list_objects_iter(prefix=self.prefix + prefix)
            return sorted(e.name[len(self.prefix) :] for e in entries)
        except Exception as e:
            if _not_found(e):  # no bucket yet
                return []
            raise

    @_ais_errors
    def delete(self, name: str) -> None:
        try:
            self._obj(name).delete()
        except Exception as e:
            if not _not_found(e):
                raise

    @_ais_errors
    def open(self, name: str) -> BinaryIO:
        return _ResumingGet(self._obj(name), self.MAX_RESUME, self.READ_CHUNK)  # type: ignore[return-value]

    @_ais_errors
    def read_bytes(self, name: str) -> bytes:
        return self._obj(name).get_reader().read_all()

    @_ais_errors
    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        """Upload, verified by checksum (the target's, or a read-back) and size; a bad copy is deleted.

        A failed attempt is tried again while ``_ais_retryable`` says so.
        AIStore has no write preconditions: ``once`` is an existence check just before the PUT.
        """
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

        try:
            if not self._bucket_ready:
                self.bucket.create(exist_ok=True)
                self._bucket_ready = True
            if once and self.exists(name):
                raise FileExistsError(f"{self.url}/{name} exists")
            retrying = Retrying(
                stop=stop_after_attempt(self.PUT_TRIES),
                wait=wait_exponential(multiplier=0.5, max=8),
                retry=retry_if_exception(_ais_retryable),
                reraise=True,
            )
            for attempt in retrying:
                with attempt:
                    self._put_verified(src, name)
        finally:
            if not keep:
                src.unlink(missing_ok=True)

    def _put_verified(self, src: Path, name: str) -> None:
        obj = self._obj(name)
        size = src.stat().st_size
        stored: tuple[str, str] | None = None  # the target's checksum of what it stored: (type, value)
        if size > self.MULTIPART_THRESHOLD:
            self._put_multipart(obj, src)  # the parts' checksums are not the whole's
        else:
            headers = obj.get_writer().put_file(src).headers
            stored = (headers.get("ais-checksum-type", ""), headers.get("ais-checksum-value", ""))
        if stored and stored[0] in _CHECKSUMS:  # no read-back
            same = self.size(name) == size and _file_checksum(src, stored[0]) == stored[1]
        else:
            same = _same_bytes(self, name, src)
        if not same:
            self.delete(name)
            raise _VerifyFailed(f"{self.url}/{name}: stored copy differs from {src} (size or checksum); deleted")

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


class GCSStore(_StoreBase):
    """``gs://bucket[/prefix]`` through google-cloud-storage.

    Credentials come from ``GOOGLE_APPLICATION_CREDENTIALS`` / application default credentials,
    or none at all when ``STORAGE_EMULATOR_HOST`` points at an emulator. Uploads over 8 MiB are
    resumable; every upload is crc32c-checked by the library and then against the stored
    object's size and crc32c; ``once`` is a real precondition (``if_generation_match=0``).
    """

    def __init__(self, url: str, retry_seconds: float = 120):
        from google.api_core.retry import Retry
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage

        bucket, self.prefix = _bucket_and_prefix(url, "gs")
        try:
            self.client = storage.Client()
        except DefaultCredentialsError as e:
            raise ValueError(
                f"{url}: no Google credentials; set GOOGLE_APPLICATION_CREDENTIALS, run "
                "`gcloud auth application-default login`, or set STORAGE_EMULATOR_HOST for an emulator"
            ) from e
        self.url = url.rstrip("/")
        self.bucket = self.client.bucket(bucket)
        # every call here is idempotent (uploads are whole-object), so retry them all, with backoff
        self.retry = Retry(initial=1.0, maximum=16.0, multiplier=2.0, timeout=retry_seconds, predicate=_gcs_transient)

    def _blob(self, name: str):
        return self.bucket.blob(self.prefix + _checked(name, self.url))

    def exists(self, name: str) -> bool:
        return self._blob(name).exists(retry=self.retry)

    def size(self, name: str) -> int:
        blob = self._blob(name)
        blob.reload(retry=self.retry)
        return int(blob.size)

    def list(self, prefix: str = "") -> list[str]:
        blobs = self.client.list_blobs(self.bucket, prefix=self.prefix + prefix, retry=self.retry)
        return sorted(b.name[len(self.prefix) :] for b in blobs)

    def delete(self, name: str) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            self._blob(name).delete(retry=self.retry)

    def delete_if(self, name: str, data: bytes) -> bool:
        """Delete ``name`` if it still holds ``data``: the delete is conditional on the generation read."""
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.get_blob(self.prefix + _checked(name, self.url), retry=self.retry)
        try:
            if blob is None or blob.download_as_bytes(if_generation_match=blob.generation, retry=self.retry) != data:
                return False
            blob.delete(if_generation_match=blob.generation, retry=self.retry)
        except (NotFound, PreconditionFailed):  # replaced or gone meanwhile
            return False
        return True

    def open(self, name: str) -> BinaryIO:
        return self._blob(name).open("rb", retry=self.retry)

    def read_bytes(self, name: str) -> bytes:
        return self._blob(name).download_as_bytes(retry=self.retry)

    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        from google.api_core.exceptions import PreconditionFailed
        from google.resumable_media.common import DataCorruption

        try:
            blob = self._blob(name)
            try:
                blob.upload_from_filename(
                    str(src), checksum="crc32c", if_generation_match=0 if once else None, retry=self.retry
                )
            except PreconditionFailed as e:
                raise FileExistsError(f"{self.url}/{name} exists") from e
            except DataCorruption as e:  # the server got other bytes than were sent
                self.delete(name)
                raise OSError(f"{self.url}/{name}: corrupted in transit (crc32c mismatch); deleted") from e
            blob.reload(retry=self.retry)
            if (int(blob.size), blob.crc32c) != (src.stat().st_size, file_crc32c(src)):
                self.delete(name)
                raise OSError(f"{self.url}/{name}: stored object differs from {src} (size or crc32c); deleted")
        finally:
            if not keep:
                src.unlink(missing_ok=True)

    def matches(self, name: str, path: Path) -> bool:
        blob = self.bucket.get_blob(self.prefix + name, retry=self.retry)
        return blob is not None and (int(blob.size), blob.crc32c) == (path.stat().st_size, file_crc32c(path))


class HTTPStore(_StoreBase):
    """``http(s)://host[:port]/prefix``: a read-only location, e.g. shards served by ``./run serve``.

    Every request is retried while the server is unreachable or answers 5xx, for up to
    ``retry_seconds``; a read cut off midway resumes at its offset with a range request
    (``If-Range`` makes a file replaced meanwhile an error, not a splice). HTTPS verifies
    against ``REQUESTS_CA_BUNDLE`` (or ``SSL_CERT_FILE``) when set, else the system's CAs.
    """

    def __init__(self, url: str, retry_seconds: float = 120):
        import requests

        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ValueError(f"bad storage URL {url!r}: expected http(s)://host[:port][/prefix]")
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.session = requests.Session()
        self.session.headers["Accept-Encoding"] = "identity"  # byte offsets must be the file's
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
        if bundle:
            self.session.verify = bundle

    def request(self, method: str, name: str, headers: dict[str, str] | None = None):
        """One request, retried on connection errors and 5xx; 404 is FileNotFoundError."""
        import requests
        from tenacity import (
            Retrying,
            retry_if_exception_type,
            retry_if_not_exception_type,
            stop_after_delay,
            wait_exponential,
        )

        url = f"{self.url}/{_checked(name, self.url)}"
        retrying = Retrying(
            stop=stop_after_delay(self.retry_seconds),
            wait=wait_exponential(multiplier=0.25, max=4),
            # down, unreachable or overloaded: worth waiting for; a certificate that fails is not
            retry=retry_if_exception_type((requests.ConnectionError, requests.Timeout, _ServerError))
            & retry_if_not_exception_type(requests.exceptions.SSLError),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    response = self.session.request(method, url, headers=headers, stream=True, timeout=(10, 60))
                    if response.status_code >= 500:
                        response.close()
                        raise _ServerError(f"{url}: the server answered {response.status_code}")
        except requests.exceptions.SSLError as e:
            reason = re.search(r"certificate verify failed: [^')(]+", str(e))
            raise OSError(
                f"{url}: TLS verification failed ({reason[0].strip() if reason else 'see the cause'}); "
                "point REQUESTS_CA_BUNDLE at the CA certificate that signed the server's"
            ) from e
        except requests.RequestException as e:
            raise OSError(f"{url}: unreachable for {self.retry_seconds:.0f}s: {e}") from e
        if response.status_code == 404:
            response.close()
            raise FileNotFoundError(f"{url}: not found (404)")
        if response.status_code >= 400:
            response.close()
            raise OSError(f"{url}: the server answered {response.status_code}")
        return response

    def exists(self, name: str) -> bool:
        try:
            self.request("HEAD", name).close()
        except FileNotFoundError:
            return False
        return True

    def size(self, name: str) -> int:
        with self.request("HEAD", name) as response:
            return int(response.headers["Content-Length"])

    def open(self, name: str) -> BinaryIO:
        return io.BufferedReader(_ResumingReader(self, name), buffer_size=1 << 20)

    def read_bytes(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def _read_only(self) -> ValueError:
        return ValueError(f"{self.url}: HTTP locations are read-only (write to a directory, then ./run serve it)")

    def list(self, prefix: str = "") -> list[str]:
        raise self._read_only()  # plain HTTP has no listing; readers go by the manifest

    def delete(self, name: str) -> None:
        raise self._read_only()

    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        raise self._read_only()


class _ServerError(OSError):
    """A 5xx answer: worth another try."""


class _ResumingReader(io.RawIOBase):
    """An HTTP GET as a file; a connection lost midway resumes from the offset reached."""

    def __init__(self, store: HTTPStore, name: str):
        self.store, self.name = store, name
        self.offset, self.total, self.validator = 0, -1, ""
        self.response = self._get()

    def _get(self):
        headers = {}
        if self.offset:
            headers = {"Range": f"bytes={self.offset}-"}
            if self.validator:
                headers["If-Range"] = self.validator
        response = self.store.request("GET", self.name, headers)
        if self.offset and response.status_code != 206:
            response.close()
            raise OSError(f"{self.store.url}/{self.name}: changed on the server while being read")
        if not self.offset:
            self.total = int(response.headers.get("Content-Length", -1))
            self.validator = response.headers.get("ETag") or response.headers.get("Last-Modified", "")
        return response

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        import requests
        from urllib3.exceptions import HTTPError

        deadline = time.monotonic() + self.store.retry_seconds
        while True:
            try:
                data = self.response.raw.read1(len(buffer), decode_content=False)  # what has arrived
            except (HTTPError, requests.RequestException, OSError) as e:
                data, error = b"", e
            else:
                error = None
            if data or self.offset == self.total or (error is None and self.total < 0):
                buffer[: len(data)] = data
                self.offset += len(data)
                return len(data)
            # cut off before the end: reconnect from here (request() retries while it is down)
            self.response.close()
            if time.monotonic() > deadline:
                raise OSError(f"{self.store.url}/{self.name}: reads keep failing at byte {self.offset}: {error}")
            self.response = self._get()

    def close(self) -> None:
        if not self.closed:
            self.response.close()
        super().close()


def _gcs_transient(e: Exception) -> bool:
    """Network errors and 408/429/5xx: worth retrying."""
    import requests
    from google.api_core import exceptions as gexc

    if isinstance(e, (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return True
    return isinstance(
        e,
        (
            gexc.TooManyRequests,
            gexc.InternalServerError,
            gexc.BadGateway,
            gexc.ServiceUnavailable,
            gexc.GatewayTimeout,
            gexc.RequestRangeNotSatisfiable,
        ),
    ) or (isinstance(e, gexc.GoogleAPICallError) and e.code == 408)


def file_crc32c(path: Path) -> str:
    """Base64 big-endian crc32c, as GCS reports it."""
    import base64

    import google_crc32c

    checksum = google_crc32c.Checksum()
    for block in _blocks(path.open("rb")):
        checksum.update(block)
    return base64.b64encode(checksum.digest()).decode()


class _VerifyFailed(OSError):
    """An upload whose read-back differs from what was sent."""


def _ais_retryable(e: BaseException) -> bool:
    """Worth another PUT: a copy that failed verification, a 5xx, or a 404 for a PUT (a target
    racing a dropped client's PUT of the same name answers "work file does not exist")."""
    from aistore.sdk.errors import AISError

    return isinstance(e, _VerifyFailed) or (isinstance(e, AISError) and (e.status_code == 404 or e.status_code >= 500))


def _ais_message(e) -> str:
    """The reason in an AIStore error body (JSON with a "message"), else the body, else a hint."""
    import json

    try:
        return json.loads(e.message)["message"]
    except (ValueError, TypeError, KeyError):
        return e.message or "no reason given (a bad bucket or object name?)"


def _not_found(e: Exception) -> bool:
    """An AIStore 404: no such object or bucket (a HEAD's 404 carries no error body to tell which)."""
    from aistore.sdk.errors import AISError

    return isinstance(e, AISError) and e.status_code == 404


# AIStore's checksum types this client computes too; "xxhash2" is XXH64 with seed 0
_CHECKSUMS = ("xxhash2", "sha256", "md5")


def _file_checksum(path: Path, kind: str) -> str:
    import xxhash

    return _hexdigest(path.open("rb"), xxhash.xxh64(seed=0) if kind == "xxhash2" else hashlib.new(kind))


def stream_sha256(stream: BinaryIO) -> str:
    """SHA-256 of everything left in ``stream``, which is closed afterwards."""
    return _hexdigest(stream, hashlib.sha256())


def _hexdigest(stream: BinaryIO, h: Any) -> str:
    for block in _blocks(stream):
        h.update(block)
    return h.hexdigest()


def open_store(url: str, retry_seconds: float = 120) -> Store:
    """The store for a location URL; unsupported schemes fail with a one-line reason.

    ``retry_seconds`` bounds the retries of a GCS or HTTP call (AIStore uses its SDK's defaults)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return LocalStore(url)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "ais":
        return AISStore(url)
    if scheme == "gs":
        return GCSStore(url, retry_seconds)
    if scheme in ("http", "https"):
        return HTTPStore(url, retry_seconds)
    raise ValueError(f"unsupported storage URL {url!r}: use a local directory, file://, ais://, gs:// or http(s)://")
