#!/usr/bin/env python3
"""The local AIStore playground's command line (./run ais-up / ais-down): imagenet_ais/storage/ais_playground.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from imagenet_ais.storage.ais_playground import DEFAULT_AISNODE, Playground, default_root


@click.group()
@click.option("--root", type=click.Path(path_type=Path), default=default_root, show_default="$AIS_ROOT or .cache/ais")
@click.option("--aisnode", type=click.Path(path_type=Path), default=DEFAULT_AISNODE, show_default=True)
@click.pass_context
def cli(ctx: click.Context, root: Path, aisnode: Path) -> None:
    """Local AIStore playground."""
    ctx.obj = Playground(root, aisnode)


@cli.command()
@click.option("--targets", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--port", type=int, help="proxy's public port (default: a free one)")
@click.pass_obj
def up(pg: Playground, targets: int, port: int | None) -> None:
    """Start (or find running) the playground; print the endpoint."""
    try:
        endpoint = pg.up(targets, port, echo=lambda message: click.echo(message, err=True))
    except (FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"AIStore is up: export AIS_ENDPOINT={endpoint}")


@cli.command()
@click.pass_obj
def endpoint(pg: Playground) -> None:
    """Print the endpoint if the playground is up; exit 1 if not."""
    if not pg.healthy():
        raise click.ClickException(f"the AIStore playground in {pg.root} is not running: ./run ais-up")
    click.echo(pg.endpoint)


@cli.command()
@click.option("--wipe", is_flag=True, help="also delete its configs, data and logs")
@click.pass_obj
def down(pg: Playground, wipe: bool) -> None:
    """Stop the processes this playground started (its data stays unless --wipe)."""
    stopped = pg.down()
    if wipe:
        shutil.rmtree(pg.root, ignore_errors=True)
    said = (
        f"AIStore playground stopped ({stopped} nodes)" if stopped else f"no AIStore playground is running in {pg.root}"
    )
    click.echo(said + (f"; {pg.root} deleted" if wipe else ""))


if __name__ == "__main__":
    sys.exit(cli())
