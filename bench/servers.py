"""The local servers a benchmark reads through, each stopped when its block ends: nginx as
`./run serve` runs it, and the product's AIStore playground."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from imagenet_ais.storage.ais_playground import Playground

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nginx(shards: Path, work: Path, port: int) -> Iterator[str]:
    """``shards`` served on loopback at ``port``; its access log in ``work``/serve/PORT/access.log."""
    env = {**os.environ, "SERVE_ROOT": str(work / "serve")}
    serve = [str(ROOT / "run"), "serve", str(shards), "--port", str(port), "--addr", "127.0.0.1"]
    try:
        subprocess.run(serve, check=True, env=env, stdout=subprocess.DEVNULL)
        yield f"http://127.0.0.1:{port}"
    finally:  # (a failed stop does not hide what ended the block)
        stop = [str(ROOT / "run"), "serve", "--stop", "--port", str(port)]
        subprocess.run(stop, check=False, env=env, stdout=subprocess.DEVNULL)


@contextmanager
def aistore(root: Path, targets: int = 1) -> Iterator[Playground]:
    """An AIStore playground of ``targets`` targets in ``root`` (aisnode from ./run ais-install),
    stopped and deleted at the end."""
    playground = Playground(root)
    try:
        playground.up(targets=targets)
        yield playground
    finally:
        playground.down()
        shutil.rmtree(root, ignore_errors=True)
