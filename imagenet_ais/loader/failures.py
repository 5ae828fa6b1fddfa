"""What a caller of the loader may catch, beside the package's own one-line failures (errors.py:
a ``ConfigError`` for options that cannot work, a ``DataError`` for shards that are not what
their manifest says, a ``StorageError`` for a location that cannot be read)."""

from __future__ import annotations

from imagenet_ais.errors import DataError


class StateMismatch(DataError):
    """A state whose epoch this loader cannot continue as it would have gone on (other shards,
    another seed, or an epoch that kept no record of its samples)."""


class WorkerDied(RuntimeError):
    """A DataLoader worker ended unexpectedly (killed: by the OOM killer, most often)."""


class UnreadableData(RuntimeError):
    """Nothing of a location could be read: training would wait for ever (a run stops with exit 4)."""


class TransformFailed(RuntimeError):
    """A caller's ``transform`` or ``batch_transform`` raised, or gave what cannot be an image of a
    batch: the line names the sample (its key, and its shard where one sample is at fault) or the batch."""


class Stalled(UnreadableData):
    """No batch came for the loader's ``data_timeout``: a worker stopped, or its reads hang."""


class Interrupted(Exception):
    """The step was told to stop while it waited for a batch (``ShardLoader.stop_waiting_when``)."""
