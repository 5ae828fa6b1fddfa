"""Worker processes that never outlive the process that started them.

A parent killed with SIGKILL cannot stop its children. DataLoader and convert workers check on
it only between items, and a worker whose queue writes block (its siblings keep the pipe open)
never gets there: they lived on for minutes holding hundreds of MB each. The kernel's
parent-death signal does not fit, as it follows the parent *thread* that forked (the
DataLoader's workers are started from a feed thread that ends every epoch). So each worker
watches its parent id from a thread of its own and exits as soon as it is not the PID that
started it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from PIL import Image

POLL_S = 0.25


def exit_with_parent(parent: int | None = None) -> None:
    """Call first thing in a worker: it exits (without cleanup) once its parent is gone. Give the
    ``parent``'s PID as the parent knew it: a worker started just as its parent died would
    otherwise take its new parent (PID 1, or a subreaper) for it and live on."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(1)  # nothing to save: the parent, who wanted the work, is gone

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` processes (1 at least), each ending with this one.

    They are forked, so every PIL plugin is imported here first: PIL imports them on its first
    ``Image.open``, and a worker's first lazy import crashed inside importlib (a KeyError, CPython
    3.11) where another thread of this process was importing as it forked."""
    Image.init()
    return ProcessPoolExecutor(max_workers=max(1, workers), initializer=exit_with_parent, initargs=(os.getpid(),))
