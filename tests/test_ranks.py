"""What a run of several ranks tells about them: the rank that held the others back and why,
what the data cost per store, and a collective that some rank never reached, ended in one line
on every rank. Ranks are forked processes on gloo, each its own "node" (nothing kills the
others when one dies, as on NGC or Slurm across nodes)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, wait_until, write_shards
from forked import ranks, start_ranks

from imagenet_ais.errors import EXIT_RANKS_LOST

TRAIN, VAL = [8] * 6, [4, 4]  # 48 samples: 4 steps of 3 ranks × 4


def records(output: Path, kind: str) -> list[dict]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


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
    assert paces[2][f"{slow.url}/"] < 0.1 < min(paces[0][f"{fast.url}/"], paces[1][f"{fast.url}/"]), paces
    assert max(r["data_wait"] for r in epoch["ranks"][:2]) < epoch["ranks"][2]["data_wait"]

    # the data cost: every train and val shard read at least once, 2 requests (size, GET) a read
    cost = epoch["data"]
    assert set(cost) == {f"{fast.url}/", f"{slow.url}/"}
    listed = sum(s.bytes for split in ("train", "val") for s in manifest.splits[split].shards)
    assert epoch["read_bytes"] == sum(c["read_bytes"] for c in cost.values()) >= listed
    assert all(c["read_requests"] % 2 == 0 and c["read_requests"] >= 2 for c in cost.values()), cost
    assert all(c["cache_bytes"] == c["reread_bytes"] == 0 for c in cost.values())
    assert f"epoch 1 data: {fast.url}/ " in done.stdout and " requests; " in done.stdout
    state = torch.load(output / "last.pt", weights_only=True)
    assert {loc: c["read_bytes"] for loc, c in state["data_cost"].items()} == {
        loc: c["read_bytes"] for loc, c in cost.items()
    }, "the checkpoint carries the run's reads"
    assert "data: every sample was read as the manifest lists it; the run read " in done.stdout

    # each rank's figures in each window's record, and in TensorBoard under ranks/<name>/<rank>
    for window in records(output, "train"):
        assert len(window["ranks"]) == 3 and all("forward_ms_p50" in r and "read_mb_s" in r for r in window["ranks"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(output)).Reload().Tags()["scalars"]
    assert {"ranks/data_wait/0", "ranks/data_wait/1", "ranks/data_wait/2", "epoch/read_bytes"} <= set(tags), tags


@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_rank_that_never_arrives_ends_every_live_rank_in_one_line(how: signal.Signals, tmp_path: Path) -> None:
    """Rank 1 stopped (its connections open: the others would wait for gloo's 30 minutes) or
    killed (gloo's connections break) mid-epoch: every live rank ends with exit 6 within
    --collective-timeout, one line names rank 1 and what it was last doing, and the last
    checkpoint is whole."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN})
    started = start_ranks(
        3, "--data", data, "--output", output, *TINY, "--epochs", "50", "--workers", "1", "--log-every", "1",
        "--checkpoint-every", "3", "--collective-timeout", "5",
    )  # fmt: skip
    try:
        wait_until(
            started[0], lambda: "epoch 2/50 step 2/4" in started[0].log.read_text(), "mid-epoch", log=started[0].log
        )
        began = time.monotonic()
        os.kill(started[1].pid, how)
        codes = [started[r].wait(timeout=60) for r in (0, 2)]
        took = time.monotonic() - began
        if how == signal.SIGSTOP:  # continued, it finds the verdict and ends alike
            os.kill(started[1].pid, signal.SIGCONT)
            codes.append(started[1].wait(timeout=30))
    finally:
        for proc in started:
            proc.kill()
    assert codes == [EXIT_RANKS_LOST] * len(codes), codes
    assert took < 5 + 10, f"{took:.0f} s: bounded by --collective-timeout (and a few beats)"
    printed = "".join(out + (err or "") for out, err in (proc.communicate() for proc in started))
    (line,) = [line for line in printed.splitlines() if "did not meet" in line]
    assert line.startswith("ERROR: ranks did not meet at ") and "rank 1 (node " in line and "silent for" in line, line
    assert "last seen at training step" in line or "last seen at waiting for data" in line, line
    assert "rank 0 " not in line and "rank 2 " not in line, "the live ranks are not named"
    assert "continue with --resume auto" in line and "Traceback" not in printed, printed
    state = torch.load(output / "last.pt", weights_only=True)  # (whole: its digest is checked on resume)
    assert state["step"] >= 4 and not list(output.glob(".*")), list(output.iterdir())
