"""./run ray: Ray Train's TorchTrainer on a real local Ray cluster (ray start --head, 2 CPUs) with
token authentication, as Ray starts clusters by default since 2.59."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, descendants, free_port, run_cli, tiny_run_env, write_shards

# one Ray cluster on this machine at a time: these tests in one of ./run test's processes
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]

RAY = str(Path(sys.executable).parent / "ray")
# Ray Train's controller takes a worker's report at its poll, every 2 s by default, and the next
# report waits for it (a queue of one): at a record every 2 tiny steps, each step took 1 s
POLLED = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


def _train_steps(output: Path) -> list[int]:
    path = output / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _kill_a_worker_after(output: Path, step: int, killed: list[int]) -> None:
    """SIGKILL one Ray Train worker once the run has logged ``step`` (a lost worker, as a lost node)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (_train_steps(output) and _train_steps(output)[-1] >= step):
        time.sleep(0.2)
    pids = subprocess.run(["pgrep", "-f", "RayTrainWorker"], capture_output=True, text=True).stdout.split()
    if pids:
        os.kill(int(pids[0]), 9)
        killed.append(int(pids[0]))


def test_ray_with_token_auth_survives_a_lost_worker_and_leaves_the_cluster_running(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40, 56], "val": [6]})
    home = tmp_path / "home"  # no ~/.ray/auth_token: only the token this test hands over counts
    home.mkdir()
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    address = f"127.0.0.1:{free_port()}"
    base = {**os.environ, "HOME": str(home), **POLLED}  # (the cluster's processes take the environment of ray start)
    base.pop("RAY_AUTH_TOKEN", None)
    base.pop("RAY_AUTH_TOKEN_PATH", None)
    base.pop("RAY_AUTH_MODE", None)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=2", "--include-dashboard=false"]
    # ports of its own where Ray's defaults are fixed (10001, 8265, 52365): another suite's cluster may run beside
    head += [f"--{name}-port={free_port()}" for name in ("ray-client-server", "dashboard", "dashboard-agent-listen")]
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    subprocess.run([*head, f"--temp-dir={session}", "--disable-usage-stats"], check=True, env={**base, **auth})
    try:
        env = {**tiny_run_env(data, output), "HOME": str(home), "RAY_ADDRESS": address, "RAY_WORKERS": "2", **POLLED}
        env["TRAIN_EXTRA"] = "--log-every 2 --checkpoint-every 2 --epochs 2"

        # Without the token: one line saying what to set, nothing trained. Beside the run with the
        # token, in a thread: Ray takes ~20 s of retries to give up, mostly waiting.
        refused_env = {**env, "OUTPUT": str(tmp_path / "refused")}
        refusals: list[subprocess.CompletedProcess] = []
        refuser = threading.Thread(
            target=lambda: refusals.append(run_cli(ROOT / "run", "ray", env=refused_env, check=False))
        )
        refuser.start()

        # with the token file only (the driver turns token mode on); one worker is killed mid-run
        killed: list[int] = []
        killer = threading.Thread(target=_kill_a_worker_after, args=(output, 4, killed))
        killer.start()
        try:
            out = run_cli(ROOT / "run", "ray", env={**env, "RAY_AUTH_TOKEN_PATH": str(token)})
        finally:
            killer.join()
            refuser.join()
        (refused,) = refusals
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert "authentication" in lines[-1] and "RAY_AUTH_TOKEN_PATH" in lines[-1], refused.stderr
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()
        log = out.stdout + out.stderr
        assert killed, "no Ray Train worker was found to kill"

        steps = _train_steps(output)
        assert steps == list(range(2, 26, 2)), "2 ranks × 4 images, 96 images × 2 epochs, once each after the restart"
        state = torch.load(output / "last.pt", weights_only=True)
        assert (state["step"], len(state["rng"])) == (24, 2), "one DDP run of two workers, to the end"
        assert "resumed from" in log, "the restarted group continued from the last checkpoint"
        reported = set(re.findall(r"Reporting training result \d+: .*?'kind': '(\w+)'.*? from rank (\d)", log))
        assert reported >= {("train", "0"), ("train", "1"), ("val", "0"), ("val", "1")}, "every record, every rank"
        status = [RAY, "status", f"--address={address}"]
        alive = subprocess.run(status, capture_output=True, env={**base, **auth}).returncode == 0
        assert alive, "./run ray leaves a cluster it did not start running"
    finally:
        _stop(session)
        shutil.rmtree(session, ignore_errors=True)


def test_sigterm_to_run_ray_saves_exits_75_and_leaves_no_process(tmp_path: Path) -> None:
    # Python's default SIGTERM ended the driver at once: the workers, threads of Ray's actors that
    # cannot take signals, died with its private cluster, unsaved
    data, output, home = tmp_path / "shards", tmp_path / "run", tmp_path / "home"
    write_shards(data, {"train": [40, 56], "val": [6]})
    home.mkdir()
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # the private cluster's (RAY_TMPDIR)
    env = {**os.environ, **tiny_run_env(data, output), "HOME": str(home), "RAY_TMPDIR": session, "RAY_WORKERS": "2"}
    env |= POLLED  # (the driver starts the private cluster: its processes take this environment)
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(name, None)
    env.update(EPOCHS="100", TRAIN_EXTRA="--log-every 1")
    proc = subprocess.Popen([ROOT / "run", "ray"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while len(_train_steps(output)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "".join(proc.communicate())[-4000:]
        ours = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # ./run's PID: it execs the driver
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 75, err
        assert "stopped by a signal, checkpoint saved" in out, out
        state = torch.load(output / "last.pt", weights_only=True)
        assert 2 <= state["step"] < 100 * 12, "saved where the signal stopped it"
        assert not (output / ".ray-stop").exists(), "a continued run would stop at once"
        deadline = time.monotonic() + 30
        while (left := [pid for pid in ours if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        _stop(session)
        shutil.rmtree(session, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _stop(session: str) -> None:
    """This test's Ray cluster only (``ray stop --force`` stops every cluster of the machine:
    another suite's too): the processes that name its --temp-dir or hold files in it open (some
    rename themselves, and its agents do not keep the environment they were started with)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _ours(proc, session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def _ours(proc: Path, session: str) -> bool:
    try:
        if session.encode() in (proc / "cmdline").read_bytes():
            return True
        return any(os.readlink(fd).startswith(session) for fd in (proc / "fd").iterdir())
    except OSError:  # gone meanwhile, or not ours to look into
        return False
