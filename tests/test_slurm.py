"""./run slurm against a real one-machine Slurm cluster (munged, slurmctld, slurmd from Debian's
packages, which ./run test installs as root): submit, warn before the time limit, checkpoint,
requeue, resume, finish."""

from __future__ import annotations

import getpass
import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli, tiny_run_env, write_shards

# one Slurm cluster on this machine at a time: these tests in one of ./run test's processes
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.slow]

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "mungekey")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def low_free_port() -> int:
    """A free port below the ephemeral range, as a rendezvous port should be: srun listens on
    ephemeral ports, and one could take a port picked there before torchrun binds it."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def wait_for(ready, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f}s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment for Slurm's clients to reach a cluster of this machine alone."""
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        message = f"{', '.join(missing)} not installed: ./run test installs Slurm from Debian when run as root"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    root = tmp_path_factory.mktemp("slurm")
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'key'}"], check=True)
    socket_path = munge / "socket"
    files = {"key-file": "key", "pid-file": "pid", "log-file": "log", "seed-file": "seed"}
    options = [f"--{option}={munge / name}" for option, name in files.items()]
    subprocess.run(["munged", *options, f"--socket={socket_path}", "--force"], check=True)
    node, user = socket.gethostname().split(".")[0], getpass.getuser()
    conf = root / "slurm.conf"
    # cred_expire: how long a requeued job waits before it starts again (default 120 s)
    conf.write_text(
        f"""ClusterName=test
SlurmctldHost={node}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={socket_path},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort={low_free_port()}
SlurmdPort={low_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={node} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {"SLURM_CONF": str(conf)}
    full = {**os.environ, **env}
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], check=True, env=full)

    def idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=full).stdout
        return out.strip() == "idle"

    try:
        wait_for(idle, "the Slurm node to come up")
        yield env
    finally:
        for pid_file in (root / "slurmd.pid", root / "slurmctld.pid", munge / "pid"):
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def job_state(job: str, env: dict[str, str]) -> dict[str, str]:
    out = run_cli("scontrol", "show", "job", job, "-o", env=env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def test_a_job_warned_before_its_time_limit_checkpoints_requeues_and_finishes(slurm: dict, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [20, 28], "val": [6]})
    env = {**slurm, **tiny_run_env(data, output), "EPOCHS": "3", "NPROC": "1", "RDZV_PORT": str(low_free_port())}
    env |= {"SLURM_CPUS": str(os.cpu_count()), "SLURM_GPUS": "0"}  # the node has no GPUs
    env["TRAIN_EXTRA"] = "--log-every 1 --epoch-mode exact"  # 12 steps an epoch
    submitted = run_cli(ROOT / "run", "slurm", env=env).stdout
    job = re.search(r"Submitted batch job (\d+)", submitted).group(1)
    log = output / f"slurm-{job}.out"

    # What Slurm does SLURM_WARN seconds before the limit (--signal B:USR1@...), sent now.
    wait_for(lambda: (output / "metrics.jsonl").exists(), "the first training step", timeout=300)
    run_cli("scancel", "--batch", "--signal", "USR1", job, env=slurm)
    wait_for(lambda: job_state(job, slurm)["JobState"] in ENDED, "the requeued job to end", timeout=300)

    text = log.read_text()
    assert job_state(job, slurm)["JobState"] == "COMPLETED", text[-3000:]
    assert "checkpointing, then requeueing" in text and "(restart 1)" in text
    # the ranks' stop after saving (75) is no failure: torchrun told it as a ChildFailedError's traceback
    assert "Traceback" not in text and "ChildFailedError" not in text and "exitcode" not in text, text[-3000:]
    assert job_state(job, slurm)["Restarts"] == "1"
    assert job_state(job, slurm)["NumCPUs"] == str(os.cpu_count()), "the job asked for SLURM_CPUS"
    train_log = (output / "train.log").read_text()
    assert "stopped by a signal" in train_log and "resumed from" in train_log
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(1, 37)), "the requeued run went on from the checkpointed step"
    assert torch.load(output / "last.pt", weights_only=True)["epoch"] == 3


def stand_in(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / name).chmod(0o755)


def test_a_submission_refused_at_once_leaves_no_run_folder(tmp_path: Path) -> None:
    # ./run slurm made runs/slurm for the job's log, and left it where sbatch failed
    write_shards(tmp_path / "shards", {"train": [8]})
    stand_in(tmp_path / "bin", "sbatch", 'echo "sbatch: error: Invalid account or account/partition" >&2; exit 1')
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "DATA": str(tmp_path / "shards")}
    new, kept = tmp_path / "runs" / "slurm", tmp_path / "kept"
    kept.mkdir()
    for output in (new, kept):
        proc = run_cli(ROOT / "run", "slurm", env={**env, "OUTPUT": str(output)}, check=False)
        assert proc.returncode == 1 and "Invalid account" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists(), "the folders it made are gone"
    assert kept.is_dir(), "the one that was there stays"
