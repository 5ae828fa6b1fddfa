#!/usr/bin/env python3
"""Train a torchvision classifier on ImageNet WebDataset shards (imagenet_ais/cli/train.py)."""

import signal

# A SIGTERM while torch and the rest are imported (seconds) waits for main's handler, which stops
# with a line and a stopped run's status (the default action ended it as 143, unsaid)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

from imagenet_ais.cli.train import main  # noqa: E402

if __name__ == "__main__":
    main()
