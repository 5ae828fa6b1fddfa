"""--tracker: MLflow (a real sqlite store) and W&B (offline, its own run files) fed by real runs,
stopped and resumed into the same tracker run."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY, TINY_ARCH, records, train_here, write_shards

from imagenet_ais.errors import ConfigError
from imagenet_ais.train.trackers import PER_RANK_TAGS, MLflow, TensorBoard, Wandb, numbers, open_trackers, runnable

# those that train twice and start their tracker (MLflow's import alone takes seconds)
SLOW = pytest.mark.slow


def run_twice(tmp_path: Path, env: dict[str, str], *trackers: str) -> Path:
    """A run stopped at step 3 (--max-steps), then resumed to its end (2 epochs of 6 steps)."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [12, 12], "val": [8]})
    args = ["--data", data, "--output", output, *TINY, "--workers", "0", "--epochs", "2", "--log-every", "2"]
    args += ["--resume", "auto", *(a for t in trackers for a in ("--tracker", t))]
    assert "stopped at step 3" in train_here(*args, "--max-steps", "3", env=env).stdout
    assert "resumed from" in train_here(*args, env=env).stdout
    return output


@SLOW
def test_mlflow_gets_the_settings_every_record_and_the_result_in_one_run_across_a_resume(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    # no MLFLOW_TRACKING_URI: the store goes in --output (it was ./mlflow.db, in the checkout's root)
    before = sorted(Path.cwd().iterdir())
    output = run_twice(tmp_path, {}, "mlflow")
    assert sorted(Path.cwd().iterdir()) == before, "nothing written where the run was started from"
    uri = f"sqlite:///{output / 'mlflow.db'}"
    ui = f"{runnable('mlflow')} ui --backend-store-uri {uri}"  # (its path where PATH has no mlflow)
    assert f"MLflow: runs in {uri} ({ui})" in (output / "train.log").read_text()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("imagenet-ais").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run", "one run, continued by the resume"
    assert run.data.params["arch"] == TINY_ARCH and run.data.params["epochs"] == "2"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in loss}) == [2, 3, 4, 6, 8, 10, 12], "every record, before and after the stop"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/top1")] == [6, 12]
    (final,) = client.get_metric_history(run.info.run_id, "final/top1")
    last = records(output, "val")[-1]
    assert final.value == pytest.approx(last["top1"]) and final.step == 12
    assert list(output.glob("events.out.tfevents.*")), "TensorBoard too, beside it"


def test_each_rank_has_its_own_tags_in_tensorboard_and_up_to_a_few_ranks_elsewhere() -> None:
    def record(world: int) -> dict:
        ranks = [{"data_wait": 0.05, "read_mb_s": 880.0, "node": "b07", "gpu_util": None} for _ in range(world)]
        ranks[5] |= {"data_wait": 0.38, "read_mb_s": 210.0}  # the slow one
        return {"kind": "train", "step": 40, "epoch": 1, "loss": 2.5, "ranks": ranks}

    for every_rank in (True, False):
        few = numbers(record(PER_RANK_TAGS), every_rank)
        assert few["ranks/data_wait/005"] == 0.38 and few["ranks/read_mb_s/015"] == 880.0 and few["train/loss"] == 2.5
        assert len([t for t in few if t.startswith("ranks/")]) == 2 * PER_RANK_TAGS, "numbers only, one tag each"
    tensorboard = numbers(record(512), every_rank=True)
    assert (
        tensorboard["ranks/data_wait/005"] == 0.38 and len([t for t in tensorboard if t.startswith("ranks/")]) == 1024
    )
    remote = {t: v for t, v in numbers(record(512), every_rank=False).items() if t.startswith("ranks/")}
    assert remote == {
        "ranks/data_wait/min": 0.05, "ranks/data_wait/median": 0.05, "ranks/data_wait/max": 0.38,
        "ranks/data_wait/min_rank": 0.0, "ranks/data_wait/max_rank": 5.0,
        "ranks/read_mb_s/min": 210.0, "ranks/read_mb_s/median": 880.0, "ranks/read_mb_s/max": 880.0,
        "ranks/read_mb_s/min_rank": 5.0, "ranks/read_mb_s/max_rank": 511.0,
    }  # fmt: skip
    alone = {**record(PER_RANK_TAGS), "ranks": [{"data_wait": 0.05}]}
    assert not [t for t in numbers(alone) if t.startswith("ranks/")], "one rank: train/* says it all"
    assert [t.every_rank for t in (TensorBoard, MLflow, Wandb)] == [True, False, False]


def wandb_records(run_file: Path) -> list:
    """The records of W&B's run file: a LevelDB-style log (32 KiB blocks; each piece a 7-byte
    header: CRC, length, type FULL/FIRST/MIDDLE/LAST) after W&B's own 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, records, pieces, at = run_file.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # a block's tail too short for a header is padding
            at += 32768 - at % 32768
            continue
        length, kind = struct.unpack("<HB", data[at + 4 : at + 7])
        pieces, at = pieces + data[at + 7 : at + 7 + length], at + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


@SLOW
def test_wandb_offline_gets_the_settings_every_record_and_the_result_in_one_run_across_a_resume(
    tmp_path: Path,
) -> None:
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    output = run_twice(tmp_path, env, "wandb")
    files = sorted((output / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1, "both attempts log to the same run id"
    history, config = [], {}
    for record in (r for f in files for r in wandb_records(f)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                            for item in record.history.item})  # fmt: skip
        elif kind == "run":  # the settings come with the run's record
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert config["arch"] == TINY_ARCH and config["epochs"] == 2
    steps = [h["_step"] for h in history if "train/loss" in h]
    assert steps[:2] == [2, 3] and steps[-1] == 12 and 6 in steps, steps
    assert [h["_step"] for h in history if "val/top1" in h] == [6, 12]
    assert list(output.glob("events.out.tfevents.*")), "TensorBoard stays on beside W&B (it was dropped silently)"


@SLOW
def test_a_tracker_that_cannot_start_is_one_line_before_anything_trains(tmp_path: Path) -> None:
    args = ["--synthetic", "--output", tmp_path / "run", *TINY, "--max-steps", "1", "--workers", "0"]
    bad = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # no server there
    proc = train_here(*args, "--tracker", "mlflow", env=bad, check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("Error: --tracker mlflow: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), "nothing left of the start"
    both = train_here(*args, "--tracker", "none", "--tracker", "mlflow", check=False)
    assert (
        both.returncode == 1
        and both.stderr.strip() == "Error: --tracker none with another tracker: give one or the other"
    )
    train_here(*args, "--tracker", "none")  # metrics.jsonl alone
    assert (tmp_path / "run" / "metrics.jsonl").exists() and not list((tmp_path / "run").glob("events.out.*"))


@SLOW
def test_a_tracker_server_that_never_answers_is_one_line_within_a_minute(tmp_path: Path) -> None:
    # it takes connections and answers none: MLflow's own 7 tries of 120 s each said nothing for minutes
    args = ["--synthetic", "--output", tmp_path / "run", *TINY, "--max-steps", "1", "--workers", "0"]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        start = time.monotonic()
        env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        proc = train_here(*args, "--tracker", "mlflow", env=env, check=False)
    assert time.monotonic() - start < 60
    assert proc.returncode == 1 and proc.stderr.startswith("Error: --tracker mlflow: "), proc.stderr
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ, "the bounds last only while the run does"


def test_a_tracker_not_installed_or_installed_but_broken_says_which(tmp_path: Path, monkeypatch) -> None:
    # an MLflow that was installed (1.27.0) and failed on an import of its own was "MLflow is not installed"
    (tmp_path / "site" / "mlflow").mkdir(parents=True)
    (tmp_path / "site" / "mlflow" / "__init__.py").write_text("import a_module_that_is_not_there\n")
    monkeypatch.syspath_prepend(tmp_path / "site")
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)
    broken = r"^--tracker mlflow: mlflow is installed but fails to import \(ModuleNotFoundError: No module named "
    with pytest.raises(ConfigError, match=broken + r"'a_module_that_is_not_there'\): reinstall it, \./run venv "):
        open_trackers(("mlflow",), tmp_path / "run", {}, 0, {})
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    missing = r"^--tracker wandb needs wandb, which is not installed: \./run venv --extra wandb \(pip: pip install -c "
    with pytest.raises(ConfigError, match=missing + r"requirements-dev\.lock '\.\[wandb\]'\)$"):
        open_trackers(("wandb",), tmp_path / "run", {}, 0, {})
    assert not (tmp_path / "run").exists()
