"""The loader library: ``ShardLoader``, one rank's batches of a split of WebDataset shards, on its
device, for any training loop (shard_loader.py says how to use it).

Its parts, by where they run:

- in the training process: ``shard_loader`` (the public face, its state), ``engine`` (the
  DataLoader and its workers, fixed-length epochs, pooling and padding), ``sampling`` (which
  samples each rank and worker reads), ``mixture`` (several shard sets as one, by weight),
  ``device_feed`` (the threads that make batches ready on the device ahead of the step),
  ``device_decode`` and ``dali_decode`` (JPEGs decoded and cropped on the GPU);
- in a DataLoader worker: ``worker`` (read shards, check their bytes, pick crops or decode),
  ``cpu_share`` (crop a share of the samples while the GPU is busy), ``transforms`` (the crop
  geometry, the CPU decode, normalisation), ``augment``;
- between them: ``wire`` (the batch format that crosses, and the shared buffers it crosses in)
  and ``signals`` (what the feed and the workers tell each other while an epoch runs).

The failures a caller may catch are exported here (failures.py, and errors.py's one-line ones).
"""

from __future__ import annotations

from imagenet_ais.errors import ConfigError, DataError, NotFound, Refused, StorageError
from imagenet_ais.loader.engine import Batch
from imagenet_ais.loader.failures import (
    Interrupted,
    ShuffleWarning,
    Stalled,
    StateMismatch,
    TransformFailed,
    UnreadableData,
    WorkerDied,
)
from imagenet_ais.loader.shard_loader import ShardLoader

__all__ = [
    "Batch",
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
