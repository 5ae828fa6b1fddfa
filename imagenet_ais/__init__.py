"""Train ImageNet-class models from WebDataset shards (local, AIStore, GCS, S3, HTTP).

Four parts, each a subpackage: ``shards`` (the shard format and its tools), ``loader`` (the
data path as a library: ``ShardLoader``), ``train`` (the training run) and ``cli`` (the
command lines), over ``storage`` (where shards and runs live). A dependency runs one way:
cli → train → loader → shards → storage.

``from imagenet_ais import ShardLoader``: the data path for any training loop (loader/).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "DataError",
    "Interrupted",
    "NotFound",
    "Refused",
    "ShardLoader",
    "ShuffleWarning",
    "Stalled",
    "StateMismatch",
    "StorageError",
    "TransformFailed",
    "UnreadableData",
    "WorkerDied",
]


_ONE_LINE = {"ConfigError", "DataError", "NotFound", "Refused", "StorageError"}  # errors.py's: no torch needed


def __getattr__(name: str) -> Any:
    # on first use: importing the package (say, for the shards CLI) does not import torch
    if name in _ONE_LINE:
        from imagenet_ais import errors

        return getattr(errors, name)
    if name in __all__:
        from imagenet_ais import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'imagenet_ais' has no attribute {name!r}")
