"""Train ImageNet-class models from WebDataset shards (local, AIStore, GCS).

``from imagenet_ais import ShardLoader``: the data path for any training loop (loader.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShardLoader", "StateMismatch"]


def __getattr__(name: str) -> Any:
    # on first use: importing the package (say, for the shards CLI) does not import torch
    if name in __all__:
        from imagenet_ais import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'imagenet_ais' has no attribute {name!r}")
