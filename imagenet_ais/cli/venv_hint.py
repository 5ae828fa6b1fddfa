"""What a top-level script says when a Python without the project's dependencies runs it
(no third-party imports here: it runs before them)."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def in_the_venv(script: str, verb: str) -> Iterator[None]:
    """Around a top-level script's imports: run by a Python without the project's dependencies
    (not ./run's venv), it says in one line how to run it there, not ModuleNotFoundError's traceback."""
    try:
        yield
    except ModuleNotFoundError as e:
        if not e.name or e.name.partition(".")[0] == __name__.partition(".")[0]:
            raise  # one of ours: a bug
        checkout = os.path.relpath(os.path.dirname(os.path.abspath(script)))
        at, name = ("" if checkout == "." else f"{checkout}/"), os.path.basename(script)
        again = shlex.join([f"{at}.venv/bin/python", f"{at}{name}", *sys.argv[1:]])
        run = f"{at or './'}run"
        why = f"{sys.executable} has no module {e.name} (./run's venv has the project's dependencies)"
        sys.exit(f"{name}: {why}: {run} venv, then {again} (or {run} {verb} ...)")
