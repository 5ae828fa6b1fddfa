"""``http(s)://host[:port]/prefix``: a read-only location, with retried requests and resumed reads."""

from __future__ import annotations

import io
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO

import requests
from requests.auth import AuthBase, HTTPBasicAuth
from tenacity import Retrying, retry_if_exception_type, retry_if_not_exception_type, stop_after_delay, wait_exponential
from urllib3.exceptions import HTTPError

from imagenet_ais.errors import ConfigError, NotFound, StorageError
from imagenet_ais.storage.base import _checked, _StoreBase, check_location

_REFUSED = {
    401: "the server asks for credentials: set SHARDS_HTTP_TOKEN (a bearer token), or SHARDS_HTTP_USER and "
    "SHARDS_HTTP_PASSWORD, to what it was given (./run serve's SERVE_TOKEN or SERVE_HTPASSWD)",
    403: "the server does not let this machine read (./run serve serves only SERVE_ALLOW's networks)",
}

# the environment's credentials → the one host this process sends them to, where SHARDS_HTTP_HOST names none
_SENT_TO: dict[tuple[str, ...], str] = {}


class _Bearer(AuthBase):
    def __init__(self, token: str):
        self.token = token

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request


def _host(netloc: str, scheme: str = "") -> tuple[str, int | None]:
    """A ``host[:port]``'s host in lower case and port (the scheme's where it names none and
    ``scheme`` is given); a ConfigError where it is not one."""
    try:
        parts = urllib.parse.urlsplit(f"//{netloc}")
        host, port = parts.hostname, parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # (a port that is no number, a '[' not closed)
        host = None
    if not host or "@" in netloc or "/" in netloc:
        raise ConfigError(f"{netloc!r}: not a host[:port]")
    return host, port


def _credentials(scheme: str, netloc: str) -> AuthBase | None:
    """The environment's credentials, for the host they are for: SHARDS_HTTP_HOST's, or where
    it names none, the first this process reads from (a second is a ConfigError: a token given
    for one server is not sent to another). None where there are none for ``netloc``."""
    token, user = os.environ.get("SHARDS_HTTP_TOKEN", ""), os.environ.get("SHARDS_HTTP_USER", "")
    if not (token or user):
        return None
    password = os.environ.get("SHARDS_HTTP_PASSWORD", "")
    auth = _Bearer(token) if token else HTTPBasicAuth(user, password)
    host, port = _host(netloc, scheme)
    if only := os.environ.get("SHARDS_HTTP_HOST"):
        try:
            theirs = _host(only)
        except ConfigError as e:
            raise ConfigError(
                f"SHARDS_HTTP_HOST={e}: give the host the credentials are for, e.g. 10.0.0.5:8080"
            ) from None
        return auth if theirs[0] == host and theirs[1] in (None, port) else None
    key, this = (token,) if token else (user, password), f"{host}:{port}"
    if (first := _SENT_TO.setdefault(key, this)) != this:
        given = "SHARDS_HTTP_TOKEN" if token else "SHARDS_HTTP_USER and SHARDS_HTTP_PASSWORD"
        raise ConfigError(
            f"{scheme}://{netloc}: {given} would go to {first} and to {this}: set SHARDS_HTTP_HOST to the one "
            "host[:port] they are for (the others are read without them)"
        )
    return auth


class _ServerError(StorageError):
    """A 5xx answer: worth another try."""


class _ResumingReader(io.RawIOBase):
    """An HTTP GET as a file; a connection lost midway resumes from the offset reached."""

    def __init__(self, store: HTTPStore, name: str):
        self.store, self.name = store, name
        self.offset, self.total, self.validator = 0, -1, ""
        self.response = self._get()

    def _get(self) -> requests.Response:
        headers = {}
        if self.offset:
            headers = {"Range": f"bytes={self.offset}-"}
            if self.validator:
                headers["If-Range"] = self.validator
        response = self.store.request("GET", self.name, headers)
        if self.offset and response.status_code != 206:
            response.close()
            raise StorageError(f"{self.store.url}/{self.name}: changed on the server while being read")
        if not self.offset:
            self.total = int(response.headers.get("Content-Length", -1))
            self.validator = response.headers.get("ETag") or response.headers.get("Last-Modified", "")
        return response

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # (a writable buffer: memoryview, bytearray)
        deadline = time.monotonic() + self.store.retry_seconds
        while True:
            error: Exception | None
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
                raise StorageError(f"{self.store.url}/{self.name}: reads keep failing at byte {self.offset}: {error}")
            self.response = self._get()

    def close(self) -> None:
        if not self.closed:
            self.response.close()
        super().close()


class HTTPStore(_StoreBase):
    """``http(s)://host[:port]/prefix``: a read-only location, e.g. shards served by ``./run serve``.

    Every request is retried while the server is unreachable or answers 5xx, for up to
    ``retry_seconds``; a read cut off midway resumes at its offset with a range request
    (``If-Range`` makes a file replaced meanwhile an error, not a splice). HTTPS verifies
    against ``REQUESTS_CA_BUNDLE`` (or ``SSL_CERT_FILE``) when set, else the system's CAs.
    Credentials, for a server that asks (``./run serve`` with SERVE_TOKEN or SERVE_HTPASSWD), come
    from the environment: ``SHARDS_HTTP_TOKEN`` (a bearer token), or ``SHARDS_HTTP_USER`` and
    ``SHARDS_HTTP_PASSWORD`` (basic auth). They go to one host alone: ``SHARDS_HTTP_HOST``
    (host[:port]), or where it is unset, the only one the process reads from. A redirect to
    another host (or port, or scheme) does not take them along (requests drops them).
    """

    def __init__(self, url: str, retry_seconds: float = 120):
        check_location(url)
        scheme, _, rest = url.partition("://")
        netloc = rest.split("/")[0]
        if scheme not in ("http", "https") or not netloc:
            raise ConfigError(f"bad storage URL {url!r}: expected http(s)://host[:port][/prefix]")
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.session = requests.Session()
        self.session.headers["Accept-Encoding"] = "identity"  # byte offsets must be the file's
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
        if bundle:
            self.session.verify = bundle
        self.session.auth = _credentials(scheme, netloc)
        self.session.hooks["response"].append(self._sent)

    def request(self, method: str, name: str, headers: dict[str, str] | None = None) -> requests.Response:
        """One request, retried on connection errors and 5xx; 404 is FileNotFoundError."""
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
            raise StorageError(
                f"{url}: TLS verification failed ({reason[0].strip() if reason else 'see the cause'}); "
                "point REQUESTS_CA_BUNDLE at the CA certificate that signed the server's"
            ) from e
        except requests.RequestException as e:
            raise StorageError(f"{url}: unreachable for {self.retry_seconds:.0f}s: {e}") from e
        if response.status_code == 404:
            response.close()
            raise NotFound(f"{url}: not found (404)")
        if response.status_code in (401, 403):
            response.close()
            why = _REFUSED[response.status_code]
            if response.status_code == 401 and not self.session.auth and (only := os.environ.get("SHARDS_HTTP_HOST")):
                why += f" (they go to SHARDS_HTTP_HOST's {only} alone)"
            raise StorageError(f"{url}: refused ({response.status_code}): {why}")
        if response.status_code >= 400:
            response.close()
            raise StorageError(f"{url}: the server answered {response.status_code}")
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

    def _read_only(self) -> ConfigError:
        return ConfigError(f"{self.url}: HTTP locations are read-only (write to a directory, then ./run serve it)")

    def list(self, prefix: str = "") -> list[str]:
        raise self._read_only()  # plain HTTP has no listing; readers go by the manifest

    def delete(self, name: str) -> None:
        raise self._read_only()

    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        raise self._read_only()
