#!/usr/bin/env python3
"""Make, check, describe and copy ImageNet WebDataset shards (imagenet_ais/cli/shards.py)."""

from imagenet_ais.cli.venv_hint import in_the_venv  # (no dependencies of its own)

with in_the_venv(__file__, "shards"):
    from imagenet_ais.cli.shards import cli

if __name__ == "__main__":
    cli()
