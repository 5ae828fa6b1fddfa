"""Storage URLs: where shards and manifests live, behind one small interface.

A location is a directory-like URL: a local path or ``file://``, ``ais://bucket/prefix``,
``gs://bucket/prefix``, ``s3://bucket/prefix`` (S3 or a compatible server), or (read-only)
``http(s)://host[:port]/prefix``.
Writes are all-or-nothing: an object appears under its final name only once it is complete.

One module per backend (local, ais, gcs, s3, http) beside base (the Store interface and what they share).
The remote backends load their SDKs with their modules, which are imported only when first used
(by open_store, or by importing one of their names from here): a local-only run never imports them.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from imagenet_ais.errors import ConfigError
from imagenet_ais.storage.base import HashingReader, Store, check_location, download, is_inside, stream_sha256
from imagenet_ais.storage.local import LocalStore

if TYPE_CHECKING:
    from imagenet_ais.storage.ais import AISStore
    from imagenet_ais.storage.gcs import GCSStore, file_crc32c
    from imagenet_ais.storage.http import HTTPStore
    from imagenet_ais.storage.s3 import S3Store

__all__ = [
    "AISStore",
    "GCSStore",
    "HTTPStore",
    "HashingReader",
    "LocalStore",
    "S3Store",
    "Store",
    "check_location",
    "download",
    "file_crc32c",
    "is_inside",
    "is_local",
    "open_store",
    "process_store",
    "stream_sha256",
]

# name → its module
_LAZY = {"AISStore": "ais", "GCSStore": "gcs", "file_crc32c": "gcs", "HTTPStore": "http", "S3Store": "s3"}


def __getattr__(name: str) -> Any:
    """The remote backends' names, from their modules on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


def is_local(url: str) -> bool:
    """Whether a location is on this machine's disk (a path or ``file://``)."""
    scheme, sep, _ = url.partition("://")
    return not sep or scheme == "file"


def open_store(url: str, retry_seconds: float = 120) -> Store:
    """The store for a location URL; unsupported schemes, or credentials in it, fail with a
    one-line reason.

    ``retry_seconds`` bounds the retries of a GCS or HTTP call (AIStore uses its SDK's defaults)."""
    check_location(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return LocalStore(url)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "ais":
        from imagenet_ais.storage.ais import AISStore

        return AISStore(url)
    if scheme == "gs":
        from imagenet_ais.storage.gcs import GCSStore

        return GCSStore(url, retry_seconds)
    if scheme == "s3":
        from imagenet_ais.storage.s3 import S3Store

        return S3Store(url, retry_seconds)
    if scheme in ("http", "https"):
        from imagenet_ais.storage.http import HTTPStore

        return HTTPStore(url, retry_seconds)
    raise ConfigError(
        f"unsupported storage URL {url!r}: use a local directory, file://, ais://, gs://, s3:// or http(s)://"
    )


@functools.cache
def process_store(url: str) -> Store:
    """One store for ``url`` per process, kept for its next reads (its connections too): each
    DataLoader or convert worker opens its own."""
    return open_store(url)
