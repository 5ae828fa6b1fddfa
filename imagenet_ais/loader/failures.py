"""What a caller of the loader may catch, beside the package's own one-line failures (errors.py:
a ``ConfigError`` for options that cannot work, a ``DataError`` for shards that are not what
their manifest says, a ``StorageError`` for a location that cannot be read)."""

from __future__ import annotations

import functools

import torch

from imagenet_ais.errors import DataError, first_line


class ShuffleWarning(UserWarning):
    """Training shards that hold few classes each (sorted by class): each batch sees few of them.
    Its message says how to fix it (``imagenet_shards.py reshard``)."""


class StateMismatch(DataError):
    """A state whose epoch this loader cannot continue as it would have gone on (other shards,
    another seed, or an epoch that kept no record of its samples)."""


class WorkerDied(RuntimeError):
    """A DataLoader worker ended unexpectedly (killed: by the OOM killer, most often)."""


class UnreadableData(RuntimeError):
    """Nothing of a location could be read: training would wait for ever (a run stops with exit 4)."""


class TransformFailed(RuntimeError):
    """A caller's ``transform`` or ``batch_transform`` raised (SystemExit and KeyboardInterrupt in a
    worker too), or gave what cannot be an image of a batch, or a batch: the line names the
    transform and the sample (its key, and its shard where one sample is at fault) or the batch."""


def transform_name(transform: object) -> str:
    """How a line names a caller's transform: its function's or class's name."""
    if isinstance(transform, functools.partial):
        return f"partial({transform_name(transform.func)})"
    name = getattr(transform, "__qualname__", None)
    return name if isinstance(name, str) else type(transform).__qualname__


def raised(e: BaseException) -> str:
    """An exception of a caller's code in a line: its type and first line, even where its message
    cannot be made text."""
    try:
        said = first_line(e)
    except Exception:  # (its __str__ raised)
        said = "(its message cannot be shown)"
    return f"{type(e).__name__}: {said}" if said else type(e).__name__


def shown(value: object) -> str:
    """What a caller's transform gave, in a line: a tensor's dtype and shape, else its type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class Stalled(UnreadableData):
    """No batch came for the loader's ``data_timeout``: a worker stopped, or its reads hang."""


class Interrupted(Exception):
    """The step was told to stop while it waited for a batch (``ShardLoader.stop_waiting_when``)."""
