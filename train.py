#!/usr/bin/env python3
"""Train a torchvision classifier on ImageNet WebDataset shards (imagenet_ais/cli/train.py)."""

from imagenet_ais.cli.train import main

if __name__ == "__main__":
    main()
