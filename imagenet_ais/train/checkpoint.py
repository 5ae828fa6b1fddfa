"""Checkpoints: atomic writes (temp file, fsync, rename) and loading for --resume.

Saved state holds plain tensors and containers only, so loading uses ``weights_only=True``:
a checkpoint can never run code. Each one carries a SHA-256 of its contents (every tensor's
bytes and every other value), checked at load: flipped bytes in tensor data load without
any error from torch, and must not be trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import torch

from imagenet_ais import distributed
from imagenet_ais.errors import DataError, NotFound, StorageError
from imagenet_ais.storage import LocalStore
from imagenet_ais.train import upload

LAST = "last.pt"  # hard links to the newest and the best ckpt-<step>.pt
BEST = "best.pt"
DIGEST = "sha256"  # the state's own key for its checksum
PARTIAL_STALE_S = 600  # a temp file untouched this long has no writer left


class DamagedCheckpoint(DataError):
    """A checkpoint file that cannot be loaded, or whose contents do not match its checksum."""


def digest(obj: Any, h: Any = None) -> str:
    """SHA-256 over a state's structure, values and tensor bytes, in a fixed order."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            digest(obj[key], h)
    elif isinstance(obj, list | tuple):
        h.update(f"L{len(obj)}".encode())  # lists and tuples alike: a load may turn one into the other
        if all(type(item) is int for item in obj):
            h.update(repr(list(obj)).encode())  # sample ids of an exact-mode position: one update, not millions
        else:
            for item in obj:
                digest(item, h)
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()


class _Writer:
    """The file ``torch.save`` writes through, keeping the OSError a write raised: torch turns it
    into "unexpected pos N vs M", which never says that the disk is full."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def name_for(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


class Saved(NamedTuple):
    path: Path
    replaced: bool  # a checkpoint of the same step was there: its uploaded copy is out of date too


def save(state: dict[str, Any], output: Path, step: int, keep_last: int) -> Saved:
    """Write ``ckpt-<step>.pt`` atomically, point ``last.pt`` at it, keep the newest ``keep_last``."""
    store = LocalStore(output)
    name = name_for(step)
    # Saved again at the step of the checkpoint a run resumed from (an epoch it had stopped at
    # the very end of, now validated): the newer state replaces the older one.
    replaced = (output / name).exists()
    tmp = store.scratch_file(name)
    try:
        with tmp.open("wb") as f:
            writer = _Writer(f)
            try:
                torch.save({**state, DIGEST: digest(state)}, cast(IO[bytes], writer))  # (it writes and flushes)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
        store.put_file(tmp, name)
    except OSError as e:
        raise StorageError(
            f"{output / name}: not written ({e.strerror or e}): free some space, or lift the file-size "
            "limit, then continue with --resume auto (the checkpoints already there are intact)"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    path = output / name
    link(path, LAST)
    for old in sorted(output.glob("ckpt-*.pt"))[:-keep_last]:
        old.unlink()  # last.pt and best.pt are links of their own: their data stays
    return Saved(path, replaced)


def link(path: Path, alias: str) -> None:
    """Make ``alias`` (next to ``path``) another name for it, atomically."""
    tmp = LocalStore(path.parent).scratch_file(alias)
    tmp.unlink()
    os.link(path, tmp)
    os.replace(tmp, path.parent / alias)


def sweep_partials(output: Path) -> None:
    """Remove temp files a killed run left mid-write (never under a final name): those untouched
    for PARTIAL_STALE_S. Where nodes share --output, another node may be writing one right now
    (fetching the checkpoint it resumes from); its writer keeps touching it, debris does not."""
    now = time.time()
    for debris in output.glob(".*.partial"):
        with contextlib.suppress(FileNotFoundError):  # its writer renamed it meanwhile
            if now - debris.stat().st_mtime > PARTIAL_STALE_S:
                debris.unlink()


def _newest(output: Path) -> list[Path]:
    """The newest ``ckpt-*.pt`` in ``output``, as a list of one, or none."""
    return sorted(output.glob("ckpt-*.pt"))[-1:]


def held(output: Path) -> str | None:
    """What in ``output`` shows a run is there to continue (its checkpoints), or None."""
    found = [name for name in (LAST, BEST) if (output / name).is_file()]
    return ", ".join(found + [p.name for p in _newest(output)]) or None


def find(resume: str | None, output: Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` → ``output/last.pt``, or without it (a run killed
    between a checkpoint and its link, a copy that dropped it) the newest ``ckpt-*.pt``; a path
    must exist."""
    if resume is None:
        return None
    if resume == "auto":
        last = output / LAST
        return last if last.is_file() else next(iter(_newest(output)), None)
    path = Path(resume)
    if not path.is_file():
        raise NotFound(f"--resume {resume}: no such checkpoint file")
    return path


def find_and_load(
    how: str | None,
    output: Path,
    uploaded: str | None,
    extra: tuple[str, ...],
    fetches: bool,
    echo: Callable[..., None],
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a run continues from, loaded and checked, or None.

    ``--resume FILE``: that file, or a clear error. ``auto``: ``output/last.pt`` (damaged: the
    newest intact ``ckpt-*.pt`` beside it); on a fresh node, what the last run uploaded to
    ``uploaded``, with the ``extra`` files that continue (downloaded by the one process per node
    that ``fetches``; all processes call this)."""
    path = find(how, output)
    if how == "auto" and uploaded:
        if fetches:
            _fetch_newer(uploaded, output, path, extra, echo)
        distributed.barrier()  # every rank, whatever it found: a rank skipping it would hang the others
        path = find("auto", output)
    if path is None:
        return None
    if how != "auto":
        return path, load(path)
    chosen, state = load_newest_intact(path, echo)
    if chosen == path and path.name != LAST:
        echo(f"warning: {output / LAST} is missing; resuming from {path}, the newest checkpoint there", err=True)
    return chosen, state


def _fetch_newer(uploaded: str, output: Path, path: Path | None, extra: tuple[str, ...], echo: Callable) -> None:
    """Download what the run uploaded where ``output`` has no checkpoint (a fresh node) or only
    older ones (this node's copy of a run that went on elsewhere): continuing from those would
    train steps again, and their checkpoints could never be uploaded over the newer ones."""
    newest, have = _newest(output), path
    if newest:
        have, after = newest[0], int(newest[0].stem.removeprefix("ckpt-"))
    else:  # nothing, or a last.pt alone (a copy of the run dropped the rest): its step is inside it
        after = _step_of(path)
    try:
        fetched = upload.fetch_latest(uploaded, output, extra=extra, after=after)
    except upload.BadPointer:
        raise  # not a store that failed to answer: its pointer is wrong, and must be put right
    except Exception as e:  # each SDK has its own errors
        if have is None:
            raise
        echo(f"warning: {uploaded}: not checked for a newer checkpoint ({type(e).__name__}: {e}); "
            f"continuing from {have}", err=True)  # fmt: skip
        return
    if fetched:
        link(fetched, LAST)
        if have is not None:
            echo(f"{uploaded} holds a newer checkpoint than {have}: continuing from {fetched.name}")


def _step_of(path: Path | None) -> int:
    """The step of the checkpoint at ``path``; -1 for none, or one that cannot be loaded."""
    try:
        return int(load(path).get("step", -1)) if path else -1
    except (DamagedCheckpoint, TypeError, ValueError):
        return -1


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's state, checked against its checksum (older checkpoints have none)."""
    try:
        with warnings.catch_warnings():  # torch's notes on foreign pickles: the line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged or foreign file
        # the type only: torch's messages advise loading with weights_only=False, i.e. running
        # whatever code the file holds, which must never be the advice to a user
        raise DamagedCheckpoint(
            f"{path}: not a checkpoint this tool can load ({type(e).__name__}): damaged, or not written by train.py"
        ) from None
    return verified(state, path)


# what a resume reads of a checkpoint (save() writes these and more)
REQUIRED = ("model", "optimizer", "scaler", "epoch", "step", "step_in_epoch", "steps_per_epoch", "best_top1",
            "last_val", "rng", "arch", "classes", "config")  # fmt: skip


def verified(state: Any, path: Path) -> dict[str, Any]:
    """``state`` as read from ``path``, if it is a train.py checkpoint matching its checksum."""
    if not isinstance(state, dict) or "model" not in state:
        raise DamagedCheckpoint(f"{path}: not a checkpoint written by train.py (no model state in it)")
    expected = state.pop(DIGEST, None)
    if expected is not None and digest(state) != expected:
        raise DamagedCheckpoint(f"{path}: damaged: its contents do not match the checksum written when it was saved")
    return state


def resumable(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` if it holds all a run continues from (a --weights file needs its model alone)."""
    if missing := [key for key in REQUIRED if key not in state]:
        raise DamagedCheckpoint(
            f"{path}: not a checkpoint train.py can continue from (no {', '.join(map(repr, missing))} in it): "
            "start another --output, or start from its weights with --weights"
        )
    return state


def load_newest_intact(first: Path, echo: Callable[..., None]) -> tuple[Path, dict[str, Any]]:
    """``first`` (``last.pt``) if intact, else the newest intact ``ckpt-*.pt`` beside it, said in a line."""
    try:
        return first, load(first)
    except DamagedCheckpoint as e:
        damage = e
    for path in sorted(first.parent.glob("ckpt-*.pt"), reverse=True):
        if os.path.samefile(path, first):
            continue  # last.pt is a hard link to one of them
        try:
            state = load(path)
        except DamagedCheckpoint:
            continue
        echo(f"warning: {damage}; resuming from {path}, the newest intact checkpoint", err=True)
        return path, state
    raise DamagedCheckpoint(f"{damage}, and no intact ckpt-*.pt is beside it: start another --output") from None


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Python's and torch's random state back as it was once the block ends (a run seeds them)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
