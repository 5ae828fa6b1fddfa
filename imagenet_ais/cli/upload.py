"""``python -m imagenet_ais.cli.upload SRC DEST`` (upload.sh): copy a run's directory to cloud storage,
skipping the files already there."""

from __future__ import annotations

from pathlib import Path

import click

from imagenet_ais.cli.one_line import one_line
from imagenet_ais.train.upload import sync


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@click.option("--retry-seconds", default=120.0, show_default=True, help="retry a failing upload this long")
def main(src: Path, dest: str, retry_seconds: float) -> None:
    """Sync the directory SRC to DEST (gs://, s3://, ais:// or a directory), skipping identical files."""
    with one_line():
        uploaded, skipped = sync(src, dest, retry_seconds)
    for name in uploaded:
        click.echo(f"uploaded {name}")
    click.echo(f"{dest}: {len(uploaded)} uploaded, {len(skipped)} already there")


if __name__ == "__main__":
    main()
