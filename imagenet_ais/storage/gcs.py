"""``gs://bucket[/prefix]``: Google Cloud Storage (or an emulator) through google-cloud-storage."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import BinaryIO

import google_crc32c
import requests
from google.api_core import exceptions as gexc
from google.api_core.exceptions import NotFound, PreconditionFailed
from google.api_core.retry import Retry
from google.auth.exceptions import DefaultCredentialsError
from google.cloud import storage
from google.resumable_media.common import DataCorruption

from imagenet_ais.errors import AlreadyThere, ConfigError, StorageError
from imagenet_ais.storage.base import _blocks, _bucket_and_prefix, _checked, _StoreBase


def _gcs_transient(e: Exception) -> bool:
    """Network errors and 408/429/5xx: worth retrying."""
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
    checksum = google_crc32c.Checksum()
    for block in _blocks(path.open("rb")):
        checksum.update(block)
    return base64.b64encode(checksum.digest()).decode()


class GCSStore(_StoreBase):
    """``gs://bucket[/prefix]`` through google-cloud-storage.

    Credentials come from ``GOOGLE_APPLICATION_CREDENTIALS`` / application default credentials,
    or none at all when ``STORAGE_EMULATOR_HOST`` points at an emulator. Uploads over 8 MiB are
    resumable; every upload is crc32c-checked by the library and then against the stored
    object's size and crc32c; ``once`` is a real precondition (``if_generation_match=0``).
    """

    def __init__(self, url: str, retry_seconds: float = 120):
        bucket, self.prefix = _bucket_and_prefix(url, "gs")
        try:
            self.client = storage.Client()
            self.client._http.hooks["response"].append(self._sent)  # (the client's requests.Session)
        except DefaultCredentialsError as e:
            raise ConfigError(
                f"{url}: no Google credentials; set GOOGLE_APPLICATION_CREDENTIALS, run "
                "`gcloud auth application-default login`, or set STORAGE_EMULATOR_HOST for an emulator"
            ) from e
        self.url = url.rstrip("/")
        self.bucket = self.client.bucket(bucket)
        # every call here is idempotent (uploads are whole-object), so retry them all, with backoff
        self.retry = Retry(initial=1.0, maximum=16.0, multiplier=2.0, timeout=retry_seconds, predicate=_gcs_transient)

    def _blob(self, name: str) -> storage.Blob:
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
        with contextlib.suppress(NotFound):
            self._blob(name).delete(retry=self.retry)

    def delete_if(self, name: str, data: bytes) -> bool:
        """Delete ``name`` if it still holds ``data``: the delete is conditional on the generation read."""
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
        try:
            blob = self._blob(name)
            try:
                blob.upload_from_filename(
                    str(src), checksum="crc32c", if_generation_match=0 if once else None, retry=self.retry
                )
            except PreconditionFailed as e:
                raise AlreadyThere(f"{self.url}/{name} exists") from e
            except DataCorruption as e:  # the server got other bytes than were sent
                self.delete(name)
                raise StorageError(f"{self.url}/{name}: corrupted in transit (crc32c mismatch); deleted") from e
            blob.reload(retry=self.retry)
            if (int(blob.size), blob.crc32c) != (src.stat().st_size, file_crc32c(src)):
                self.delete(name)
                raise StorageError(f"{self.url}/{name}: stored object differs from {src} (size or crc32c); deleted")
        finally:
            if not keep:
                src.unlink(missing_ok=True)

    def matches(self, name: str, path: Path) -> bool:
        blob = self.bucket.get_blob(self.prefix + _checked(name, self.url), retry=self.retry)
        return blob is not None and (int(blob.size), blob.crc32c) == (path.stat().st_size, file_crc32c(path))
