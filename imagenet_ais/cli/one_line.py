"""How the CLIs show a failure the user can act on (errors.py): one line and exit status 1; and a
Ctrl-C: one line and 130 (128 + SIGINT), not click's "Aborted!" and 1."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

import click

from imagenet_ais.errors import Refused, expected


@contextlib.contextmanager
def one_line(interrupted: str = "stopped by Ctrl-C") -> Iterator[None]:
    """For a CLI: an expected failure as click's one-line error (exit 1); a KeyboardInterrupt
    (Ctrl-C) as the line ``interrupted`` (exit 130); anything else as it is."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"{click.get_current_context().find_root().info_name}: {interrupted}", err=True)
        sys.exit(128 + signal.SIGINT)
    except (Refused, OSError) as e:
        if not expected(e):
            raise
        raise click.ClickException(str(e)) from e
