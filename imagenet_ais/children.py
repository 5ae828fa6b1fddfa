"""Worker processes that never outlive the process that started them.

A parent killed with SIGKILL cannot stop its children. DataLoader and convert workers check on
it only between items, and a worker whose queue writes block (its siblings keep the pipe open)
never gets there: they lived on for minutes holding hundreds of MB each. The kernel's
parent-death signal does not fit, as it follows the parent *thread* that forked (the
DataLoader's workers are started from a feed thread that ends every epoch). So each worker
watches the process that started it from a thread of its own and exits as soon as it is gone.
Not through its own parent id: one started just as its parent died takes its new parent (PID 1,
or a subreaper) for it, and under the forkserver start method (Python 3.14's default) every
worker's parent is the server.
"""

from __future__ import annotations

import os
import select
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from PIL import Image

POLL_S = 0.25  # where there is no pidfd: how often a worker asks whether its parent lives


def exit_with_parent(parent: int) -> None:
    """Call first thing in a worker, with the PID (``os.getpid()``) of the process that started
    it: the worker exits (without cleanup) once that process is gone, at once where it already is."""
    try:
        pidfd: int | None = os.pidfd_open(parent)  # (Linux 5.3+)
    except ProcessLookupError:
        os._exit(1)  # gone before this worker got here
    except (AttributeError, OSError):  # no pidfd here (another system, an older kernel): polled
        pidfd = None
    threading.Thread(target=_watch, args=(parent, pidfd), name="exit-with-parent", daemon=True).start()


def _watch(parent: int, pidfd: int | None) -> None:
    if pidfd is None:
        while _alive(parent):
            time.sleep(POLL_S)
    else:
        ended = select.poll()
        ended.register(pidfd, select.POLLIN)
        ended.poll()  # (a pidfd is readable once its process has ended)
    os._exit(1)  # nothing to save: the parent, who wanted the work, is gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # none (or another user's process under its PID: ours is gone)
        return False
    return True


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` processes (1 at least), each ending with this one.

    They are forked, so every PIL plugin is imported here first: PIL imports them on its first
    ``Image.open``, and a worker's first lazy import crashed inside importlib (a KeyError, CPython
    3.11) where another thread of this process was importing as it forked."""
    Image.init()
    return ProcessPoolExecutor(max_workers=max(1, workers), initializer=exit_with_parent, initargs=(os.getpid(),))
