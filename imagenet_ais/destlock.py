"""One conversion at a time per DEST: a lock taken before DEST is read, dropped after the manifest.

A local directory is locked with an flock on ``DEST/_convert.lock``: the kernel drops it when the
holder dies, however it dies (on NFS it holds only where the server supports locks).
Object stores (``ais://``, ``gs://``) have no such thing, so the lock is an object there,
``_convert.lock``, naming pid, host and time, written before any work and deleted after. Limits:
AIStore has no create-if-absent, so two runs starting within the same moment may both write it;
reading it back after the write narrows that window, it does not close it (GCS's precondition
does). A holder that dies leaves it behind: it is taken over, with a warning, once it is STALE_S
old (the holder refreshes it every REFRESH_S) or when its holder is a dead pid on this host.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from types import TracebackType

from imagenet_ais.storage import LocalStore, Store

LOCK = "_convert.lock"
STALE_S = 15 * 60  # generous against clock skew between hosts: a live holder refreshes far more often
REFRESH_S = 60


def _busy(url: str, holder: dict) -> ValueError:
    who = f"PID {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "another process"
    return ValueError(f"{url} is being converted by {who}: wait for it to finish (nothing was changed)")


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": uuid.uuid4().hex}


def _parse(data: bytes) -> dict:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_dest(store: Store) -> _FileLock | _ObjectLock:
    """``with lock_dest(store) as lock:`` ... ``lock.refresh()`` now and then while working."""
    return _FileLock(store) if isinstance(store, LocalStore) else _ObjectLock(store)


class _FileLock:
    def __init__(self, store: LocalStore):
        self.store = store

    def refresh(self) -> None:
        """Nothing to do: an flock lasts as long as its holder."""

    def __enter__(self) -> _FileLock:
        self.store.root.mkdir(parents=True, exist_ok=True)
        path = self.store.root / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.read(fd, 4096))
                os.close(fd)
                raise _busy(self.store.url, holder) from None
            try:
                # The last holder deletes the file on its way out: locking that orphan inode
                # would lock nothing, so only a lock on the file still at the path counts.
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.write(fd, json.dumps(_me()).encode())
        self.fd, self.path = fd, path
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.path.unlink(missing_ok=True)  # while still held: whoever opens it next makes a new one
        os.close(self.fd)


class _ObjectLock:
    def __init__(self, store: Store):
        self.store, self.me = store, _me()

    def __enter__(self) -> _ObjectLock:
        try:
            self._put(once=True)
        except FileExistsError:
            holder = self._holder()
            if not self._stale(holder):
                raise _busy(self.store.url, holder) from None
            print(
                f"warning: {self.store.url}/{LOCK} of PID {holder.get('pid', '?')} on {holder.get('host', '?')} "
                "is stale (its holder is gone): taking it over",
                file=sys.stderr,
            )
            self.store.delete(LOCK)
            try:
                self._put(once=True)
            except FileExistsError:
                raise _busy(self.store.url, self._holder()) from None
        self._check_mine()
        self.refreshed = time.monotonic()
        return self

    def refresh(self) -> None:
        if time.monotonic() - self.refreshed < REFRESH_S:
            return
        self._check_mine()
        self.me["time"] = time.time()
        self._put(once=False)
        self.refreshed = time.monotonic()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._holder().get("token") == self.me["token"]:
            self.store.delete(LOCK)

    def _put(self, once: bool) -> None:
        tmp = self.store.scratch_file(LOCK)
        try:
            tmp.write_text(json.dumps(self.me))
            self.store.put_file(tmp, LOCK, once=once)
        finally:
            tmp.unlink(missing_ok=True)  # put_file consumes it, unless it failed first (http: read-only)

    def _holder(self) -> dict:
        return _parse(self.store.read_bytes(LOCK)) if self.store.exists(LOCK) else {}

    def _check_mine(self) -> None:
        """Someone else's lock under the name now (a race, or ours taken over as stale): stop."""
        holder = self._holder()
        if holder.get("token") != self.me["token"]:
            raise _busy(self.store.url, holder)

    def _stale(self, holder: dict) -> bool:
        if not holder:  # unreadable or gone meanwhile: no holder to wait for
            return True
        if time.time() - float(holder.get("time", 0)) > STALE_S:
            return True
        return holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
