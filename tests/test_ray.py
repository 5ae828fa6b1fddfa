"""./run ray: Ray Train's TorchTrainer on a real local Ray cluster (ray start --head, 2 CPUs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from conftest import ROOT, free_port, run_cli, tiny_run_env, write_shards

RAY = str(Path(sys.executable).parent / "ray")


def test_ray_trains_two_workers_on_a_running_cluster_and_leaves_it_running(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [20, 28], "val": [6]})
    address = f"127.0.0.1:{free_port()}"
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=2", "--include-dashboard=false"]
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    auth = {"RAY_AUTH_MODE": "token"}  # head and driver share the token in ~/.ray (made if missing)
    subprocess.run([*head, f"--temp-dir={session}", "--disable-usage-stats"], check=True, env={**os.environ, **auth})
    try:
        env = {**tiny_run_env(data, output), **auth, "RAY_ADDRESS": address, "RAY_WORKERS": "2"}
        env["TRAIN_EXTRA"] = "--log-every 2"
        out = run_cli(ROOT / "run", "ray", env=env)
        log = out.stdout + out.stderr

        records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6], "2 ranks × 4 images, 48 images"
        assert [r["samples"] for r in records if r["kind"] == "val"] == [6]
        state = torch.load(output / "last.pt", weights_only=True)
        assert (state["step"], len(state["rng"])) == (6, 2), "one DDP run of two workers"
        reported = set(re.findall(r"Reporting training result \d+: .*?'kind': '(\w+)'.*? from rank (\d)", log))
        assert reported == {("train", "0"), ("train", "1"), ("val", "0"), ("val", "1")}, "every record, every rank"
        status = [RAY, "status", f"--address={address}"]
        alive = subprocess.run(status, capture_output=True, env={**os.environ, **auth}).returncode == 0
        assert alive, "./run ray leaves a cluster it did not start running"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)  # this machine runs no other Ray
        shutil.rmtree(session, ignore_errors=True)
