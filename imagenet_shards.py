#!/usr/bin/env python3
"""Make, check, describe and copy ImageNet WebDataset shards (imagenet_ais/shards_cli.py)."""

from imagenet_ais.shards_cli import cli

if __name__ == "__main__":
    cli()
