"""A collective that some rank never reaches ends the run on every live rank, in one line.

A rank may die, be stopped, or hang in a read or on a hung worker; the others then wait in the
collective library until its own timeout (NCCL's 10 minutes, gloo's 30) and end with a stack
trace. Here each rank's main thread says where it is (``Watchdog.now``), and a thread of its own
beats that into the job's rendezvous store (torchrun's, or rank 0's) every few seconds, with a
count. A rank that has been at one place longer than ``--collective-timeout`` reads every rank's
beat twice, a few beats apart (a count that did not move: a silent rank; clocks across nodes
are not compared), and where some rank is silent or at work of its own (waiting for its data,
writing a checkpoint), writes the verdict once: those ranks and what each was last doing. A
rank waiting at another meeting is named only where no rank is either (collectives that do not
match): one a step ahead met this one already, and waits for the same missing rank. Where every
rank is at the same place (a long first-step compile, a long validation) nothing is judged: the
collective library's timeout stays the bound.

Each rank's thread, seeing the verdict, ends its process with EXIT_RANKS_LOST (its main thread
is blocked in the collective library, where nothing wakes it), after a checkpoint being written
is finished and ``before_exit`` (rank 0: its logs closed and uploaded), within the process
group's own timeout. A rank killed outright breaks gloo's connections instead: the collective
raises at once, and ``lost`` turns that into the same verdict. A rank that ends on a failure of
its own (``last``) writes the verdict itself: the others end within a beat. Every call to the
store is bounded (``Answering``): where its holder is stopped or cut off, each rank says so
itself.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from imagenet_ais import distributed
from imagenet_ais.errors import EXIT_RANKS_LOST, first_line

BEAT_MAX = 5.0  # seconds between beats at most (a tenth of the timeout where that is less)
STALE_BEATS = 4  # beats a count may stand still before its rank counts as silent (killed, stopped, its node lost)
FIRST = 300.0  # seconds the process group's own timeout exceeds --collective-timeout by: this line comes first
VERDICT = "verdict"
RESUME = "its last checkpoint stands: continue with --resume auto once every rank can run"  # (every verdict's end)
# what the store's client raises when its server is gone or does not answer (TimeoutError: Answering)
UNANSWERED = (dist.DistError, OSError)


@dataclass(frozen=True)
class Doing:
    """Where a rank's main thread is, since when (monotonic); ``meeting``: it may be waiting for the
    other ranks there (a step's all-reduce, a gather), not for something of its own; ``for_data``:
    it waits for its loader's next batch (its beats name the shards the workers read)."""

    what: str
    meeting: bool = True
    for_data: bool = False
    since: float = field(default_factory=time.monotonic)
    ended: bool = False  # the rank's run ends here, of a failure of its own (``last``)


class Watchdog:
    """Call ``now`` wherever the run moves on, ``lost`` when a collective raised, and ``close`` at
    the run's end. ``say``: this rank's voice (rank 0's echo, else stderr); ``before_exit``: what
    must finish before the process ends (rank 0: its logs closed and uploaded), given a deadline in
    seconds; ``reading``: the shards the training loader's workers read, and for how long (a rank
    waiting for data is named with them). ``token`` names this attempt's keys in the store (the
    same on every rank, another on each attempt)."""

    def __init__(
        self,
        process: distributed.Process,
        timeout: float,
        token: str,
        say: Callable[[str], None],
        before_exit: Callable[[float], object],
        reading: Callable[[], list[tuple[str, float]]],
    ) -> None:
        self.process, self.timeout, self.say, self.before_exit = process, timeout, say, before_exit
        self.reading = reading
        self.beat = min(BEAT_MAX, self.timeout / 10)
        self.stale = max(STALE_BEATS * self.beat, 2.0)
        self.doing, self.count, self.host = Doing("starting", meeting=False), 0, socket.gethostname()
        self.writing = threading.Lock()  # held while a checkpoint is written: never ended halfway
        self.store = Answering(f"imagenet_ais/watchdog/{token}", self.stale)
        self.stopped = threading.Event()
        self.ending = threading.Event()  # the main thread ends the run (``lost``, ``last``): beat on, end nothing
        self.beating = threading.Lock()  # one beat at a time: an ended rank's last beat is the one that says so
        self.verdict: str | None = None  # once seen (the store may go with the rank that held it)
        self.said = threading.Lock()  # the line is said once, by its thread or the main one, whichever first
        self._beat()  # (before any rank can judge: every rank is here)
        self.thread = threading.Thread(target=self._watch, name="imagenet_ais watchdog", daemon=True)
        self.thread.start()

    def now(self, what: str, meeting: bool = True, for_data: bool = False) -> None:
        """The main thread moves on to ``what`` (a new object: the watching thread reads it whole)."""
        self.doing = Doing(what, meeting, for_data)

    def last(self, what: str, for_data: bool = False) -> None:
        """This rank ends at ``what``, a failure of its own (its main thread ends the run, as in
        ``lost``): its beat says so, and so does the verdict, written at once, so that the ranks it
        leaves waiting end within a beat, naming it, not after --collective-timeout (``for_data``:
        with the shards its workers were reading). Where this process serves the store, it
        lingers until they have read the verdict."""
        self.ending.set()
        what += self._reads() if for_data else ""
        self.doing = Doing(what, meeting=False, ended=True)
        line = (
            f"ERROR: ranks cannot meet again: rank {self.process.rank} (node {self.host}) ended: {what} (its own line "
            f"says why). The run ends on every other rank (exit {EXIT_RANKS_LOST}); {RESUME}"
        )
        others = set(range(self.process.world)) - {self.process.rank}
        with suppress(*UNANSWERED):
            self._beat()
            self._linger(json.loads(self._written({"line": line, "speaker": min(others), "silent": []})))

    @contextmanager
    def checkpoint_written(self) -> Iterator[None]:
        """Around writing a checkpoint: a verdict meanwhile ends the process only once it is written."""
        with self.writing:
            yield

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * self.beat)
        self.store.close()

    def lost(self, error: RuntimeError) -> bool:
        """After a collective raised ``error``: whether a rank was lost (its beats stopped, or
        another rank's verdict says so), said where this rank speaks; False where every rank still
        beats (``error`` is no lost rank's). Only the collective libraries' errors are looked into."""
        if not (isinstance(error, dist.DistError) or any(lib in str(error) for lib in ("gloo", "NCCL"))):
            return False
        self.ending.set()  # (the main thread ends the run: finish closes the logs and uploads)
        try:
            verdict = self._seen() or self._judge(self.doing, first_line(error), silent_only=True)
        except UNANSWERED:  # the store went with the rank that held it
            verdict = self.verdict or self._store_gone()
        if verdict:
            said = json.loads(verdict)
            self._say(said)
            self._linger(said)
        return verdict is not None

    def _watch(self) -> None:
        while not self.stopped.wait(self.beat):
            doing = self.doing
            stuck = doing.meeting and time.monotonic() - doing.since > self.timeout
            try:
                self._beat()
                verdict = self._seen() or (self._judge(doing) if stuck else None)
            except UNANSWERED:  # the store went with the rank that held it (or does not answer)
                verdict = self.verdict or (self._store_gone() if stuck else None)
            if verdict and not (self.stopped.is_set() or self.ending.is_set()):
                self._end(json.loads(verdict))

    def _beat(self) -> None:
        with self.beating:
            d, self.count = self.doing, self.count + 1  # (two threads may beat: any change of the count is life)
            what = d.what + (self._reads() if d.for_data else "")
            beat = {
                "n": self.count, "what": what, "for": time.monotonic() - d.since, "host": self.host,
                "meeting": d.meeting, "ended": d.ended,
            }  # fmt: skip
            self.store.set(f"beat/{self.process.rank}", json.dumps(beat))

    def _reads(self) -> str:
        """The shards the training loader's workers read, longest first, as " (its workers reading X
        for 12 s, ...)"; "" where none (or where the loader cannot say: no beat is lost for it)."""
        try:
            reads = sorted(self.reading(), key=lambda r: -r[1])
        except Exception:  # (a loader shutting down, say)
            return ""
        said = ", ".join(f"{shard} for {s:.0f} s" for shard, s in reads[:3])
        return f" (its workers reading {said})" if reads else ""

    def _beats(self) -> dict[int, dict | None]:
        beats: dict[int, dict | None] = {}
        for rank in range(self.process.world):
            key = f"beat/{rank}"  # (get waits for a key that is not there: checked first)
            beats[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return beats

    def _seen(self) -> str | None:
        if self.verdict is None and self.store.check([VERDICT]):
            self.verdict = self.store.get(VERDICT).decode()
            self.store.set(f"seen/{self.process.rank}", "")  # (the store's holder waits for these)
        return self.verdict

    def _judge(self, doing: Doing, failed: str = "", silent_only: bool = False) -> str | None:
        """The verdict on the ranks that are silent or not where this one waits at ``doing``,
        written once for all ranks (the store's compare-and-set: the first rank's stands), or
        None: none is missing (``silent_only``: none is silent), or this rank moved on meanwhile."""
        before = self._beats()
        for _ in range(round(self.stale / self.beat)):  # (a count that stands still over this: a silent rank)
            time.sleep(self.beat)
            self._beat()  # (this rank's own goes on: another rank may be judging too)
            if self._seen():  # another rank's verdict came first
                return self.verdict
        after = self._beats()
        missing: list[str] = []
        meeting: list[str] = []  # ranks waiting at another collective
        silent: set[int] = set()
        for rank in range(self.process.world):
            was, beat = before[rank], after[rank]
            if rank == self.process.rank:
                continue
            if beat and beat["ended"]:  # (its last beats may still have moved its count)
                missing.append(f"rank {rank}{_node(beat)} ended: {beat['what']}")
                silent.add(rank)
            elif beat is None or (was is not None and was["n"] == beat["n"]):
                last = f", last seen at {beat['what']}" if beat else ""
                missing.append(f"rank {rank}{_node(beat)} silent (killed, stopped, or its node lost){last}")
                silent.add(rank)
            elif beat["what"] != doing.what and not silent_only:
                named = f"rank {rank}{_node(beat)} {beat['what']} for {beat['for']:.0f} s"
                (meeting if beat["meeting"] else missing).append(named)
        missing = missing or meeting  # (one that met this collective and waits at the next is not the cause)
        if not missing or (self.doing is not doing and not failed):
            return None
        how = f" ({failed})" if failed else f" within --collective-timeout {self.timeout:g} s"
        line = (
            f"ERROR: ranks did not meet at {doing.what}{how}: {'; '.join(missing)}. The run ends on every rank "
            f"(exit {EXIT_RANKS_LOST}); {RESUME}"
        )
        speaker = min(set(range(self.process.world)) - silent)
        return self._written({"line": line, "speaker": speaker, "silent": sorted(silent)})

    def _written(self, verdict: dict) -> str:
        """The verdict once written for all ranks: ``verdict``, or another rank's that came first
        (the store's compare-and-set: the first stands)."""
        self.verdict = self.store.compare_set(VERDICT, "", json.dumps(verdict)).decode()
        self.store.set(f"seen/{self.process.rank}", "")  # (the store's holder waits for these)
        return self.verdict

    def _store_gone(self) -> str:
        line = (
            f"ERROR: the job's rendezvous store stopped answering while this rank was at {self.doing.what} (rank 0, "
            f"or torchrun's agent, that held it is gone). The run ends (exit {EXIT_RANKS_LOST}); {RESUME}"
        )
        return json.dumps({"line": line, "speaker": self.process.rank})

    def _say(self, verdict: dict) -> None:
        if verdict["speaker"] == self.process.rank and self.said.acquire(blocking=False):
            self.say(verdict["line"])

    def _end(self, verdict: dict) -> None:
        """Ends this process: its main thread is blocked in the collective for good. What is left to
        do gets at most FIRST / 2 seconds, well within the process group's own timeout (NCCL's ends
        the process by an abort), and the process ends even where something of it fails (a full disk)."""
        try:
            self._say(verdict)
            budget = min(self.timeout, FIRST / 2)
            deadline = time.monotonic() + budget
            if self.writing.acquire(timeout=budget):  # a checkpoint being written is finished first
                self.before_exit(max(0.0, deadline - time.monotonic()))
            self._linger(verdict)
        finally:
            with suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(EXIT_RANKS_LOST)

    def _linger(self, verdict: dict) -> None:
        """Where this process serves the store, which goes with it: until every rank the verdict
        does not name silent has read it (else that rank finds the store gone and says so too), or
        for as long as a beat may stand still."""
        if not _holds_store(self.process):
            return
        readers = [f"seen/{rank}" for rank in range(self.process.world) if rank not in verdict.get("silent", ())]
        deadline = time.monotonic() + self.stale
        with suppress(*UNANSWERED):
            while not self.store.check(readers) and time.monotonic() < deadline:
                time.sleep(0.05)


def _node(beat: dict | None) -> str:
    return f" (node {beat['host']})" if beat else ""


def _holds_store(process: distributed.Process) -> bool:
    """Whether this process serves the job's store: rank 0, unless torchrun's agent does."""
    return process.main and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


class Answering:
    """A connection of the watchdog's own to the job's rendezvous store (MASTER_ADDR:MASTER_PORT),
    each call given ``timeout`` seconds to answer, else TimeoutError: a store whose holder is
    stopped (SIGSTOP) or cut off keeps its socket open, and a call would wait there for ever
    whatever TCPStore's own timeout says. Calls run one at a time on a thread of its own, left
    behind (a daemon) where one never returns."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self.timeout = timeout
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        self.store = dist.PrefixStore(prefix, store)  # this attempt's keys alone
        self.calls: queue.SimpleQueue[tuple[Callable[[], object], Answer] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="imagenet_ais watchdog store", daemon=True).start()

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.store.get(key))  # type: ignore[return-value]

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda: self.store.check(keys))  # type: ignore[return-value]

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        return self._call(lambda: self.store.compare_set(key, expected, value))  # type: ignore[return-value]

    def _call(self, call: Callable[[], object]) -> object:
        answer = Answer()
        self.calls.put((call, answer))
        if not answer.wait(self.timeout):
            raise TimeoutError(f"the job's rendezvous store did not answer within {self.timeout:g} s")
        if answer.error is not None:
            raise answer.error
        return answer.value

    def close(self) -> None:
        """Ends its thread once the calls before this one are answered; the connection goes with it."""
        self.calls.put(None)

    def _serve(self) -> None:
        while (item := self.calls.get()) is not None:
            call, answer = item
            try:
                answer.value = call()
            except Exception as e:  # (the caller's to raise)
                answer.error = e
            answer.set()


class Answer(threading.Event):
    """A store call's outcome, set once it returned or raised."""

    value: object = None
    error: Exception | None = None


def watchable() -> bool:
    """Whether the job has a rendezvous store a watchdog can reach (torchrun's, Slurm's and
    Ray's launches set MASTER_ADDR and MASTER_PORT)."""
    return dist.is_initialized() and bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
