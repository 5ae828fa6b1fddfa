#!/usr/bin/env python3
"""Make, check, describe and copy ImageNet WebDataset shards (imagenet_ais/cli/shards.py)."""

from imagenet_ais.cli.shards import cli

if __name__ == "__main__":
    cli()
