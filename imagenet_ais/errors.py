"""The failures a user can act on: each says in one line what is wrong and what to do.

The CLIs print these (and the operating system's own errors: a missing file, a full disk, a
refused permission) as one line and exit 1; anything else is a bug and keeps its traceback.
Each is also the built-in exception it used to be, so ``except ValueError`` still catches it.
A run that ends otherwise than done ends with one of the ``EXIT_`` statuses below.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# How a training run ends, where not 0 (done): here, so that what reads them
# (torchrun's wrapper, Ray's driver) needs nothing of the training run itself
EXIT_WORKER_DIED = 1  # a DataLoader worker was killed (the OOM killer?): continue with --resume auto
EXIT_OUT_OF_MEMORY = 1  # the GPU ran out of memory: lower --batch-size, then --resume auto
EXIT_UPLOAD_FAILED = 3  # trained (or stopped cleanly), but some upload never made it: see stderr
EXIT_BAD_DATA = 4  # an epoch skipped or padded more than --max-bad of its samples (checkpoint saved)
EXIT_DIVERGED = 5  # the loss stayed NaN or infinite for loop.NONFINITE_STEPS steps (nothing saved past them)
EXIT_RANKS_LOST = 6  # some rank never reached a collective within --collective-timeout (named): resume when all can run
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1/Ctrl-C after saving (and uploading): resume with --resume auto


def first_line(e: BaseException) -> str:
    """The first line of an exception's message ("" where it has none), for a one-line report."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


class Refused(Exception):
    """Something given or found cannot work; the message names it and what to do."""


class ConfigError(Refused, ValueError):
    """Options or settings that cannot work, alone or together."""


class DataError(Refused, ValueError):
    """Shards, a manifest, a checkpoint or weights that are not what they must be."""


class InUse(Refused, ValueError):
    """A location another process holds: a conversion or run in progress, or another run's uploads."""


class StorageError(Refused, OSError):
    """A location that cannot be read or written as needed: unreachable, refused, full, corrupting."""


class NotFound(StorageError, FileNotFoundError):
    """A file or object that is not there."""


class AlreadyThere(StorageError, FileExistsError):
    """An object that is there already, where one was to be written only once."""


class OutOfMemory(Refused, RuntimeError):
    """A device too small for the run's settings (batch, image size, model): the message names them.
    Not torch's own error, which is its ``__cause__``."""


def expected(e: BaseException) -> bool:
    """Whether ``e`` is told in one line: ours, or the operating system's (it carries an errno)."""
    return isinstance(e, Refused) or (isinstance(e, OSError) and e.errno is not None)


@contextmanager
def needs_extra(name: str, wanted: str) -> Iterator[None]:
    """Around the imports of the optional dependency ``name`` (its module, and pyproject.toml's
    extra of that name): an ImportError becomes one line for ``wanted``, what asks for it. Not
    installed: how to add it; installed but failing to import (a dependency of its own missing or
    of another version): its own error, which "not installed" hid."""
    try:
        yield
    except ImportError as e:
        add = f"./run venv --extra {name} (pip: pip install -c requirements-dev.lock '.[{name}]')"
        if isinstance(e, ModuleNotFoundError) and e.name == name:
            raise ConfigError(f"{wanted} needs {name}, which is not installed: {add}") from None
        error = f"{type(e).__name__}: {first_line(e)}"
        raise ConfigError(f"{wanted}: {name} is installed but fails to import ({error}): reinstall it, {add}") from None
