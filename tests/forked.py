"""train.py in processes of its own that skip torch's import: each is forked from a server that
imported train.py once (each new process imports torch again: 4-5 s of CPU here, 3 of them for a
torchrun of two ranks).

For tests where a process is the point but a fresh interpreter is not: signals, exit statuses,
what outlives a run, ranks that train together. Where the command line itself is (train.py's
start, torchrun's signals and restarts, ./run), tests start that."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conftest import ROOT, free_port, output_to

# The server imports these once; each process is a fork of it, never of a pytest process, which
# may have run a backward pass: autograd's threads do not survive a fork.
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["imagenet_ais.cli.train", "forked"])


class Started:
    """``train.py ARGS`` running in a forked process, with ``subprocess.Popen``'s calls: its pid,
    ``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate`` and ``returncode`` (-N for a
    signal's end). ``env`` is added to this process's environment, as of now; ``merged``: stderr
    into stdout, as ``stderr=STDOUT``; ``new_session``: its own session and process group, as
    ``start_new_session=True``."""

    def __init__(
        self, *args: str | Path, env: dict[str, str] | None = None, merged: bool = False, new_session: bool = False
    ) -> None:
        self.args = ["train.py", *map(str, args)]
        self._folder = tempfile.TemporaryDirectory(prefix="forked")
        self._out = Path(self._folder.name, "out")
        self._err = None if merged else Path(self._folder.name, "err")
        for path in (self._out, self._err or self._out):
            path.touch()  # (there to read before the process writes to it)
        self.stdout, self.log = None, self._out  # (printed to a file, not a pipe: for wait_until's log=)
        environ = {**os.environ, **(env or {})}
        # (a process the server forks takes its start method: its DataLoader workers would be the server's)
        method = multiprocessing.get_start_method(allow_none=True)
        how = (self.args[1:], environ, self._out, self._err, new_session, method)
        self._process = _SERVER.Process(target=_train, args=how)
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Once it has ended: what it printed to stdout and to stderr (None where ``merged``)."""
        self.wait(timeout)
        printed = self._out.read_text(errors="replace"), self._err.read_text(errors="replace") if self._err else None
        self._folder.cleanup()
        return printed


def ranks(
    nproc: int,
    *args: str | Path,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    rank_args: Callable[[int], Sequence[str | Path]] = lambda rank: (),
) -> subprocess.CompletedProcess:
    """train.py ARGS on ``nproc`` ranks to their end (see ``start_ranks``): what they printed, rank
    after rank, and the first failed rank's status. A rank that fails stops the others with
    SIGTERM, as torchrun does."""
    started = start_ranks(nproc, *args, env=env, rank_args=rank_args)
    codes = _end_together(started, timeout)
    printed = [proc.communicate() for proc in started]
    out, err = ("".join(p[i] for p in printed) for i in (0, 1))
    failed = [code for code in codes if code != 0]
    done = subprocess.CompletedProcess(started[0].args, failed[0] if failed else 0, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"{nproc} ranks of {done.args} failed {codes}:\n{out}\n{err}")
    return done


def start_ranks(
    nproc: int,
    *args: str | Path,
    env: dict[str, str] | None = None,
    rank_args: Callable[[int], Sequence[str | Path]] = lambda rank: (),
) -> list[Started]:
    """train.py ARGS started on ``nproc`` ranks of one node, each with the environment torchrun
    gives it (gloo on this CPU, one intra-op thread: they share the cores); ``rank_args(rank)``:
    that rank's own arguments after them (as nodes that read the data from different places)."""
    port = free_port()
    extra = {**(env or {}), "OMP_NUM_THREADS": "1"}
    return [Started(*args, *rank_args(rank), env={**extra, **_rank_env(rank, nproc, port)}) for rank in range(nproc)]


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    }


def _end_together(started: list[Started], timeout: float) -> list[int]:
    """Each rank's status; once one has failed or ``timeout`` s have passed, the others get
    SIGTERM, and SIGKILL 30 s later."""
    deadline, stopped_at = time.monotonic() + timeout, None
    while running := [p for p in started if p.poll() is None]:
        multiprocessing.connection.wait([p._process.sentinel for p in running], timeout=0.5)
        failed = any(p.poll() not in (None, 0) for p in started)
        if stopped_at is None and (failed or time.monotonic() > deadline):
            stopped_at = time.monotonic()
            for p in running:
                p.send_signal(signal.SIGTERM)
        elif stopped_at is not None and time.monotonic() > stopped_at + 30:
            for p in running:
                p.kill()
    if time.monotonic() > deadline:
        raise AssertionError(f"{started[0].args}: ranks still running after {timeout:.0f} s")
    return [p.wait() for p in started]


OUT_OF_MEMORY = "FORKED_OUT_OF_MEMORY"  # RANK:STEP in a rank's environment: that rank's step runs out of GPU memory


def _out_of_memory_at(step: int) -> None:
    """(A test's fault, in the forked process) the training step ``step`` fails as NCCL's all-reduce
    does when the GPU is too full for its buffers (torch quotes NCCL's last warning): there is no
    GPU here."""
    from torch.distributed import DistBackendError

    from imagenet_ais.train import loop

    real = loop.train_step

    def train_step(run: Any, *args: Any) -> Any:
        if run.train_state.step + 1 == step:
            raise DistBackendError(
                "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, unhandled cuda "
                "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.28.3\nncclUnhandledCudaError: Call "
                "to CUDA function failed.\nLast error:\nCuda failure 2 'out of memory'"
            )
        return real(run, *args)

    loop.train_step = train_step


def _train(
    argv: list[str], environ: dict[str, str], out: Path, err: Path | None, new_session: bool, method: str | None
) -> None:
    """In the forked process: this environment and folder, stdout and stderr to files, then
    train.py's main and the exit hooks an interpreter runs as it ends (a forked process skips them)."""
    import torch

    from imagenet_ais.cli import train as train_cli

    multiprocessing.set_start_method(method, force=True)
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:  # (read by torch at its import, in the server)
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    rank, _, step = environ.get(OUT_OF_MEMORY, "").partition(":")
    if step and environ.get("RANK") == rank:
        _out_of_memory_at(int(step))
    os.chdir(ROOT)
    with out.open("ab") as o, (err or out).open("ab") as e, output_to(o, e):
        try:
            train_cli.main(argv, prog_name="train.py")
        finally:
            atexit._run_exitfuncs()
