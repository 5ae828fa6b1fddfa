"""``ais://bucket[/prefix]``: AIStore through its Python SDK, with resumed reads and verified uploads."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from http.client import IncompleteRead
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from aistore.sdk import Client
from aistore.sdk.errors import AISError
from aistore.sdk.obj.object import Object
from aistore.sdk.request_client import RequestClient
from aistore.sdk.response_handler import AISResponseHandler
from aistore.sdk.retry_config import RetryConfig
from requests import ConnectionError as RequestsConnectionError
from requests import RequestException, Response, Timeout
from requests.exceptions import ChunkedEncodingError, SSLError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from imagenet_ais.errors import AlreadyThere, ConfigError, StorageError
from imagenet_ais.storage.ais_playground import running_endpoint
from imagenet_ais.storage.base import (
    AIS_CHECKSUMS,
    _bucket_and_prefix,
    _checked,
    _same_bytes,
    _StoreBase,
    file_checksum,
)

T = TypeVar("T")


class _VerifyFailed(StorageError):
    """An upload whose read-back differs from what was sent."""


def _ais_retryable(e: BaseException) -> bool:
    """Worth another PUT: a copy that failed verification, a dropped connection or a timeout (not
    a TLS failure: a certificate does not mend itself), or a 404 for a PUT (a target racing a
    dropped client's PUT of the same name answers "work file does not exist"). A 429 or 5xx the
    SDK's session has already retried (for 93 s)."""
    if isinstance(e, AISError):
        return e.status_code == 404
    return isinstance(e, _VerifyFailed | RequestsConnectionError | Timeout | ChunkedEncodingError) and not isinstance(
        e, SSLError
    )


def _endpoint(url: str) -> str:
    """``AIS_ENDPOINT``, else the local playground's (./run ais-up) while it runs, as ./run finds it."""
    endpoint = os.environ.get("AIS_ENDPOINT") or running_endpoint()
    if not endpoint:
        raise ConfigError(
            f"{url}: set AIS_ENDPOINT to the cluster's URL (e.g. http://aistore-proxy:51080), "
            "or start the local playground with ./run ais-up"
        )
    return endpoint


def _client(endpoint: str) -> Client:
    """The SDK's client, retrying a network error as the SDK does by default (7 tries, 1-30 s
    apart), but saying so in one line. The SDK logs each retry and then the whole traceback to
    the root logger: where the program configured no logging, 79 lines on stderr before the one
    that says what went wrong."""
    policy = RetryConfig.default()
    policy.network_retry = policy.network_retry.copy(
        before_sleep=functools.partial(_retrying, endpoint), retry_error_callback=None, reraise=True
    )
    return Client(endpoint, token=os.environ.get("AIS_AUTHN_TOKEN") or None, retry_config=policy)


def _retrying(endpoint: str, state: RetryCallState) -> None:
    if state.attempt_number == 1 and state.outcome is not None:  # once per request
        error = state.outcome.exception()
        why = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
        print(
            f"note: AIStore at {endpoint}: {why[0] if why else type(error).__name__}; retrying for up to a minute",
            file=sys.stderr,
            flush=True,
        )


def _put_on_target(client: RequestClient, url: str, body: BinaryIO | bytes, size: int) -> Response:
    """PUT ``body`` (an object, or a part of one) at ``url`` to the target that stores it, asking
    the proxy where that is first.

    A proxy answers an object's PUT with a redirect to its target. Over plain HTTP the SDK
    sends the body along, so every byte goes to the proxy, which drops it, before going to the
    target: 0.60 s against 0.08 s for a 106 MiB shard on loopback. Over HTTPS the SDK asks with
    an empty body first; this does the same whatever the scheme.
    """
    session, handler = client.session_manager.session, AISResponseHandler()
    auth = {"Authorization": f"Bearer {client.token}"} if client.token else {}
    # The length, as the SDK sends it: a cluster with authentication signs the redirect with it.
    # The proxy never reads the body announced, so that connection cannot serve another request.
    asking = {**auth, "Content-Length": str(size), "Connection": "close"}
    answer = session.put(url, data=b"", headers=asking, allow_redirects=False, timeout=client.timeout)
    target = answer.headers.get("Location") if answer.is_redirect else None
    if target is None:
        handler.handle_response(answer)  # raises the cluster's error
        raise AISError(answer.status_code, "the proxy did not redirect the PUT to a target", answer.url, answer.request)
    return handler.handle_response(session.put(target, data=body, headers=auth, timeout=client.timeout))


def _ais_message(e: AISError) -> str:
    """The reason in an AIStore error body (JSON with a "message"), else the body, else a hint."""
    try:
        return json.loads(e.message)["message"]
    except (ValueError, TypeError, KeyError):
        return e.message or "no reason given (a bad bucket or object name?)"


def _not_found(e: Exception) -> bool:
    """An AIStore 404: no such object or bucket (a HEAD's 404 carries no error body to tell which)."""
    return isinstance(e, AISError) and e.status_code == 404


# a GET's body breaking off mid-read (a target restarted, a dropped connection, a short body)
BROKEN_READ = (ProtocolError, ReadTimeoutError, IncompleteRead, ConnectionError)


@contextlib.contextmanager
def _one_line_errors(where: str) -> Iterator[None]:
    """The SDK's errors as an OSError naming ``where``: one line, and picklable (the SDK's and
    requests' errors carry the request, so they cannot come back from a worker process)."""
    try:
        yield
    except AISError as e:
        raise StorageError(f"{where}: AIStore answered {e.status_code}: {_ais_message(e)}") from e
    except (RequestException, *BROKEN_READ) as e:
        raise StorageError(f"{where}: {e}") from e


def _ais_errors(method: Callable[..., T]) -> Callable[..., T]:
    """``_one_line_errors`` around a method that takes the object name (or prefix) as its last
    positional argument."""

    @functools.wraps(method)
    def wrapper(self: AISStore, *args: Any, **kwargs: Any) -> T:
        with _one_line_errors(f"{self.url}/{args[-1] if args else ''}"):
            return method(self, *args, **kwargs)

    return wrapper


class _ResumingGet(io.BufferedIOBase):
    """An AIStore object's bytes, read off its GET response a chunk at a time and handed out
    from that chunk; a GET that breaks off (a target restarted, a dropped connection, a short
    body) is sent again for the rest, from the byte it stopped at, up to ``max_resume`` times.

    The SDK's file object does the same over its chunk iterator, and ``io.BufferedReader`` over
    urllib3's ``readinto`` copied each megabyte once more: 0.6-0.75 of a plain GET's speed
    (bench/shard_reads.py, RESULTS.md).
    """

    def __init__(self, obj: Any, where: str, max_resume: int, chunk: int, sent: Callable[[], None]):
        self.obj, self.where, self.max_resume, self.chunk, self.sent = obj, where, max_resume, chunk, sent
        self.fetched = 0  # bytes taken off the responses so far
        self.resumed = 0
        self.sent()
        self.response = obj.get_reader().raw()  # urllib3's response, streaming
        self.data, self.view = b"", memoryview(b"")  # the chunk in hand, and its unread part

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        with _one_line_errors(self.where):  # as the store's methods: read in worker processes too
            while True:
                try:
                    data = self.response.read(self.chunk)
                except BROKEN_READ:
                    if self.resumed == self.max_resume:
                        raise
                    self.resumed += 1
                    self.response.close()
                    time.sleep(min(5.0, 0.5 * self.resumed))  # besides the SDK's own retries: a target restarts
                    self.sent()
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
    """``ais://bucket[/prefix]`` on the AIStore cluster at ``AIS_ENDPOINT``, else on the local
    playground while it runs (token: ``AIS_AUTHN_TOKEN``).

    Reads stream off the GET response and resume an interrupted GET where it broke off. Writes
    count once verified: the checksum the target computed of what it stored (the bucket's type,
    xxhash2 by default, in the PUT's answer) must equal ours of the file; a multipart upload
    (over MULTIPART_THRESHOLD), or a bucket keeping another checksum type, is read back instead.
    """

    MULTIPART_THRESHOLD = 256 << 20  # larger uploads go in parts of MULTIPART_PART
    MULTIPART_PART = 64 << 20
    MAX_RESUME = 10  # re-GETs from the last offset per stream before a read fails
    READ_CHUNK = 1 << 20  # bytes per network read, at most
    PUT_TRIES = 7  # on top of the SDK session's retries of 429/5xx

    def __init__(self, url: str):
        bucket, self.prefix = _bucket_and_prefix(url, "ais")
        self.url = url.rstrip("/")
        self.bucket = _client(_endpoint(url)).bucket(bucket)
        self._bucket_ready = False

    def _obj(self, name: str) -> Object:
        return self.bucket.object(self.prefix + _checked(name, self.url))

    @_ais_errors
    def exists(self, name: str) -> bool:
        self._sent()
        try:
            self._obj(name).head()
        except Exception as e:
            if _not_found(e):
                return False
            raise
        return True

    @_ais_errors
    def size(self, name: str) -> int:
        self._sent()  # (reads are counted at their calls: the SDK's sessions are made anew in each process)
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
        where = f"{self.url}/{name}"
        return _ResumingGet(self._obj(name), where, self.MAX_RESUME, self.READ_CHUNK, self._sent)  # type: ignore[return-value]

    @_ais_errors
    def read_bytes(self, name: str) -> bytes:
        self._sent()
        return self._obj(name).get_reader().read_all()

    @_ais_errors
    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        """Upload, verified by checksum (the target's, or a read-back) and size; a bad copy is deleted.

        A failed attempt is tried again while ``_ais_retryable`` says so.
        AIStore has no write preconditions: ``once`` is an existence check just before the PUT.
        """
        try:
            if not self._bucket_ready:
                self.bucket.create(exist_ok=True)
                self._bucket_ready = True
            if once and self.exists(name):
                raise AlreadyThere(f"{self.url}/{name} exists")
            retrying = Retrying(  # the SDK's own policy for network errors (7 tries, 1-30 s apart)
                stop=stop_after_attempt(self.PUT_TRIES),
                wait=wait_random_exponential(multiplier=1, min=1, max=30),
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
            with src.open("rb") as body:
                headers = _put_on_target(self.bucket.client, obj.get_url(), body, size).headers
            stored = (headers.get("ais-checksum-type", ""), headers.get("ais-checksum-value", ""))
        if stored and stored[0] in AIS_CHECKSUMS:  # no read-back
            same = self.size(name) == size and file_checksum(src, stored[0]) == stored[1]
        else:
            same = _same_bytes(self, name, src)
        if not same:
            self.delete(name)
            raise _VerifyFailed(f"{self.url}/{name}: stored copy differs from {src} (size or checksum); deleted")

    def _put_multipart(self, obj: Object, src: Path) -> None:
        upload = obj.multipart_upload().create()
        try:
            with src.open("rb") as f:
                for number, part in enumerate(iter(lambda: f.read(self.MULTIPART_PART), b""), start=1):
                    url = upload.client.get_full_url(upload.object_path, upload.add_part(number).query_params)
                    _put_on_target(upload.client, url, part, len(part))
            upload.complete()
        except BaseException:
            with contextlib.suppress(Exception):
                upload.abort()
            raise
