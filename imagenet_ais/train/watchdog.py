"""A collective that some rank never reaches ends the run on every live rank, in one line.

A rank may die, be stopped, or hang in a read or on a hung worker; the others then wait in the
collective library until its own timeout (NCCL's 10 minutes, gloo's 30) and end with a stack
trace. Here each rank's main thread says what it is doing (``Watchdog.now``), and a thread of
its own beats that into the job's rendezvous store (torchrun's, or rank 0's) every few seconds.
A rank that has been at one place longer than ``--collective-timeout`` (a training step, whose
all-reduce waits for every rank; a gather at an epoch's end) reads every rank's beat and writes
the verdict once: the ranks that did not arrive, and what each was last doing, or that it went
silent. Each rank's thread, seeing the verdict, ends its process with EXIT_RANKS_LOST: its main
thread is blocked inside the collective library, where nothing wakes it. Rank 0 first waits for a
checkpoint being written and the uploads under way, within the timeout.

A rank killed outright breaks gloo's connections instead: the collective raises at once, and
``lost`` turns that into the same verdict once the rank's beats have stopped.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from imagenet_ais import distributed
from imagenet_ais.errors import EXIT_RANKS_LOST, first_line

BEAT_MAX = 5.0  # seconds between beats at most (a tenth of the timeout where that is less)
STALE_BEATS = 4  # beats missed before a rank counts as silent (killed, stopped, its node lost)
WAITING_FOR_DATA = "waiting for data"  # (the rank's own --data-timeout bounds that wait)
VERDICT = "verdict"


@dataclass(frozen=True)
class Doing:
    """What a rank's main thread is doing, since when (wall time: beats are compared across nodes)."""

    what: str
    since: float


class Watchdog:
    """Call ``now`` wherever the run moves on, ``lost`` when a collective raised, and ``close`` at
    the run's end. ``say``: this rank's voice (rank 0's echo, else stderr); ``before_exit``: what
    must finish before the process ends (rank 0: pending uploads), given a deadline in seconds;
    ``reading``: the shards the training loader's workers read, and for how long (a rank waiting
    for data is named with them)."""

    def __init__(
        self,
        process: distributed.Process,
        timeout: float,
        say: Callable[[str], None],
        before_exit: Callable[[float], object],
        reading: Callable[[], list[tuple[str, float]]],
    ) -> None:
        self.process, self.timeout, self.say, self.before_exit = process, timeout, say, before_exit
        self.reading = reading
        self.beat = min(BEAT_MAX, timeout / 10)
        self.stale = max(STALE_BEATS * self.beat, 2.0)
        self.doing = Doing("starting", time.time())
        self.host = socket.gethostname()
        self.writing = threading.Lock()  # held while a checkpoint is written: never ended halfway
        token = distributed.broadcast_object(uuid.uuid4().hex)  # this attempt's keys, apart from any other's
        self.store = _store(f"imagenet_ais/watchdog/{token}/", self.stale)
        self.stopped = threading.Event()
        self.ending = threading.Event()  # the main thread ends the run itself (``lost``): beat on, end nothing
        self._beat()  # (before any rank can judge: every rank is here)
        self.thread = threading.Thread(target=self._watch, name="imagenet_ais watchdog", daemon=True)
        self.thread.start()

    def now(self, what: str) -> None:
        """The main thread moves on to ``what`` (a new object: the watching thread reads it whole)."""
        self.doing = Doing(what, time.time())

    @contextmanager
    def checkpoint_written(self) -> Iterator[None]:
        """Around writing a checkpoint: a verdict meanwhile ends the process only once it is written."""
        with self.writing:
            yield

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * self.beat)

    def lost(self, error: BaseException) -> str | None:
        """After a collective raised ``error``: the verdict once a rank's beats have stopped (or
        another rank's verdict), said where this rank speaks; None where every rank still beats
        (then ``error`` is no lost rank's)."""
        self.ending.set()  # (the main thread ends the run: finish closes the logs and uploads)
        deadline = time.monotonic() + self.stale + 2 * self.beat
        while True:
            try:
                beats = self._beats()
                silent = [r for r, b in beats.items() if b is None or time.time() - b["t"] > self.stale]
                verdict = self._verdict() or (self._judge(beats, first_line(error)) if silent else None)
            except Exception:  # the store is gone with the rank that held it
                verdict = self._store_gone()
            if verdict or time.monotonic() > deadline:
                break
            time.sleep(self.beat)
        if verdict and json.loads(verdict)["speaker"] == self.process.rank:
            self.say(json.loads(verdict)["line"])
        return json.loads(verdict)["line"] if verdict else None

    def _watch(self) -> None:
        while not self.stopped.wait(self.beat):
            try:
                self._beat()
                verdict = self._verdict()
                doing = self.doing
                stuck = not doing.what.startswith(WAITING_FOR_DATA) and time.time() - doing.since > self.timeout
                if not verdict and stuck:
                    verdict = self._judge(self._beats())
            except Exception:  # the store is gone with the rank that held it (or unreachable)
                verdict = self._store_gone() if time.time() - self.doing.since > self.timeout else None
            if verdict and not (self.stopped.is_set() or self.ending.is_set()):
                self._end(json.loads(verdict))

    def _beat(self) -> None:
        d = self.doing
        what = d.what
        if what.startswith(WAITING_FOR_DATA) and (reads := sorted(self.reading(), key=lambda r: -r[1])):
            what += f" (its workers reading {', '.join(f'{shard} for {s:.0f} s' for shard, s in reads[:3])})"
        beat = {"t": time.time(), "what": what, "since": d.since, "host": self.host}
        self.store.set(f"beat/{self.process.rank}", json.dumps(beat))

    def _beats(self) -> dict[int, dict | None]:
        beats: dict[int, dict | None] = {}
        for rank in range(self.process.world):
            key = f"beat/{rank}"  # (get waits for a key that is not there: checked first)
            beats[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return beats

    def _verdict(self) -> str | None:
        return self.store.get(VERDICT).decode() if self.store.check([VERDICT]) else None

    def _judge(self, beats: dict[int, dict | None], failed: str = "") -> str:
        """The verdict on the ranks that are not where this one waits, written once for all ranks
        (the store's compare-and-set: the first rank's stands); returned as it stands."""
        me, now = self.doing, time.time()
        missing, silent = [], set()
        for rank, beat in beats.items():
            if rank == self.process.rank:
                continue
            if beat is None:
                missing.append(f"rank {rank} never beat (did it start?)")
                silent.add(rank)
            elif now - beat["t"] > self.stale:
                missing.append(
                    f"rank {rank} (node {beat['host']}) silent for {now - beat['t']:.0f} s (killed, stopped, or its "
                    f"node lost), last seen at {beat['what']}"
                )
                silent.add(rank)
            elif beat["what"] != me.what:
                missing.append(f"rank {rank} (node {beat['host']}) {beat['what']} for {now - beat['since']:.0f} s")
        how = f" ({failed})" if failed else f" within --collective-timeout {self.timeout:g} s"
        who = (
            "; ".join(missing) or "every rank is there, yet the collective never completed (a network or library hang?)"
        )
        line = (
            f"ERROR: ranks did not meet at {me.what}{how}: {who}. The run ends on every rank (exit {EXIT_RANKS_LOST}); "
            "its last checkpoint stands: continue with --resume auto once every rank can run"
        )
        speaker = min(r for r in range(self.process.world) if r not in silent)
        verdict = json.dumps({"line": line, "speaker": speaker})
        return self.store.compare_set(VERDICT, "", verdict).decode()

    def _store_gone(self) -> str:
        line = (
            f"ERROR: the job's rendezvous store stopped answering while this rank was at {self.doing.what} (rank 0, "
            f"or torchrun's agent, that held it is gone). The run ends (exit {EXIT_RANKS_LOST}); its last "
            "checkpoint stands: continue with --resume auto once every rank can run"
        )
        return json.dumps({"line": line, "speaker": self.process.rank})

    def _end(self, verdict: dict) -> None:
        """Ends this process: its main thread is blocked in the collective for good."""
        if verdict["speaker"] == self.process.rank:
            self.say(verdict["line"])
        if self.writing.acquire(timeout=self.timeout):  # a checkpoint being written is finished first
            self.before_exit(self.timeout)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANKS_LOST)


def _store(prefix: str, timeout: float) -> dist.Store:
    """A connection of this thread's own to the job's rendezvous store (MASTER_ADDR:MASTER_PORT),
    with a short timeout: a rank stopped while holding it must not hold this thread too."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return dist.PrefixStore(prefix, store)


def watchable() -> bool:
    """Whether the job has a rendezvous store a watchdog can reach (torchrun's, Slurm's and
    Ray's launches set MASTER_ADDR and MASTER_PORT)."""
    return dist.is_initialized() and bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
