#!/usr/bin/env python3
"""Train a torchvision classifier on ImageNet WebDataset shards (imagenet_ais/train_cli.py)."""

from imagenet_ais.train_cli import main

if __name__ == "__main__":
    main()
