"""Uploads of a run's files to cloud storage, in a background thread: training never waits.

Checkpoints go up write-once under their step name, then the small ``latest.json`` pointer
is rewritten to name them, so a reader that follows the pointer always finds a complete,
verified checkpoint. A location is one run's: ``run.json`` names its id (kept in the run's
checkpoints and its ``--output``), and nothing is uploaded where it names another run, so two runs
given the same ``--upload`` never mix their checkpoints, metrics and logs. An upload that fails
after the store's own retries is reported loudly, its local copy is kept, and it is tried again
later; ``flush`` waits a bounded time for what is left and says what never made it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from imagenet_ais.errors import DataError, InUse
from imagenet_ais.storage import LocalStore, Store, download, open_store

POINTER = "latest.json"
CLAIM = "run.json"  # the run whose location it is (and, in --output, the run's id)
SNAPSHOTS = ".uploading"  # in --output: the copies of files on their way up


class Claimed(InUse):
    """The upload location is another run's."""


def run_id(output: Path, resumed: str | None) -> str:
    """The run's id: its checkpoint's (``resumed``), else what ``output``'s run.json says (an
    attempt that died before its first checkpoint: a rerun into the same --output is the same
    run), else a new one; written to ``output``'s run.json."""
    mine = output / CLAIM
    there = _claimed_by(mine.read_bytes()).get("run") if mine.exists() else None
    name = resumed or there or uuid.uuid4().hex
    if there != name:
        mine.write_text(_claim_text(name))
    return name


def claim(store: Store, name: str) -> None:
    """Make ``store`` run ``name``'s location (its run.json, written once), or find it so already.

    Raises Claimed where another run's id is there: a second run given the same --upload, whose
    files would be mixed with the first's. AIStore has no create-if-absent: two runs claiming at
    the same moment may both write; the read-back then tells one of them, and each upload reads
    the claim again before it goes."""
    if not store.exists(CLAIM):  # (read before every upload: written once)
        scratch = store.scratch_file(CLAIM)
        try:
            scratch.write_text(_claim_text(name))
            store.put_file(scratch, CLAIM, once=True)
        except FileExistsError:
            pass
        finally:
            scratch.unlink(missing_ok=True)  # put_file consumes it, unless it failed first
    holder = _claimed_by(store.read_bytes(CLAIM))
    if holder.get("run") != name:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder["time"])) if "time" in holder else "?"
        raise Claimed(
            f"{store.url}/{CLAIM}: the location is another run's (run {holder.get('run', '?')}, started {when} on "
            f"{holder.get('host', '?')}): continue that run with --resume auto, or use another --upload"
        )


def _claim_text(name: str) -> str:
    return json.dumps({"run": name, "host": socket.gethostname(), "time": time.time()}) + "\n"


def _claimed_by(data: bytes) -> dict:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) and isinstance(holder.get("run"), str) else {}


@dataclass
class Job:
    snapshot: Path  # a private copy or hard link, consumed by the upload
    name: str
    once: bool
    step: int | None = None  # for checkpoints: move the pointer here once uploaded


class Uploader:
    """Uploads of the run ``run``'s files from ``output`` to ``dest_url``."""

    def __init__(self, dest_url: str, run: str, output: Path, retry_seconds: float = 120):
        self.store: Store = open_store(dest_url, retry_seconds=retry_seconds)
        self.url, self.run = dest_url, run
        # Snapshots beside the run's files (a hard link for a checkpoint), never in the destination:
        # a full one must not fill up with them. A killed run's are its dead jobs': gone.
        self.snapshots = output / SNAPSHOTS
        shutil.rmtree(self.snapshots, ignore_errors=True)
        self.jobs: queue.Queue[Job | Literal["end"] | None] = queue.Queue()
        self.failed: list[Job] = []
        self.lost: list[str] = []  # files that could not even be copied to go up
        self.pointer_step = -1
        self.in_flight: Job | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="uploader", daemon=True)
        self.thread.start()

    # called from the training thread ------------------------------------------------------
    def submit(self, path: Path, *, checkpoint_step: int | None = None, replace: bool = False) -> None:
        """Queue ``path`` as it is now. Checkpoints (with their step) are written once, unless
        ``replace`` (a newer state saved under the same step), and snapshotted by hard link
        (free, and safe from local pruning); growing files (metrics, logs) by copy. A snapshot that
        cannot be made (a full disk) is said and left out: training goes on, ``flush`` names it."""
        try:
            snapshot = self._snapshot(path, link=checkpoint_step is not None)
        except OSError as e:
            print(
                f"WARNING: {path} cannot be copied to go up to {self.url} ({e.strerror or e}): not uploaded",
                file=sys.stderr,
                flush=True,
            )
            with self.lock:
                self.lost.append(path.name)
            return
        once = checkpoint_step is not None and not replace
        self.jobs.put(Job(snapshot, path.name, once, checkpoint_step))

    def _snapshot(self, path: Path, link: bool) -> Path:
        self.snapshots.mkdir(exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.snapshots, prefix=f"{path.name}.")
        os.close(fd)
        snapshot = Path(name)
        try:
            if link:
                snapshot.unlink()
                try:
                    os.link(path, snapshot)
                    return snapshot
                except OSError:  # a file system without hard links
                    pass
            shutil.copyfile(path, snapshot)
        except BaseException:
            snapshot.unlink(missing_ok=True)
            raise
        return snapshot

    def flush(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for everything queued, retrying failures; the names that never made it."""
        self.jobs.put(None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.jobs.unfinished_tasks == 0 and not self.failed:
                    return list(dict.fromkeys(self.lost))
            time.sleep(0.1)
        with self.lock:
            left = [j.name for j in (self.in_flight, *self.failed, *list(self.jobs.queue)) if isinstance(j, Job)]
        return list(dict.fromkeys([*self.lost, *left]))

    def close(self) -> None:
        """The upload thread ends: at once when idle (after a ``flush`` that got everything up), or
        after its upload in flight otherwise; a run leaves no thread of its own behind."""
        self.jobs.put("end")
        self.thread.join(timeout=5)

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the upload thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self.jobs.get()  # None: a flush, just one more round for the failures
            if job == "end":
                return
            try:
                self._retry_failed()
                if job is not None:
                    self._upload(job)
            finally:
                self.jobs.task_done()

    def _retry_failed(self) -> None:
        with self.lock:
            pending, self.failed = self.failed, []
        for job in pending:
            self._upload(job)

    def _upload(self, job: Job) -> None:
        self.in_flight = job
        try:
            claim(self.store, self.run)  # still this run's location (or made so, if unreachable at the start)
            try:
                self.store.put_file(job.snapshot, job.name, keep=True, once=job.once)
            except FileExistsError:
                # an earlier attempt made it, only its answer was lost: the same bytes are fine
                if not self.store.matches(job.name, job.snapshot):
                    raise
            if job.step is not None and job.step > self.pointer_step:
                pointer = {"checkpoint": job.name, "step": job.step, "time": time.time(), "run": self.run}
                self.store.write_bytes(POINTER, json.dumps(pointer).encode())
                self.pointer_step = job.step
        except Exception as e:
            print(
                f"WARNING: upload of {job.name} to {self.url} failed ({type(e).__name__}: {e}); "
                f"the local copy stays, and it will be tried again",
                file=sys.stderr,
                flush=True,
            )
            with self.lock:
                self.failed.append(job)
            return
        finally:
            self.in_flight = None
        job.snapshot.unlink(missing_ok=True)


# a run's last.pt and best.pt are hard links to one of its checkpoints: each goes up as a pointer
LINK_POINTERS = {"last.pt": POINTER, "best.pt": "best.json"}


def sync(src: Path, dest_url: str, retry_seconds: float = 120) -> tuple[list[str], list[str]]:
    """Upload every file under ``src`` to ``dest_url`` unless an identical copy is there; a run's
    ``last.pt`` / ``best.pt`` that is a hard link to a ``ckpt-<step>.pt`` goes up as a pointer to it
    (``latest.json``, as a run's own uploads write it, and ``best.json``), not as another copy.

    Returns (uploaded, skipped) names; raises on the first upload that fails."""
    store = open_store(dest_url, retry_seconds=retry_seconds)
    run = ""
    if (mine := src / CLAIM).exists() and (run := _claimed_by(mine.read_bytes()).get("run", "")):
        claim(store, run)  # a run's --output: not over another run's uploads
    uploaded, skipped = [], []
    files = (p for p in src.rglob("*") if p.is_file() and not p.name.endswith(".partial"))
    wanted = [p for p in files if SNAPSHOTS not in p.relative_to(src).parts]  # (a killed run's)
    checkpoints = {
        (s.st_dev, s.st_ino): p.name
        for p in wanted
        if p.parent == src and _CHECKPOINT.fullmatch(p.name) and (s := p.stat())
    }
    pointers: list[tuple[str, int, dict[str, Any]]] = []
    for path in sorted(wanted):
        name, stat = path.relative_to(src).as_posix(), path.stat()
        if name in LINK_POINTERS and (linked := checkpoints.get((stat.st_dev, stat.st_ino))):
            step = int(linked.removeprefix("ckpt-").removesuffix(".pt"))
            pointers.append((name, step, {"checkpoint": linked, "step": step, "time": stat.st_mtime, "run": run}))
        elif store.matches(name, path):
            skipped.append(name)
        else:
            store.put_file(path, name, keep=True)
            uploaded.append(name)
    for name, step, pointer in pointers:  # last: each names a checkpoint already there
        if _points_past(store, LINK_POINTERS[name], step):
            store.write_bytes(LINK_POINTERS[name], json.dumps(pointer).encode())
            uploaded.append(f"{LINK_POINTERS[name]} (for {name}, the same file as {pointer['checkpoint']})")
        else:
            skipped.append(LINK_POINTERS[name])
    return uploaded, skipped


def _points_past(store: Store, pointer: str, step: int) -> bool:
    """Whether ``pointer`` in ``store`` is missing or names an earlier step than ``step``."""
    if not store.exists(pointer):
        return True
    try:
        return json.loads(store.read_bytes(pointer)).get("step", -1) < step
    except (ValueError, AttributeError, TypeError):
        return True


class BadPointer(DataError):
    """A ``latest.json`` that does not name one of its location's checkpoints."""


def latest(store: Store) -> dict | None:
    """What ``latest.json`` in ``store`` says (``checkpoint``, ``step``), checked: it names a
    ``ckpt-<step>.pt`` and that step (a pointer naming any other file would have it fetched over
    that file of --output, ``train.lock`` say). None: no run uploaded there."""
    if not store.exists(POINTER):
        return None
    where = f"{store.url}/{POINTER}"
    try:
        pointer = json.loads(store.read_bytes(POINTER))
    except ValueError as e:  # (UnicodeDecodeError is one)
        raise BadPointer(f"{where}: not JSON ({e}); fix or remove it") from None
    name, step = (pointer.get("checkpoint"), pointer.get("step")) if isinstance(pointer, dict) else (None, None)
    found = _CHECKPOINT.fullmatch(name) if isinstance(name, str) else None
    if not found or type(step) is not int or int(found[1]) != step:
        shown = json.dumps(pointer)[:120]
        raise BadPointer(
            f"{where} is {shown}: a run's pointer names one of its ckpt-<8-digit step>.pt and that step; "
            "fix or remove it"
        )
    return pointer


_CHECKPOINT = re.compile(r"ckpt-(\d{8})\.pt")  # checkpoint.name_for's names


def fetch_latest(source_url: str, output: Path, extra: tuple[str, ...] = (), after: int = -1) -> Path | None:
    """Download the checkpoint ``latest.json`` names (and ``extra`` files) into ``output``.

    None when the location has no pointer yet (a first run), or names no step past ``after``."""
    store = open_store(source_url)
    pointer = latest(store)
    if pointer is None or pointer["step"] <= after:
        return None
    if not store.exists(pointer["checkpoint"]):
        raise BadPointer(f"{store.url}/{POINTER} names {pointer['checkpoint']}, which is not there; fix or remove it")
    local = LocalStore(output)
    # the checkpoint last: a fetch cut short must not leave one that a later --resume auto
    # would continue from without the metrics and log that go with it
    for name in (*extra, pointer["checkpoint"]):
        if store.exists(name):
            # the size here; a checkpoint's own checksum is checked when it is loaded
            # through a scratch file of its own: nodes sharing --output may fetch at once
            download(store, name, output / name, store.size(name), partial=local.scratch_file(name))
            (output / name).chmod(0o644)  # as the run's own files (the scratch file was private)
    return output / pointer["checkpoint"]
