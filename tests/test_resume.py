"""Resuming an interrupted epoch on another topology: ranks in real processes (gloo on CPU).

Every check reads the keys each rank logged (``--log-keys``): a resumed run first cuts those
logs back to its checkpoint, so across both runs they hold exactly what was trained."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    TINY,
    descendants,
    free_port,
    shards_here,
    train_here,
    wait_until,
    write_hub_shards,
    write_shards,
)
from forked import ranks, start_ranks
from test_train import metrics

pytestmark = pytest.mark.slow  # runs of several ranks and their resumes: 5-60 s a test

TRAIN = [37, 81, 53, 99, 50]  # 320 samples in unequal shards
ALL_KEYS = {f"train-{s}-{i}" for s, n in enumerate(TRAIN) for i in range(n)}


def train_on(world: int, *options: str | Path) -> str:
    """train.py OPTIONS on ``world`` ranks (one: in this process, which is as good and spares a
    process); what it printed."""
    done = ranks(world, *options) if world > 1 else train_here(*options)
    return done.stdout + done.stderr


def args(data: Path, output: Path, batch: int, workers: int, mode: str = "exact") -> list[str]:
    return [
        *map(str, ["--data", data, "--output", output, *TINY, "--batch-size", batch, "--workers", workers]),
        *["--epochs", "2", "--epoch-mode", mode, "--log-keys", "--log-every", "1", "--resume", "auto"],
    ]


def keys(output: Path, epoch: int) -> dict[int, list[str]]:
    """Epoch ``epoch``'s keys (counted from 1, as the files are named) per rank."""
    files = sorted((output / "keys").glob(f"epoch{epoch:03d}-rank*.txt"))
    return {int(f.stem.rpartition("rank")[2]): f.read_text().split() for f in files}


def stop_mid_epoch(world: int, options: list[str], output: Path, stop: str, at: int) -> None:
    """Trains on ``world`` processes until step ``at`` of the first epoch: stopped by --max-steps,
    or by SIGTERM."""
    if stop == "max-steps":
        train_on(world, *options, "--max-steps", str(at))
        return
    started = start_ranks(world, *options)
    done = output / "metrics.jsonl"

    def trained() -> bool:
        return done.exists() and any(r["step"] >= at for r in metrics(output))

    wait_until(started[0], trained, f"step {at}", log=started[0].log)
    for rank in started:  # as torchrun forwards it: each rank saves, then exits
        rank.send_signal(signal.SIGTERM)
    assert [rank.wait(timeout=300) for rank in started] == [75] * world


Topology = tuple[int, int, int]  # (world, per-rank batch, workers per rank)


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Topology, str, str, Path], Path]:
    """A run stopped inside its first epoch on a topology, made once and copied to each test that
    goes on from it (a run of 4 ranks costs most of such a test); its shards' folder."""
    made: dict[tuple[Topology, str, str], tuple[Path, Path]] = {}

    def stopped(first: Topology, stop: str, made_by: str, output: Path) -> Path:
        if (first, stop, made_by) not in made:
            data, run = tmp_path_factory.mktemp("shards"), tmp_path_factory.mktemp("stopped")
            if made_by == "convert":
                write_shards(data, {"train": TRAIN, "val": [4]})
            else:
                write_hub_shards(data, {"train": TRAIN, "val": [4]})
                shards_here("index", data)
            world, batch, workers = first
            steps = len(ALL_KEYS) // (world * batch)
            stop_mid_epoch(world, args(data, run, batch, workers), run, stop, steps // 3)
            made[first, stop, made_by] = data, run
        data, run = made[first, stop, made_by]
        shutil.copytree(run, output)
        return data

    return stopped


ON_4_RANKS = pytest.mark.xdist_group("stopped-on-4-ranks")  # (in one process: they share its stopped run)


@pytest.mark.parametrize(
    ("first", "second", "stop", "made_by"),
    [
        pytest.param((4, 4, 2), (2, 4, 1), "sigterm", "convert", marks=ON_4_RANKS),
        pytest.param((4, 4, 2), (2, 8, 2), "sigterm", "convert", marks=ON_4_RANKS),
        ((2, 4, 1), (3, 3, 2), "max-steps", "convert"),
        ((1, 4, 2), (2, 4, 1), "max-steps", "convert"),
        ((2, 4, 2), (1, 8, 3), "max-steps", "convert"),
        ((1, 4, 2), (2, 4, 1), "max-steps", "index"),  # another tool's shards (the hub's layout), indexed
    ],
)
def test_an_exact_epoch_stopped_on_one_topology_ends_on_another_with_each_sample_once(
    first: Topology, second: Topology, stop: str, made_by: str, stopped_runs: Callable, tmp_path: Path
) -> None:
    output = tmp_path / "run"
    data = stopped_runs(first, stop, made_by, output)
    (world1, batch1, _), (world2, batch2, workers2) = first, second
    steps1, steps2 = len(ALL_KEYS) // (world1 * batch1), len(ALL_KEYS) // (world2 * batch2)
    stopped = torch.load(output / "last.pt", weights_only=True)
    k1 = stopped["step_in_epoch"]
    assert stopped["epoch"] == 0 and 0 < k1 < steps1, "saved inside the first epoch"

    out = train_on(world2, *args(data, output, batch2, workers2))
    assert f"epoch 1 stopped at step {k1} of {steps1} on {world1} × {batch1}" in out
    assert f"{k1 * world1 * batch1} samples trained are left out" in out
    interrupted = keys(output, 1)
    seen = Counter(k for ks in interrupted.values() for k in ks)
    assert max(seen.values()) == 1, "no sample of the interrupted epoch trained twice"
    assert len(ALL_KEYS - set(seen)) < world2 * batch2, "at most one global batch of the new topology sits out"
    k2 = (len(ALL_KEYS) - k1 * world1 * batch1) // (world2 * batch2)
    for rank, logged in interrupted.items():
        before, after = k1 * batch1 * (rank < world1), k2 * batch2 * (rank < world2)
        assert len(logged) == before + after, f"rank {rank}: every rank of each run ran the same steps"
    following = keys(output, 2)
    assert sorted(following) == list(range(world2)), "the next epoch follows the new topology"
    assert {len(k) for k in following.values()} == {steps2 * batch2}
    assert max(Counter(k for ks in following.values() for k in ks).values()) == 1
    end = torch.load(output / "last.pt", weights_only=True)
    assert (end["epoch"], end["step"]) == (2, k1 + k2 + steps2)
    steps = [r["step"] for r in metrics(output) if r["kind"] == "train"]
    assert steps == list(range(1, k1 + k2 + steps2 + 1)), "each step recorded once, in order"
    # what the reads cost, carried over the stop: both attempts' reads of epoch 1 in its record
    epochs = [r["read_bytes"] for r in metrics(output) if r["kind"] == "epoch"]
    run_before, run_after = (sum(c["read_bytes"] for c in s["data_cost"]["run"].values()) for s in (stopped, end))
    assert len(epochs) == 2 and sum(epochs) == run_after > run_before > 0, (epochs, run_before, run_after)
    # and at each attempt's end, in its closing record
    ends = [(r["status"], r["read_bytes"], "counted_to" in r) for r in metrics(output) if r["kind"] == "run"]
    assert ends == [("stopped", run_before, False), ("finished", run_after, False)], ends


def test_an_epoch_stopped_on_its_last_step_is_validated_then_the_next_follows_on_another_batch(tmp_path: Path) -> None:
    # stopped after its last step, before validation: the loader's state is the next epoch's start
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN, "val": [4]})
    steps = len(ALL_KEYS) // 8
    train_on(1, *args(data, output, 8, 1), "--max-steps", str(steps))
    stopped = torch.load(output / "last.pt", weights_only=True)
    assert (stopped["epoch"], stopped["step_in_epoch"]) == (0, steps)
    out = train_on(1, *args(data, output, 4, 1))
    assert "epoch 1: val top-1" in out and "samples trained are left out" not in out
    assert len(keys(output, 1)[0]) == steps * 8, "the first epoch trained once, not again"
    assert len(keys(output, 2)[0]) == len(ALL_KEYS) // 4 * 4, "the second whole, on 1 × 4"


def test_a_resampled_epoch_resumed_on_another_world_size_draws_fresh_streams_and_says_so(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN, "val": [4]})
    train_on(2, *args(data, output, 4, 1, "resampled"), "--max-steps", "12")
    before = keys(output, 1)
    out = train_on(1, *args(data, output, 4, 1, "resampled"))
    # 40 steps per epoch on 2 × 4, 80 on 1 × 4: 12 of 40 is step 24 of 80
    assert "epoch 1 stopped at step 12 of 40 on 2 × 4: resampled mode continues at step 24 of 80" in out
    assert "fresh stream" in out
    after = keys(output, 1)
    resumed = after[0][len(before[0]) :]
    assert len(resumed) == (80 - 24) * 4 and after[1] == before[1]
    assert resumed[:48] != before[0][:48], "the interrupted run's stream is not replayed"
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 12 + 56 + 80


def test_an_epoch_stopped_over_other_shards_starts_over_and_says_so(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN, "val": [4]})
    train_on(1, *args(data, output, 8, 1), "--max-steps", "5")
    write_shards(data, {"train": [*TRAIN, 16], "val": [4]})  # a shard added since
    out = train_on(1, *args(data, output, 8, 1), "--epochs", "1")
    said = "epoch 1 stopped at step 5 of 40 on 1 × 8 over other shards or with another seed (ShardLoader's seed=, "
    assert said + "train.py's --seed): it starts over" in out
    logged = keys(output, 1)[0]
    assert len(logged) == (5 + 42) * 8, "5 steps trained before, then the whole epoch"
    assert len(set(logged[40:])) == 42 * 8, "the epoch over the new shards, each key once"


def test_an_elastic_job_that_loses_its_rank_0_node_goes_on_alone_and_keeps_the_epoch_exact(tmp_path: Path) -> None:
    """Two agents of our torchrun (``--nnodes 1:2``, c10d rendezvous on loopback), one process
    each; the agent that is rank 0 is killed outright mid-epoch. The survivor's worker fails, its
    agent restarts it with world size 1, and the run continues from the last checkpoint. (With
    torchrun's own defaults the survivor, made rank 0, failed an assertion: seen where pids had
    wrapped, so that the second agent started was rank 0.)"""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": TRAIN, "val": [4]})
    # the rendezvous store is this process's, as a job's store is a head node's or etcd's: either agent can go
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic"]
    # a node is declared dead after 10 s without a heartbeat: with 2 s (1 × 2), a live agent whose
    # heartbeat ran late on a loaded 2-core machine was dropped too, and the run failed. The first
    # agent waits 15 s for the second to join: with 5 s, a second agent slow to import torch joined
    # a round already closed, and the restart that let it in failed
    timing = "is_host=false,last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=10"
    agent = [sys.executable, "-m", "imagenet_ais.cli.torchrun", "--nnodes", "1:2", "--nproc-per-node", "1"]
    agent += [*rendezvous, "--rdzv-conf", timing, "--max-restarts", "2", "--monitor-interval", "0.5"]
    agent += [str(ROOT / "train.py"), *args(data, output, 4, 1), "--checkpoint-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / "agent-a.log", tmp_path / "agent-b.log"]
    agents = []
    for log in logs:
        with log.open("w") as out:
            agents.append(subprocess.Popen(agent, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    done = output / "metrics.jsonl"
    wait_until(
        agents[0], lambda: done.exists() and any(r["step"] >= 12 for r in metrics(output)), "step 12", log=logs[0]
    )
    state = torch.load(output / "last.pt", weights_only=True)
    assert len(state["rng"]) == 2, "both agents trained together"
    lost = next(i for i, a in enumerate(agents) if _group_rank(a) == 0)
    survivor, log = agents[1 - lost], logs[1 - lost]
    for pid in {agents[lost].pid, *descendants(agents[lost].pid)}:  # its worker is in a session of its own
        os.kill(pid, signal.SIGKILL)
    agents[lost].wait()
    assert survivor.wait(timeout=300) == 0, log.read_text()[-20000:]
    del store
    end = torch.load(output / "last.pt", weights_only=True)
    assert (end["epoch"], len(end["rng"])) == (2, 1), "finished alone"
    assert "of 40 on 2 × 4: its" in (output / "train.log").read_text(), "the survivor said what it did"
    for epoch in (1, 2):
        seen = Counter(k for ks in keys(output, epoch).values() for k in ks)
        assert max(seen.values()) == 1, f"epoch {epoch}: no sample trained twice"
        assert len(ALL_KEYS - set(seen)) < 8, f"epoch {epoch}: at most one global batch sits out"


def _group_rank(agent: subprocess.Popen) -> int | None:
    """The rank of ``agent`` among the agents, from its worker's environment."""
    for pid in descendants(agent.pid):
        with contextlib.suppress(OSError):
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if entry.startswith(b"GROUP_RANK="):
                    return int(entry.partition(b"=")[2])
    return None


def test_a_run_stopped_on_an_epochs_last_step_resumes_at_the_next_epoch(tmp_path: Path) -> None:
    synthetic = ["--synthetic", *TINY, "--epochs", "2", "--output", str(tmp_path / "syn"), "--resume", "auto"]
    train_here(*synthetic, "--max-steps", "100")  # the whole first epoch (100 steps)
    train_here(*synthetic)
    assert torch.load(tmp_path / "syn" / "last.pt", weights_only=True)["step"] == 200, "no step trained twice"

    # exact mode, checkpoints uploaded: the epoch ends (validated) at the step it stopped at, and
    # that checkpoint, saved again under the same step, goes up in place of the first one
    data, output, uploaded = tmp_path / "shards", tmp_path / "run", tmp_path / "uploaded"
    write_shards(data, {"train": TRAIN, "val": [4]})
    common = [*args(data, output, 8, 1), "--upload", str(uploaded)]
    train_here(*common, "--max-steps", "40")  # 40 steps per epoch on 1 × 8
    assert torch.load(uploaded / "ckpt-00000040.pt", weights_only=True)["epoch"] == 0
    train_here(*common)  # exits 0: every upload made it
    assert torch.load(uploaded / "ckpt-00000040.pt", weights_only=True)["epoch"] == 1, "the validated state"
    assert json.loads((uploaded / "latest.json").read_text())["step"] == 80
