"""What a run of several ranks tells about them: the rank that held the others back and why,
what the data cost per store, and a collective that some rank never reached, ended in one line
on every rank. Ranks are forked processes on gloo, each its own "node" (nothing kills the
others when one dies, as on NGC or Slurm across nodes)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, QuietHandler, child_pids, http_server, records, wait_until, write_shards
from forked import OUT_OF_MEMORY, Started, ranks, start_ranks

from imagenet_ais.distributed import Process
from imagenet_ais.errors import EXIT_BAD_DATA, EXIT_OUT_OF_MEMORY, EXIT_RANKS_LOST, EXIT_WORKER_DIED
from imagenet_ais.train.data_cost import DataCost, described
from imagenet_ais.train.slow_rank import slowest
from imagenet_ais.train.watchdog import Watchdog

TRAIN, VAL = [8] * 6, [4, 4]  # 48 samples: 4 steps of 3 ranks × 4
TIMEOUT = 8  # --collective-timeout: over a loaded machine's first batch, under a test's patience


def test_the_rank_reading_through_a_slow_server_is_named_with_its_reads(serve, tmp_path: Path) -> None:
    """Three ranks, the third reading the same shards through a server that sends 24 kB/s a
    connection: the epoch's line names it, its wait and its store's pace against the others';
    the data cost per store is logged, said, and carried by the checkpoint."""
    data, output = tmp_path / "shards", tmp_path / "run"
    manifest = write_shards(data, {"train": TRAIN, "val": VAL})
    fast, slow = serve(data), serve(data, SERVE_RATE="24k")
    done = ranks(
        3,
        "--output",
        output,
        *TINY,
        "--epochs",
        "1",
        "--workers",
        "1",
        "--epoch-mode",
        "exact",
        "--log-every",
        "2",
        rank_args=lambda rank: ["--data", f"{slow.url if rank == 2 else fast.url}/"],
    )
    (epoch,) = records(output, "epoch")
    held = epoch["held_back"]
    assert held.startswith("epoch 1: rank 2 (node ") and "held the others back: it waited" in held, held
    assert f"its reads from {slow.url}/ came at" in held, held
    assert held in done.stdout
    paces = [r["pace_mb_s"] for r in epoch["ranks"]]
    assert 3 * paces[2][f"{slow.url}/"] < min(paces[0][f"{fast.url}/"], paces[1][f"{fast.url}/"]), paces
    assert max(r["data_wait"] for r in epoch["ranks"][:2]) < epoch["ranks"][2]["data_wait"]

    # the data cost: every train and val shard read at least once
    cost = epoch["data"]
    assert set(cost) == {f"{fast.url}/", f"{slow.url}/"}
    listed = sum(s.bytes for split in ("train", "val") for s in manifest.splits[split].shards)
    assert epoch["read_bytes"] == sum(c["read_bytes"] for c in cost.values()) >= listed
    for server in (fast, slow):  # every request to a shard counted: nginx's log says how many it answered
        answered = [line for line in server.log.read_text().splitlines() if ".tar HTTP/" in line]
        assert cost[f"{server.url}/"]["read_requests"] == len(answered) > 0, answered
    assert all(c["cache_bytes"] == c["reread_bytes"] == 0 for c in cost.values())
    (said,) = [line for line in done.stdout.splitlines() if line.startswith("epoch 1 data: ")]
    assert f"{fast.url}/ " in said and f"{slow.url}/ " in said and " requests; " in said, said
    state = torch.load(output / "last.pt", weights_only=True)
    assert {loc: c["read_bytes"] for loc, c in state["data_cost"]["run"].items()} == {
        loc: c["read_bytes"] for loc, c in cost.items()
    }, "the checkpoint carries the run's reads"
    assert "data: every sample was read as the manifest lists it; the run read " in done.stdout

    # each rank's figures in each window's record, and in TensorBoard under ranks/<name>/<rank>
    for window in records(output, "train"):
        assert len(window["ranks"]) == 3 and all("forward_ms_p50" in r and "read_mb_s" in r for r in window["ranks"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(output)).Reload().Tags()["scalars"]
    assert {"ranks/data_wait/000", "ranks/data_wait/001", "ranks/data_wait/002", "epoch/read_bytes"} <= set(tags), tags


@contextlib.contextmanager
def hanging_server(root: Path) -> Iterator[str]:
    """An HTTP server of ``root`` whose shard GETs send their first 4 kB, then nothing more
    (a read that hangs: a stalled mount, a store that stopped answering mid-object)."""
    released = threading.Event()

    class Handler(QuietHandler):
        def copyfile(self, source, outputfile) -> None:
            if not self.path.endswith(".tar"):
                return super().copyfile(source, outputfile)
            outputfile.write(source.read(4096))
            outputfile.flush()
            released.wait(120)
            return None

    with http_server(root, Handler) as url:
        try:
            yield f"{url}/"
        finally:
            released.set()


@pytest.mark.parametrize("how", ["stopped", "killed", "hung read"])
def test_a_rank_that_never_arrives_ends_every_live_rank_in_one_line(how: str, tmp_path: Path) -> None:
    """Rank 1 stopped (its connections open: the others would wait for gloo's 30 minutes) or
    killed (gloo's connections break) mid-epoch, or rank 2's read hanging from its first shard:
    every live rank ends with exit 6 within --collective-timeout, one line names the rank and
    what it was last doing, and the last checkpoint is whole."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN})
    with hanging_server(data) as hanging:
        started = start_ranks(
            3, "--output", output, *TINY, "--epochs", "50", "--workers", "1", "--log-every", "1",
            "--checkpoint-every", "3", "--collective-timeout", str(TIMEOUT),
            rank_args=lambda rank: ["--data", hanging if how == "hung read" and rank == 2 else data],
        )  # fmt: skip
        try:
            codes, took = _stopped_one(started, how)
        finally:
            for proc in started:
                proc.kill()
    assert codes == dict.fromkeys([0, 2] if how == "killed" else [0, 1, 2], EXIT_RANKS_LOST), codes
    assert took < TIMEOUT + 15, f"{took:.0f} s: bounded by --collective-timeout (and a few beats)"
    printed = "".join(out + (err or "") for out, err in (proc.communicate() for proc in started))
    errors = [line for line in printed.splitlines() if "ERROR" in line]
    (line,) = [line for line in errors if "did not meet" in line]
    others = [e for e in errors if e != line]  # (rank 1, stopped, finds the store gone with rank 0 once continued)
    assert not others or (how == "stopped" and all(e.startswith("rank 1: ") for e in others)), errors
    assert "continue with --resume auto" in line and "Traceback" not in printed, printed
    (ended,) = records(output, "run")  # (rank 0's metrics.jsonl closed, ended by the verdict or not)
    assert ended["status"] == "failed" and "data" in ended, ended
    if how == "hung read":
        assert (
            f"rank 2 (node {socket.gethostname()}) waiting for data for step 1 (its workers reading {hanging}" in line
        )
        assert "rank 0 " not in line and "rank 1 " not in line, "the ranks that arrived are not named"
        return
    assert "rank 1 (node " in line and "silent (killed, stopped, or its node lost)" in line, line
    assert re.search(r"last seen at (training|waiting for data for|saving the checkpoint of) step \d+", line), line
    assert "rank 0 " not in line and "rank 2 " not in line, "the live ranks are not named"
    state = torch.load(output / "last.pt", weights_only=True)  # (whole: its digest is checked on resume)
    assert state["step"] >= 4 and not list(output.glob(".*")), list(output.iterdir())


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_rank_whose_read_outlasts_its_data_timeout_ends_and_the_others_name_it(split: str, tmp_path: Path) -> None:
    """Rank 1's first training read, or its validation's, hangs past its --data-timeout (5 s), well
    inside --collective-timeout (60 s): it ends with its own line and status (4), and rank 0 ends at
    once (6), not after the collective timeout, naming rank 1 as ended, where, and the shard its
    training workers were reading."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN, "val": [4]})
    with hanging_server(data) as hanging:
        hangs = ["--data", hanging] if split == "train" else ["--data", data, "--val-data", hanging]
        started = start_ranks(
            2, "--output", output, *TINY, "--epochs", "2", "--workers", "1", "--collective-timeout", "60",
            rank_args=lambda rank: [*hangs, "--data-timeout", "5"] if rank else ["--data", data],
        )  # fmt: skip
        try:
            wait_until(started[0], lambda: "TensorBoard: " in started[0].log.read_text(), "set up", log=started[0].log)
            began = time.monotonic()
            codes = {rank: proc.wait(timeout=60) for rank, proc in enumerate(started)}
            took = time.monotonic() - began
        finally:
            for proc in started:
                proc.kill()
    assert codes == {0: EXIT_RANKS_LOST, 1: EXIT_BAD_DATA}, codes
    assert took < 30, f"{took:.0f} s: rank 0 ended on rank 1's verdict, not on --collective-timeout"
    printed = "".join(out + (err or "") for out, err in (proc.communicate() for proc in started))
    (line,) = [line for line in printed.splitlines() if "cannot meet again" in line]
    ended = f"rank 1 (node {socket.gethostname()}) ended: its data loader failed at "
    if split == "train":
        assert f"{ended}step 1 (Stalled) (its workers reading {hanging}" in line, line
    else:
        assert f"{ended}validation after epoch 1 (Stalled) (its own line says why)" in line, line
    assert "Traceback" not in printed, printed


def test_ranks_whose_rendezvous_store_stops_answering_end_in_one_line(tmp_path: Path) -> None:
    """Rank 0, which serves the job's store here (as in Ray's and Slurm's launches), stopped
    mid-epoch: a call to the store would wait on its open socket for ever. Ranks 1 and 2 end with 6
    within --collective-timeout and a few beats, each saying that the store stopped answering."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN})
    started = start_ranks(
        3, "--data", data, "--output", output, *TINY, "--epochs", "50", "--workers", "1", "--log-every", "1",
        "--collective-timeout", str(TIMEOUT),
    )  # fmt: skip
    try:
        mark = "epoch 2/50 step 2/4"
        wait_until(started[0], lambda: mark in started[0].log.read_text(), mark, log=started[0].log)
        began = time.monotonic()
        os.kill(started[0].pid, signal.SIGSTOP)
        codes = {rank: started[rank].wait(timeout=60) for rank in (1, 2)}
        took = time.monotonic() - began
    finally:
        for proc in started:
            proc.kill()
    assert codes == {1: EXIT_RANKS_LOST, 2: EXIT_RANKS_LOST}, codes
    assert took < TIMEOUT + 15, f"{took:.0f} s: bounded by --collective-timeout (and a few beats)"
    printed = "".join(out + (err or "") for out, err in (proc.communicate() for proc in started[1:]))
    errors = [line for line in printed.splitlines() if "ERROR" in line]
    assert sorted(line.split(":")[0] for line in errors) == ["rank 1", "rank 2"], errors
    assert all("the job's rendezvous store stopped answering" in line for line in errors), errors
    assert "Traceback" not in printed, printed


@pytest.mark.parametrize(
    ("how", "failing", "code", "says", "ended"),
    [
        ("GPU", 1, EXIT_OUT_OF_MEMORY, "cpu ran out of memory for ", "out of GPU memory at step 8 (its own line"),
        ("GPU", 0, EXIT_OUT_OF_MEMORY, "cpu ran out of memory for ", "out of GPU memory at step 8 (its own line"),
        ("worker", 1, EXIT_WORKER_DIED, "", "its data loader failed at step "),
    ],
    ids=["out of memory", "out of memory on the store's rank", "a worker killed"],
)
def test_a_rank_that_fails_alone_says_so_and_the_others_name_it(
    how: str, failing: int, code: int, says: str, ended: str, tmp_path: Path
) -> None:
    """A rank's GPU runs out of memory at step 8 (the second of epoch 2: NCCL's buffers), or its
    DataLoader worker is killed there: that rank says its line and ends with its own status; the
    other, left at the step's all-reduce, ends with 6, naming it as ended and at what (rank 0, which
    serves the job's store here, stays until the other has read that); the last checkpoint is whole."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN})
    started = start_ranks(
        2, "--data", data, "--output", output, *TINY, "--epochs", "50", "--workers", "1", "--log-every", "1",
        "--collective-timeout", str(TIMEOUT), env={OUT_OF_MEMORY: f"{failing}:8"} if how == "GPU" else {},
    )  # fmt: skip
    try:
        if how == "worker":
            mark = "epoch 2/50 step 2/6"
            wait_until(started[0], lambda: mark in started[0].log.read_text(), mark, log=started[0].log)
            (worker,) = child_pids(started[failing].pid)
            os.kill(worker, signal.SIGKILL)
        codes = {rank: proc.wait(timeout=120) for rank, proc in enumerate(started)}
    finally:
        for proc in started:
            proc.kill()
    other = 1 - failing
    assert codes == {other: EXIT_RANKS_LOST, failing: code}, codes
    printed = "".join(out + (err or "") for out, err in (proc.communicate() for proc in started))
    errors = [line for line in printed.splitlines() if "ERROR" in line]
    (line,) = [line for line in errors if "cannot meet again" in line]
    (own,) = [e for e in errors if e != line]
    assert own.startswith(f"rank 1: ERROR: {says}" if failing else f"ERROR: {says}"), errors
    assert line.startswith("rank 1: " if other else "ERROR: "), line
    assert f"rank {failing} (node {socket.gethostname()}) ended: {ended}" in line, line
    assert "Traceback" not in printed, printed
    state = torch.load(output / "last.pt", weights_only=True)  # (whole: its digest is checked on resume)
    assert state["step"] >= 6 and not list(output.glob(".*")), list(output.iterdir())


def _stopped_one(started: list[Started], how: str) -> tuple[dict[int, int], float]:
    """The exit status of each rank that lived once rank 1 is stopped or killed mid-epoch (or,
    for a hung read, once the ranks are set up), and the seconds they took to end from then."""
    mark = "TensorBoard: " if how == "hung read" else "epoch 2/50 step 2/4"  # (set up; mid-epoch)
    wait_until(started[0], lambda: mark in started[0].log.read_text(), mark, log=started[0].log)
    began = time.monotonic()
    if how != "hung read":
        os.kill(started[1].pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
    codes = {r: started[r].wait(timeout=60) for r in (0, 2)}
    took = time.monotonic() - began
    if how == "stopped":  # continued, it finds the verdict and ends alike
        os.kill(started[1].pid, signal.SIGCONT)
    if how != "killed":
        codes[1] = started[1].wait(timeout=30)
    return codes, took


def figures(wait: float, forward: float = 10.0, host: str = "n", pace: dict | None = None) -> dict:
    return {
        "host": host, "seconds": 60.0, "data_wait": wait, "forward_ms": forward, "busy": {}, "pace_mb_s": pace or {},
        "cache_mb_s": 0,
    }  # fmt: skip


FED, SLOW = {"ais://a": 80.0, "s3://b": 5.0}, {"ais://a": 10.0, "s3://b": 6.0}  # (a mixture: s3 slower for all)


@pytest.mark.parametrize(
    ("ranks", "said"),
    [
        ([figures(0.001), figures(0.4)], "rank 1 (node n) held the others back: it waited 40% of its time"),
        ([figures(0.01), figures(0.02), figures(0.3), figures(0.01)], "rank 2 (node n) held the others back"),
        ([figures(0.2), figures(0.3)], "no one rank held the others back: every rank waited for data"),
        ([figures(0.0, 10), figures(0.0, 10), figures(0.01, 12)], "rank 2 (node n) held the others back: its forward"),
        ([figures(0.01, 10), figures(0.0, 10.5)], "no rank held the others back: the most any waited for data was 1%"),
        # a slow node's ranks, though they are most of the job, named together
        (
            [figures(w, host=h) for w, h in [(0.0, "a"), (0.0, "a"), (0.4, "b"), (0.38, "b"), (0.4, "c"), (0.41, "c")]],
            "4 ranks (2-5, on nodes b, c) held the others back, rank 5 (node c) the most: it waited 41% of its time "
            "for data (the others' median 0%)",
        ),
        ([figures(0.0), figures(0.3), figures(0.3)], "2 ranks (1-2, on node n) held the others back, rank 1 (node"),
        # the feed the limit everywhere, some ranks more: no rank is named as holding the others back
        ([figures(0.30), figures(0.28), figures(0.25), figures(0.10)], "every rank waited for data (the median rank"),
        # most ranks alike, one faster: the many are not named as slow
        ([*[figures(0.0, 100) for _ in range(7)], figures(0.0, 89)], "no rank held the others back"),
        # of two ranks, the one 20% slower (the median of the two would hide it)
        ([figures(0.0, 10), figures(0.0, 12)], "rank 1 (node n) held the others back: its forward passes took 20% "),
        # its slowest store against the same store's pace on the fed ranks, not against any store's
        (
            [figures(0.0, pace=FED), figures(0.3, pace=SLOW), figures(0.0, pace=FED)],
            "its reads from ais://a came at 10.00 MB/s a stream against the others' median of 80.00",
        ),
    ],
)
def test_the_line_names_the_ranks_that_held_the_others_back(ranks: list[dict], said: str) -> None:
    assert said in (slowest(3, ranks) or "")


def test_an_epoch_this_attempt_did_not_train_names_no_rank() -> None:
    assert slowest(3, [{**figures(0.0), "seconds": 0.0}, {**figures(0.4), "seconds": 0.0}]) is None


@pytest.mark.parametrize(
    ("others", "named", "not_named"),
    [
        # rank 0 met step 6's all-reduce before rank 1 stopped, and waits at step 7's (a CI run named it)
        ({0: ("training step 7", True, True), 1: ("training step 6", True, False)}, "rank 1 ", "rank 0 "),
        ({0: ("waiting for data for step 6", False, True), 1: ("training step 7", True, True)}, "rank 0 ", "rank 1 "),
        ({0: ("validation after epoch 1", True, True), 1: ("training step 6", True, True)}, "rank 0 ", "rank 1 "),
    ],
    ids=["one ahead, one silent", "one at its own work", "collectives that do not match"],
)
def test_the_verdict_names_the_ranks_that_hold_the_meeting_up(
    others: dict, named: str, not_named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2, stuck at step 6's all-reduce, judges: a rank silent or at work of its own is named;
    one waiting at another collective only where none is (each tuple: what, meeting, beating)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    dog = Watchdog(Process(2, 3, 0, torch.device("cpu")), 1.0, "t", print, lambda s: None, lambda: [])
    dog.stopped.set()  # (judged here, not by its thread; the store's connection stays open)
    dog.thread.join()
    beats, stop, beaten = dist.PrefixStore("imagenet_ais/watchdog/t", server), threading.Event(), threading.Event()

    def beat() -> None:
        for n in range(10_000):
            for rank, (what, meeting, beating) in others.items():
                if beating or n == 0:
                    record = {"n": n, "what": what, "for": 9.0, "host": "h", "meeting": meeting, "ended": False}
                    beats.set(f"beat/{rank}", json.dumps(record))
            beaten.set()
            if stop.wait(0.05):
                return

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        # every rank has beaten before the judge looks (a silent rank is one whose count stood still:
        # its first beat within the judge's window was read as life, once in a CI run under load)
        assert beaten.wait(30)
        dog.now("training step 6")
        verdict = dog._judge(dog.doing)
    finally:
        stop.set()
        beating.join()
        dog.close()
    assert verdict is not None
    line = json.loads(verdict)["line"]
    assert line.startswith("ERROR: ranks did not meet at training step 6 within --collective-timeout 1 s: ")
    assert named in line and not_named not in line, line


def test_the_data_line_says_each_stores_bytes_requests_and_cache() -> None:
    remote = {"read_bytes": 156_000_000_000, "read_requests": 2204, "cache_bytes": 0, "reread_bytes": 0, "store_us": 9}
    cached = {"read_bytes": 0, "read_requests": 0, "cache_bytes": 154_000_000_000, "reread_bytes": 1_200_000_000}
    said = described({"s3://b/imagenet": remote, "/data/shards": {**cached, "store_us": 0}})
    assert said == (
        "s3://b/imagenet 156 GB in 2,204 requests; "
        "/data/shards 0 B, 154 GB from the node's cache, 1.2 GB read again after a failure"
    )


class Reading:
    """A loader that has read ``read_bytes`` from ais://b so far."""

    read_bytes = 0

    def reads(self) -> dict[str, dict[str, int]]:
        return {"ais://b": {"read_bytes": self.read_bytes, "read_requests": 1, "cache_bytes": 0, "reread_bytes": 0,
                            "store_us": 1}}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2])
def test_the_closing_data_line_counts_to_the_end_or_says_to_when(world: int) -> None:
    """At a checkpoint (step 10) the ranks' reads were gathered; the run fails at step 14, where no
    collective may run: one rank alone counts its own to the end, several say how far they counted."""
    loader = Reading()
    cost = DataCost([loader])  # type: ignore[list-item]
    loader.read_bytes = 2_000_000
    cost.run_totals(10)
    loader.read_bytes = 3_000_000
    said = cost.closing(world, 14)
    if world == 1:
        assert said == "ais://b 3 MB in 1 request" and cost.step == 14
    else:
        assert said == "ais://b 2 MB in 1 request by step 10 (the ranks' reads after it were not gathered)"


@pytest.mark.parametrize(("codes", "status"), [((6, 6), 6), ((6, 1), 1)], ids=["all lost", "one failed"])
def test_torchruns_wrapper_ends_as_its_ranks_where_they_said_why(codes: tuple, status: int, tmp_path: Path) -> None:
    """Ranks that all end with 6 (each said why in one line) end the torchrun wrapper with 6, and
    no ChildFailedError report; a rank that failed otherwise is reported as torchrun reports it."""
    script = tmp_path / "rank.py"
    script.write_text(f"import os, sys\nsys.exit({list(codes)}[int(os.environ['LOCAL_RANK'])])\n")
    torchrun = [sys.executable, "-m", "imagenet_ais.cli.torchrun", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert ("ChildFailedError" in done.stderr) == (status != EXIT_RANKS_LOST), done.stderr
