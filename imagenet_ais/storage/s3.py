"""``s3://bucket[/prefix]``: Amazon S3 or any S3-compatible server, through boto3.

The standard AWS settings choose the server and identity: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``; then path-style addressing, as MinIO and AIStore's ``/s3`` need),
``AWS_PROFILE``, ``AWS_REGION``, the access keys, ``~/.aws/config``; ``AWS_MAX_ATTEMPTS`` and
``AWS_RETRY_MODE`` the SDK's retries (standard mode, 8 attempts, where unset).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from imagenet_ais.errors import AlreadyThere, ConfigError, NotFound, StorageError
from imagenet_ais.storage.base import (
    AIS_CHECKSUMS,
    _bucket_and_prefix,
    _checked,
    _StoreBase,
    file_checksum,
    stream_sha256,
)

SINGLE_PUT = 5 << 30  # S3's largest single PUT; larger files go up in parts (and are read back)
_MISSING = {"404", "NoSuchKey", "NotFound"}


@contextlib.contextmanager
def _one_line(where: str) -> Iterator[None]:
    """The SDK's failures as ours: one line, naming the object and what to do."""
    try:
        yield
    except bexc.NoCredentialsError as e:
        raise ConfigError(
            f"{where}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        ) from e
    except bexc.EndpointConnectionError as e:
        raise StorageError(f"{where}: cannot reach the S3 server ({e}); check AWS_ENDPOINT_URL") from e
    except bexc.ClientError as e:
        error, status = e.response.get("Error", {}), e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code, message = str(error.get("Code", status)), error.get("Message", "")
        if code == "NoSuchBucket":
            raise NotFound(f"{where}: no such bucket") from e
        if code in _MISSING:
            raise NotFound(f"{where}: not found") from e
        if code in ("TemporaryRedirect", "307"):
            raise StorageError(
                f"{where}: the server redirects (an AIStore gateway?): turn on its S3-Reverse-Proxy feature "
                "(ais config cluster features S3-Reverse-Proxy), or read it as ais://"
            ) from e
        hint = ": check the AWS credentials and the bucket's policy" if code in ("AccessDenied", "403") else ""
        raise StorageError(f"{where}: {code} {message}{hint}".rstrip()) from e


def _client() -> Any:
    """An S3 client from the standard AWS settings (a session of its own: nothing process-wide)."""
    settings: dict[str, Any] = {}
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        settings["retries"] = {"mode": "standard", "max_attempts": 8}
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        settings["s3"] = {"addressing_style": "path"}
    return boto3.session.Session().client("s3", config=Config(**settings))


class _ResumingBody(io.RawIOBase):
    """An object's GET as a file; a body cut off midway is asked for again from the byte it
    reached, of the same version (``If-Match`` its ETag), a few times."""

    def __init__(self, store: S3Store, key: str, where: str):
        self.store, self.key, self.where = store, key, where
        self.offset, self.resumed = 0, 0
        with _one_line(where):
            answer = store.client.get_object(Bucket=store.bucket, Key=key)
        self.size, self.etag, self.body = answer["ContentLength"], answer.get("ETag"), answer["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            try:
                data = self.body.read(len(buffer))
            except (bexc.IncompleteReadError, bexc.ResponseStreamingError, bexc.ReadTimeoutError, OSError):
                data = b""
            if data or self.offset >= self.size:
                buffer[: len(data)] = data
                self.offset += len(data)
                return len(data)
            if self.resumed == 5:
                raise StorageError(f"{self.where}: reads keep failing at byte {self.offset} of {self.size}")
            self.resumed += 1
            self.body.close()
            extra = {"IfMatch": self.etag} if self.etag else {}
            with _one_line(self.where):
                self.body = self.store.client.get_object(
                    Bucket=self.store.bucket, Key=self.key, Range=f"bytes={self.offset}-", **extra
                )["Body"]

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()


# S3's rules for a bucket's name (AWS; MinIO, Ceph and AIStore's /s3 follow them)
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class S3Store(_StoreBase):
    """``s3://bucket[/prefix]`` through boto3.

    Uploads count once verified: S3 checks the SHA-256 the PUT sends and keeps it, and the
    stored object's (HEAD) must equal ours of the file; a server that keeps none answers with
    its own (AIStore's checksum of the object), or else the object is read back and compared.
    ``once`` is a conditional PUT (``If-None-Match: *``) after an existence check, for servers
    that ignore the condition.
    """

    def __init__(self, url: str, retry_seconds: float = 120):
        self.bucket, self.prefix = _bucket_and_prefix(url, "s3")
        self.url = url.rstrip("/")
        if not BUCKET_NAME.fullmatch(self.bucket):  # (botocore's ParamValidationError was a traceback)
            raise ConfigError(
                f"bad storage URL {url!r}: {self.bucket!r} is no S3 bucket name (3-63 of a-z, 0-9, '.', '-', "
                "starting and ending with a letter or digit)"
            )
        with _one_line(self.url):
            self.client = _client()
        self.client.meta.events.register("before-send.s3", self._sent)  # (every attempt)

    def _key(self, name: str) -> str:
        return self.prefix + _checked(name, self.url)

    def _head(self, name: str, **extra: str) -> dict[str, Any] | None:
        try:
            with _one_line(f"{self.url}/{name}"):
                return self.client.head_object(Bucket=self.bucket, Key=self._key(name), **extra)
        except NotFound:
            return None

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def size(self, name: str) -> int:
        if (head := self._head(name)) is None:
            raise NotFound(f"{self.url}/{name}: not found")
        return int(head["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        with _one_line(self.url):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            )
            return sorted(o["Key"][len(self.prefix) :] for page in pages for o in page.get("Contents", []))

    def delete(self, name: str) -> None:
        with contextlib.suppress(NotFound), _one_line(f"{self.url}/{name}"):  # (S3 says nothing; AIStore 404)
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def open(self, name: str) -> BinaryIO:
        return io.BufferedReader(_ResumingBody(self, self._key(name), f"{self.url}/{name}"), 1 << 20)

    def read_bytes(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def put_file(self, src: Path, name: str, *, keep: bool = False, once: bool = False) -> None:
        where = f"{self.url}/{name}"
        try:
            if once and self.exists(name):
                raise AlreadyThere(f"{where} exists")
            size = src.stat().st_size
            with _one_line(where):
                try:
                    if size <= SINGLE_PUT:
                        with src.open("rb") as body:
                            extra = {"IfNoneMatch": "*"} if once else {}
                            self.client.put_object(
                                Bucket=self.bucket, Key=self._key(name), Body=body, ChecksumAlgorithm="SHA256", **extra
                            )
                    else:
                        self.client.upload_file(str(src), self.bucket, self._key(name))
                except bexc.ClientError as e:
                    if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                        raise AlreadyThere(f"{where} exists") from e
                    raise
            if problem := self._differs(name, src):
                self.delete(name)
                raise StorageError(f"{where}: stored object differs from {src} ({problem}); deleted")
        finally:
            if not keep:
                src.unlink(missing_ok=True)

    def _differs(self, name: str, path: Path) -> str | None:
        """None when the stored ``name`` holds ``path``'s bytes, by the checksum the server
        computed where it gives one (else read back); what differs, if not."""
        head = self._head(name, ChecksumMode="ENABLED")
        if head is None:
            return "gone"
        if int(head["ContentLength"]) != path.stat().st_size:
            return f"size {head['ContentLength']}"
        if (stored := head.get("ChecksumSHA256")) and "-" not in stored:  # (not a checksum of parts)
            ours = base64.b64encode(bytes.fromhex(file_checksum(path, "sha256"))).decode()
            return None if ours == stored else "sha256"
        meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}  # (AIStore's come capitalised)
        if (kind := meta.get("ais-cksum-type")) in AIS_CHECKSUMS:
            return None if file_checksum(path, kind) == meta.get("ais-cksum-val") else kind
        return None if stream_sha256(self.open(name)) == stream_sha256(path.open("rb")) else "sha256, read back"

    def matches(self, name: str, path: Path) -> bool:
        return self.exists(name) and self._differs(name, path) is None
