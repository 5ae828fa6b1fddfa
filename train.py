#!/usr/bin/env python3
"""Train a torchvision classifier on ImageNet WebDataset shards (imagenet_ais/cli/train.py)."""

import signal

# A SIGTERM or Ctrl-C while torch and the rest are imported (seconds) waits for main's handler,
# which stops with a line and a stopped run's status (the default actions: 143 unsaid, a traceback)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

from imagenet_ais.cli.venv_hint import in_the_venv  # noqa: E402  (no dependencies of its own)

with in_the_venv(__file__, "local1"):
    from imagenet_ais.cli.train import main

if __name__ == "__main__":
    main()
