"""How the CLIs show a failure the user can act on (errors.py): one line and exit status 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

from imagenet_ais.errors import Refused, expected


@contextlib.contextmanager
def one_line() -> Iterator[None]:
    """For a CLI: an expected failure as click's one-line error (exit 1); anything else as it is."""
    try:
        yield
    except (Refused, OSError) as e:
        if not expected(e):
            raise
        raise click.ClickException(str(e)) from e
