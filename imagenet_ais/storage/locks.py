"""One conversion at a time per DEST, one training at a time per --output.

convert's lock is taken before DEST is read and dropped after the manifest.

A local directory is locked with an flock on ``DEST/_convert.lock``: the kernel drops it when the
holder dies, however it dies (on NFS it holds only where the server supports locks).
Object stores (``ais://``, ``gs://``, ``s3://``) have no such thing, so the lock is an object there,
``_convert.lock``, naming pid, host and time, written before any work and deleted after. Limits:
AIStore has no create-if-absent, so two runs starting within the same moment may both write it;
reading it back after the write narrows that window, it does not close it (GCS's precondition
does). A holder that dies leaves it behind: it is taken over, with a warning, once it is STALE_S
old (a thread of the holder refreshes it every REFRESH_S) or when its holder is a dead pid of
this host, boot and pid namespace. Either way the holder checks the lock is still its own right
before it publishes or deletes anything.

A training holds ``OUTPUT/train.lock`` (an flock, as above) for as long as it runs: two runs
writing one output would mix their checkpoints, metrics and event files.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

from imagenet_ais.errors import InUse, StorageError
from imagenet_ais.storage import LocalStore, Store

LOCK = "_convert.lock"
TRAIN_LOCK = "train.lock"
STALE_S = 15 * 60  # generous against clock skew between hosts: a live holder refreshes far more often
REFRESH_S = 60
EXITING_S = 5  # how long a dead holder's children may take to let go of a file lock
# what a readable lock names
FIELDS: dict[str, type | tuple[type, ...]] = {"pid": int, "host": str, "time": (int, float), "token": str}


def _who(holder: dict) -> str:
    return f"PID {holder['pid']} on {holder['host']}" if holder else "another process"


def _busy(url: str, holder: dict, doing: str = "converted") -> InUse:
    return InUse(f"{url} is being {doing} by {_who(holder)}: wait for it to finish (nothing was changed)")


def _lost(url: str, holder: dict, name: str = LOCK) -> InUse:
    return InUse(
        f"{url}/{name} is no longer this run's ({_who(holder)} holds it, or nobody): stopped rather than "
        "write or delete what another run may be using; run convert again"
    )


def _where() -> dict:
    """What makes a pid comparable: the host, its boot, and the pid namespace (containers often
    share a hostname, not their pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: no way to tell, so no dead-pid shortcut
        boot, pidns = "", 0
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns}


def _me() -> dict:
    return {"pid": os.getpid(), **_where(), "time": time.time(), "token": uuid.uuid4().hex}


def _parse(data: bytes) -> dict:
    """The holder a lock names; {} when it names none readably (empty: being written; malformed)."""
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    if not isinstance(holder, dict) or not all(isinstance(holder.get(k), t) for k, t in FIELDS.items()):
        return {}
    return holder


def lock_dest(store: Store) -> _FileLock | _ObjectLock:
    """``with lock_dest(store) as lock:`` ... ``lock.check()`` before publishing or deleting."""
    return _FileLock(store) if isinstance(store, LocalStore) else _ObjectLock(store)


def lock_output(output: Path) -> _FileLock:
    """``with lock_output(output):`` train into it. Waits a little for a holder on its way out
    (a run restarted at once, e.g. by Ray after a lost worker)."""
    return _FileLock(LocalStore(output), TRAIN_LOCK, "trained into", wait_s=15)


class _FileLock:
    def __init__(self, store: LocalStore, name: str = LOCK, doing: str = "converted", wait_s: float = 0):
        self.store, self.name, self.doing, self.wait_s = store, name, doing, wait_s
        self.fd: int | None = None

    def __enter__(self) -> _FileLock:
        try:
            self.store.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            problem = "a file is there or on the way to it, not a folder: name a folder"
            raise StorageError(f"{self.store.root}: {problem}") from None
        path = self.store.root / self.name
        deadline = time.monotonic() + self.wait_s
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.read(fd, 4096))
                os.close(fd)
                # a holder killed outright still holds it through its pool workers for a moment
                if time.monotonic() < deadline + (EXITING_S if holder and _dead(holder) else 0):
                    time.sleep(0.2)
                    continue
                raise _busy(self.store.url, holder, self.doing) from None
            except OSError as e:  # a file system without locks (some NFS and FUSE mounts)
                os.close(fd)
                path.unlink(missing_ok=True)
                print(
                    f"warning: {path}: this file system cannot lock ({e.strerror}): nothing stops a second "
                    f"run from using {self.store.url} at the same time",
                    file=sys.stderr,
                )
                self.fd = None
                return self
            self.fd, self.path = fd, path
            if self._at_path():
                break
            os.close(fd)
        os.ftruncate(fd, 0)  # a holder killed before it could delete the file left its text in it
        os.write(fd, json.dumps(_me()).encode())
        return self

    def _at_path(self) -> bool:
        """The last holder deletes the file on its way out: locking that orphan inode would lock
        nothing, so only a lock on the file still at the path counts."""
        if self.fd is None:  # no lock to be had here: nothing to tell
            return True
        try:
            return os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def check(self) -> None:
        """An flock lasts as long as its holder, unless someone deletes the file under it."""
        if not self._at_path():
            raise _lost(self.store.url, {}, self.name)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is None:
            return
        if self._at_path():
            self.path.unlink()  # while still held: whoever opens it next makes a new one
        os.close(self.fd)


class _ObjectLock:
    def __init__(self, store: Store):
        self.store, self.me = store, _me()
        self.stopping = threading.Event()
        self.turn = threading.Lock()  # a check reads the lock while the heartbeat may be replacing it
        self.lost: Exception | None = None  # why the heartbeat stopped early

    def __enter__(self) -> _ObjectLock:
        try:
            self._put(once=True)
        except FileExistsError:
            data = self._read()
            if data is not None:  # (else gone meanwhile: just try again)
                holder = _parse(data)
                if not self._stale(holder):
                    raise _busy(self.store.url, holder) from None
                print(
                    f"warning: {self.store.url}/{LOCK} of {_who(holder)} is stale (its holder is gone): taking it over",
                    file=sys.stderr,
                )
                if not self.store.delete_if(LOCK, data):  # only the lock seen, not a newer one of a third run
                    raise _busy(self.store.url, self._holder()) from None
            try:
                self._put(once=True)
            except FileExistsError:
                raise _busy(self.store.url, self._holder()) from None
        self.check()
        self.beat = threading.Thread(target=self._heartbeat, name="convert-lock", daemon=True)
        self.beat.start()
        return self

    def _heartbeat(self) -> None:
        """Refresh the lock's time every REFRESH_S; stop for good once it is not ours or cannot be
        written (check() then says so: a run must not go on believing it holds the lock)."""
        while not self.stopping.wait(REFRESH_S):
            try:
                with self.turn:
                    self._check()
                    # Another run taking over between that check and this write loses its lock to
                    # us: AIStore has no conditional write; the staleness margin makes that unlikely.
                    self.me["time"] = time.time()
                    self._put(once=False)
            except Exception as e:  # any failure: report it in the main thread, stop refreshing
                self.lost = e
                return

    def check(self) -> None:
        """Raise unless the lock is still this run's: called right before publishing or deleting."""
        with self.turn:
            self._check()

    def _check(self) -> None:
        if self.lost:
            raise InUse(f"{self.store.url}/{LOCK} could not be kept ({self.lost}): run convert again")
        holder = self._holder()
        if holder.get("token") != self.me["token"]:
            raise _lost(self.store.url, holder)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stopping.set()
        self.beat.join()
        try:
            self.store.delete_if(LOCK, json.dumps(self.me).encode())  # ours only, as last written
        except Exception as e:  # never hide the error the run stopped with; it goes stale anyway
            if exc is None:
                raise
            print(f"warning: could not remove {self.store.url}/{LOCK}: {e}", file=sys.stderr)

    def _put(self, once: bool) -> None:
        tmp = self.store.scratch_file(LOCK)
        try:
            tmp.write_text(json.dumps(self.me))
            self.store.put_file(tmp, LOCK, once=once)
        finally:
            tmp.unlink(missing_ok=True)  # put_file consumes it, unless it failed first (http: read-only)

    def _read(self) -> bytes | None:
        try:
            return self.store.read_bytes(LOCK) if self.store.exists(LOCK) else None
        except FileNotFoundError:  # deleted between the two
            return None

    def _holder(self) -> dict:
        data = self._read()
        return _parse(data) if data is not None else {}

    def _stale(self, holder: dict) -> bool:
        if not holder:  # unreadable: no holder to wait for
            return True
        if time.time() - holder["time"] > STALE_S:
            return True
        return _dead(holder)


def _dead(holder: dict) -> bool:
    """Whether the process a lock names has ended: known only on its host, boot and pid namespace."""
    where = _where()
    return bool(where["boot"]) and all(holder.get(k) == v for k, v in where.items()) and not _alive(holder["pid"])


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
