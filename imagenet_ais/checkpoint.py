"""Checkpoints: atomic writes (temp file, fsync, rename) and loading for --resume.

Saved state holds plain tensors and containers only, so loading uses ``weights_only=True``:
a checkpoint can never run code.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from imagenet_ais.storage import LocalStore

LAST = "last.pt"  # hard links to the newest and the best ckpt-<step>.pt
BEST = "best.pt"


def name_for(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def save(state: dict[str, Any], output: Path, step: int, keep_last: int) -> Path:
    """Write ``ckpt-<step>.pt`` atomically, point ``last.pt`` at it, keep the newest ``keep_last``."""
    store = LocalStore(output)
    name = name_for(step)
    tmp = store.scratch_file(name)
    try:
        torch.save(state, tmp)
        store.put_file(tmp, name)
    finally:
        tmp.unlink(missing_ok=True)
    path = output / name
    link(path, LAST)
    for old in sorted(output.glob("ckpt-*.pt"))[:-keep_last]:
        old.unlink()  # last.pt and best.pt are links of their own: their data stays
    return path


def link(path: Path, alias: str) -> None:
    """Make ``alias`` (next to ``path``) another name for it, atomically."""
    tmp = LocalStore(path.parent).scratch_file(alias)
    tmp.unlink()
    os.link(path, tmp)
    os.replace(tmp, path.parent / alias)


def sweep_partials(output: Path) -> None:
    """Remove temp files a killed run left mid-write (never under a final name)."""
    for debris in output.glob(".*.partial"):
        debris.unlink(missing_ok=True)


def find(resume: str | None, output: Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` → ``output/last.pt`` if any; a path must exist."""
    if resume is None:
        return None
    if resume == "auto":
        last = output / LAST
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint file")
    return path


def load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged or foreign file
        raise RuntimeError(f"{path}: cannot load checkpoint ({type(e).__name__}: {e})") from e


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
