"""``python -m imagenet_ais train|shards ...``: the two CLIs (``imagenet-train``, ``imagenet-shards``
once the package is installed) where neither script is at hand."""

from __future__ import annotations

import click

from imagenet_ais.cli.shards import cli as shards
from imagenet_ais.cli.train import main as train


@click.group()
def cli() -> None:
    """Train on ImageNet WebDataset shards (train), or make and check them (shards)."""


cli.add_command(train, "train")
cli.add_command(shards, "shards")

if __name__ == "__main__":
    cli()
