"""Temp files for objects on their way to a remote store, in a folder per process.

A process killed outright (SIGKILL, OOM) cannot delete its temp files, and a converter's are
whole shards (2 × --workers of them at a time). So each process builds in a folder of its own
under ``$TMPDIR/imagenet-ais-scratch``, holding an flock on the folder's ``.owner`` file for as
long as it lives (the kernel lets go of it however the process ends); the first scratch file a
process asks for removes the folders whose owner is gone.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import tempfile
from multiprocessing import util
from pathlib import Path

_owners: list[int] = []  # the open .owner files: their locks last as long as this process


def root() -> Path:
    return Path(tempfile.gettempdir()) / "imagenet-ais-scratch"


def scratch_file(name: str) -> Path:
    """A new empty temp file to build ``name`` in before it goes up."""
    fd, tmp = tempfile.mkstemp(dir=_own_folder(), prefix=f".{Path(name).name}.", suffix=".partial")
    os.close(fd)
    return Path(tmp)


@functools.cache
def _own_folder() -> Path:
    sweep()
    root().mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=root(), prefix=f"{os.getpid()}-"))
    # locked before it is named .owner: a sweep between creating it and locking it took the
    # folder for a dead process's and removed it (a clean-clone CI run met that)
    fd = os.open(folder / ".owner.new", os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(folder / ".owner.new", folder / ".owner")
    _owners.append(fd)
    creator = os.getpid()

    def remove() -> None:
        if os.getpid() == creator:  # a forked child shares the folder: its creator removes it
            shutil.rmtree(folder, ignore_errors=True)

    # at exit, of the main process and of multiprocessing's children (the converter's workers)
    # alike: atexit handlers do not run in the latter, multiprocessing's finalizers do
    util.Finalize(None, remove, exitpriority=0)
    return folder


def sweep() -> None:
    """Remove the folders of processes that are gone (their .owner lock is free)."""
    for folder in root().glob("*-*"):
        try:
            fd = os.open(folder / ".owner", os.O_WRONLY)
        except OSError:  # no .owner yet: a process between creating its folder and locking it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
