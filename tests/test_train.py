"""train.py end to end: real torch training on tiny shards, DDP over gloo on real ranks, resume."""

from __future__ import annotations

import copy
import dataclasses
import errno
import gc
import http.server
import itertools
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import torchvision
import webdataset as wds
from conftest import (
    ROOT,
    TINY,
    TINY_ARCH,
    UNSIZED,
    child_pids,
    here,
    outliving,
    relist,
    run_cli,
    shards_here,
    tiny_jpeg,
    train_here,
    wait_until,
    write_shards,
)
from forked import Started, ranks
from torch.utils.tensorboard import SummaryWriter

from imagenet_ais import distributed
from imagenet_ais.cli import plot
from imagenet_ais.cli import train as train_cli
from imagenet_ais.errors import EXIT_BAD_DATA, EXIT_DIVERGED, EXIT_PREEMPTED, ConfigError, DataError
from imagenet_ais.shards import synth
from imagenet_ais.shards.manifest import MIN_SAMPLE_BYTES
from imagenet_ais.storage import locks
from imagenet_ais.train import checkpoint, config, loop, model, resume, setup
from imagenet_ais.train.data_health import DataHealth

UNEVEN = [3, 11, 7, 19, 8]  # 48 training samples in 5 unequal shards: 6 steps at 2 ranks × 4


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["exact", "resampled"])
def test_ddp_two_ranks_uneven_shards(mode: str, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN, "val": [5, 2, 6]})
    ranks(
        2,
        "--data",
        data,
        "--output",
        output,
        *TINY,
        "--epochs",
        "2",
        "--workers",
        "2",
        "--epoch-mode",
        mode,
        "--log-keys",
        "--log-every",
        "2",
    )

    all_keys = {f"train-{s}-{i}" for s, n in enumerate(UNEVEN) for i in range(n)}
    for epoch in (1, 2):
        per_rank = [(output / "keys" / f"epoch{epoch:03d}-rank{r}.txt").read_text().split() for r in range(2)]
        assert [len(k) for k in per_rank] == [6 * 4, 6 * 4], "both ranks run the same number of full steps"
        if mode == "exact":
            seen = Counter(per_rank[0] + per_rank[1])
            assert set(seen) == all_keys and set(seen.values()) == {1}, "each key exactly once per epoch"
        else:
            assert set(per_rank[0] + per_rank[1]) <= all_keys
    records = metrics(output)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert all(r["skipped"] == 0 and 0 <= r["data_wait"] <= 1 and r["img_per_s"] > 0 for r in train)
    for r in train:  # each rank's own step times, data wait and feed threads, beside rank 0's summary
        assert len(r["ranks"]) == 2 and r["ranks"][0]["data_wait"] == round(r["data_wait"], 3)
        for rank in r["ranks"]:
            # (a bound on the times, not a speed: a rank's first step may take half a second under load)
            assert 0 < rank["step_ms_p50"] <= rank["step_ms_p90"] < 60_000, "milliseconds"
            assert 0 <= rank["data_wait"] <= 1 and 0 <= rank["busy_host"] <= 1 and 0 <= rank["busy_copy"] <= 1
    val = [r for r in records if r["kind"] == "val"]
    assert [(r["epoch"], r["samples"]) for r in val] == [(1, 13), (2, 13)], "every val image counted once"
    state = torch.load(output / "last.pt", weights_only=True)
    assert (state["epoch"], state["step"], len(state["rng"])) == (2, 12, 2)


def _batchnorm_rank(rank: int, store: Path, out: Path) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    raw = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    process = distributed.Process(rank, 2, rank, torch.device("cpu"))
    cfg = config.TrainConfig(compile=False)
    ddp = model.wrap(raw, cfg, process, False, False, None, lambda step: 1.0, None)  # rank 0's weights on both
    alone = copy.deepcopy(raw)  # the same model stepping on this rank's batches by itself
    for step in range(2):
        batch = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + step)) + rank
        ddp(batch)
        alone(batch)
    before = raw[1].running_mean.clone()
    distributed.broadcast_buffers(raw)
    torch.save({"before": before, "alone": alone[1].running_mean, "after": raw[1].running_mean}, out / f"rank{rank}.pt")
    # DDP's reducer must not drop the last reference to the gloo group: it would join gloo's
    # threads holding the GIL, which a thread still freeing a finished broadcast waits for
    del ddp
    torch.distributed.destroy_process_group()


def test_each_rank_keeps_its_own_batchnorm_statistics_until_rank_0s_are_broadcast(tmp_path: Path) -> None:
    # A broadcast of rank 0's buffers before every forward (DDP's default) made each step wait for
    # the latest rank's host; they are broadcast before validation instead (loop.validate_epoch).
    # spawned: a forked child of a process that has run OpenMP work can hang in its first one
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_batchnorm_rank, args=(r, tmp_path / "store", tmp_path)) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    for p in ranks:
        p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for rank in (zero, one):  # no broadcast before a forward: each rank's statistics are of its own batches
        assert torch.equal(rank["before"], rank["alone"])
    assert not torch.equal(zero["before"], one["before"])
    assert torch.equal(one["after"], zero["before"]) and torch.equal(zero["after"], zero["before"])


@pytest.mark.slow
def test_decentralized_ranks_drift_apart_and_agree_after_each_global_average(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN, "val": [5, 2, 6]})
    args = ["--data", data, "--output", output, *TINY, "--workers", "1", "--log-every", "2", "--resume", "auto"]
    ranks(2, *args, "--epochs", "2", "--dp", "decent", "--topology", "ring")

    records = metrics(output)
    val = [r for r in records if r["kind"] == "val"]
    assert [(r["epoch"], r["samples"]) for r in val] == [(1, 13), (2, 13)]
    assert all(r["distance"] > 0 for r in val), "each rank trained its own model between averages"
    assert all(r["spread"] == 0 for r in val), "after the global average every rank holds the same model"
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    cosine = [0.1 * 8 / 256 * 0.5 * (1 + math.cos(math.pi * k / 12)) for k in (2, 4, 6, 8, 10, 12)]
    assert [r["lr"] for r in train] == pytest.approx(cosine) and all(math.isfinite(r["loss"]) for r in train)
    state = torch.load(output / "last.pt", weights_only=True)
    assert (state["step"], state["optimizer"]) == (12, None), "no momentum in the checkpoint: it is per rank"

    more = ranks(2, *args, "--epochs", "3", "--dp", "decent", "--topology", "one-peer-exp")
    assert "resumed from" in more.stdout and "momentum starts afresh" in more.stdout
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 18
    assert [r["spread"] for r in metrics(output) if r["kind"] == "val"] == [0, 0, 0]

    one_node = ranks(2, *args, "--epochs", "4", "--dp", "decent", "--topology", "alternating-exp-ring", check=False)
    assert one_node.returncode != 0
    assert "Error: --topology alternating-exp-ring cannot connect 2 processes" in one_node.stderr


def test_stopped_run_resumes_at_the_right_step(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN, "val": [6]})
    args = [
        "--data",
        data,
        "--output",
        output,
        *TINY,
        "--epochs",
        "3",
        "--workers",
        "1",
        "--epoch-mode",
        "exact",
        "--log-every",
        "1",
        "--resume",
        "auto",
    ]
    first = train_here(*args, "--max-steps", "17")  # 12 steps per epoch: stops inside epoch 2
    assert "stopped at step 17" in first.stdout
    state = torch.load(output / "last.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["step_in_epoch"]) == (1, 17, 5)

    second = train_here(*args)
    assert "resumed from" in second.stdout and "epoch 2, step 17" in second.stdout
    train = [r for r in metrics(output) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 37)), "no step repeated or skipped across the restart"
    cosine = [0.1 * 4 / 256 * 0.5 * (1 + math.cos(math.pi * k / 36)) for k in range(36)]  # each step's own
    assert [r["lr"] for r in train] == pytest.approx(cosine), "the schedule continues across the restart"
    assert [r["epoch"] for r in metrics(output) if r["kind"] == "val"] == [1, 2, 3]
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 36

    third = train_here(*args)  # nothing left to do, and it says so (it said "epoch 4" first)
    assert "3 epochs trained, as many as --epochs 3 asks or more, step 36" in third.stdout
    assert "its run has trained 3 epochs, --epochs 3 asks no more: give more --epochs" in third.stdout
    fewer = train_here(*args, "--epochs", "2")  # it said "complete (3/2)", then "already trained 2 epochs"
    assert "3 epochs trained, as many as --epochs 2 asks or more" in fewer.stdout
    assert "its run has trained 3 epochs, --epochs 2 asks no more" in fewer.stdout

    # only --epochs (and --lr) given: every other setting is the checkpoint's (it went to batch
    # 256, 224 px, resnet50), the one given that differs is said, and so is the schedule's change
    more = train_here("--output", output, "--resume", "auto", "--epochs", "4", "--lr", "0.2", "--max-steps", "37")
    settings = json.loads((output / "config.json").read_text())
    assert (settings["arch"], settings["batch_size"], settings["image_size"]) == (TINY_ARCH, 4, 32)
    assert (settings["data"], settings["epoch_mode"], settings["warmup_epochs"]) == (str(data), "exact", 0)
    assert "goes on with the settings it was trained with, but --lr 0.2 (its run: 0.1), as given" in more.stdout
    # the 3-epoch cosine had ended at 0; over 4 epochs step 37 is a quarter of the way down from 0.2's peak
    peak = 0.2 * 4 / 256
    lr = f"{peak * 0.5 * (1 + math.cos(math.pi * 36 / 48)):.3g}"
    assert f"cosine schedule now spans 4 epochs, so the next step's learning rate is {lr} (0 in its 3)" in more.stdout
    assert [r["lr"] for r in metrics(output) if r["kind"] == "train"][-1] == pytest.approx(float(lr), rel=1e-2)


@pytest.mark.slow
def test_epoch_size_sets_the_epochs_that_the_schedule_checkpoints_and_resume_count_in(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN, "val": [6]})
    cfg = loop.TrainConfig(
        data=str(data), output=str(output), arch=TINY_ARCH, image_size=32, batch_size=4, warmup_epochs=0,
        epochs=3, workers=0, epoch_size=20, log_every=1, resume="auto",
    )  # fmt: skip
    loop.train(dataclasses.replace(cfg, max_steps=7))  # 5 steps an epoch (the manifest's 48 would make 12)
    state = torch.load(output / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["steps_per_epoch"]) == (1, 2, 5)
    assert loop.train(cfg)["complete"]
    train = [r for r in metrics(output) if r["kind"] == "train"]
    assert [(r["epoch"], r["step"]) for r in train] == [(k // 5 + 1, k + 1) for k in range(15)]
    cosine = [0.1 * 4 / 256 * 0.5 * (1 + math.cos(math.pi * k / 15)) for k in range(15)]
    assert [r["lr"] for r in train] == pytest.approx(cosine), "the schedule runs over 3 epochs of 5 steps"
    assert [r["epoch"] for r in metrics(output) if r["kind"] == "val"] == [1, 2, 3]

    capsys.readouterr()
    loop.train(dataclasses.replace(cfg, epochs=4, epoch_size=40))
    said = capsys.readouterr().out
    assert "trained epochs of 20 samples, this run's are 40 samples (--epoch-size)" in said
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 15 + 10


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_epoch(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN, "val": [6]})
    args = ["--data", data, "--output", output, *TINY, "--epochs", "4", "--workers", "1", "--resume", "auto"]
    proc = Started(*args, new_session=True)
    wait_until(proc, (output / "last.pt").exists, "a first checkpoint", log=proc.log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = torch.load(output / "last.pt", weights_only=True)
    assert done["step"] == done["epoch"] * 12 and done["epoch"] >= 1

    second = train_here(*args)
    assert f"epoch {done['epoch'] + 1}, step {done['step']}" in second.stdout
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 48
    assert not list(output.glob(".*")), "no half-written checkpoint left behind"


def test_a_resume_that_names_one_of_a_pair_of_settings_takes_neither_from_the_checkpoint() -> None:
    # --data names the mixture too (one option), and --image-size excludes a --progressive: taken
    # from the checkpoint, its mixture or growing sizes would have overridden what was named
    saved = config.TrainConfig(data="a", mix=("a", "b:2"), progressive="64:128", epochs=9)
    found = (Path("last.pt"), {"config": dataclasses.asdict(saved)})
    named = config.TrainConfig(data="c", image_size=96, sources={"data": "option", "image_size": "option"})
    cfg = resume.with_settings_of(named, found, lambda *a, **k: None)
    assert (cfg.data, cfg.mix, cfg.image_size, cfg.progressive, cfg.epochs) == ("c", (), 96, None, 9)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [8]})
    train_here("--data", data, "--output", output, *TINY, "--epochs", "1", "--workers", "0")
    proc = train_here(
        "--data",
        data,
        "--output",
        output,
        *TINY[2:],
        "--arch",
        "mobilenet_v3_small",
        "--epochs",
        "2",
        "--workers",
        "0",
        "--resume",
        "auto",
        check=False,
    )
    assert proc.returncode == 1 and f"was trained as {TINY_ARCH}" in proc.stderr
    # says what to do (it said "use another --output or --resume": resume what?)
    assert "give another --output for a new run (or --resume a checkpoint of this model)" in proc.stderr
    # the refused start leaves the run's own settings (it wrote "arch": "mobilenet_v3_small" there)
    assert json.loads((output / "config.json").read_text())["arch"] == TINY_ARCH


def test_a_mixture_with_one_of_its_shard_sets_swapped_is_other_data(tmp_path: Path) -> None:
    # only the first --data was compared: the same first set, another second, went on as "changed"
    first, second, swapped, output = (tmp_path / name for name in ("first", "second", "swapped", "run"))
    write_shards(first, {"train": [8], "val": [4]})
    write_shards(second, {"train": [8]}, prefix="second-")
    write_shards(swapped, {"train": [12]}, prefix="swapped-")  # the same classes, other shards
    loop.train(tiny_run(first, output, workers=0, mix=(str(first), f"{second}:2")))
    loop.train(tiny_run(first, output, workers=0, mix=(str(first), f"{second}:1"), resume="auto", epochs=2))
    refused = f"was trained on other shards ({first} {second}) than --data {first} {swapped}"
    with pytest.raises(DataError, match=re.escape(refused)):
        loop.train(tiny_run(first, output, workers=0, mix=(str(first), str(swapped)), resume="auto", epochs=3))
    assert [r["epoch"] for r in metrics(output) if r["kind"] == "val"] == [1, 2], "other weights: the same data"


def test_a_checkpoint_made_on_other_shards_goes_on_only_where_resume_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # docs/storage.md's playground step after ./run local1: "resumed ... already trained", on other data, without a word
    shards, moved, other, output = (tmp_path / name for name in ("shards", "moved", "other", "run"))
    write_shards(shards, {"train": [8], "val": [4]})
    write_shards(other, {"train": [12], "val": [4]})  # the same classes, other shards
    shutil.copytree(shards, moved)
    loop.train(tiny_run(shards, output, workers=0))
    capsys.readouterr()
    loop.train(tiny_run(moved, output, workers=0, resume="auto", epochs=2))  # a copy, a preload: goes on
    assert (
        f"was trained on the same shards (names, SHA-256s) at {shards}; going on from {moved}"
        in capsys.readouterr().out
    )
    with pytest.raises(DataError, match=re.escape(f"was trained on other shards ({moved}) than --data {other}")) as e:
        loop.train(tiny_run(other, output, workers=0, resume="auto", epochs=3))
    assert "\n" not in str(e.value) and f"--resume {output / 'last.pt'}" in str(e.value)
    assert [r["epoch"] for r in metrics(output) if r["kind"] == "val"] == [1, 2], "nothing trained on refusal"
    loop.train(tiny_run(other, output, workers=0, resume=str(output / "last.pt"), epochs=3))
    assert "going on from it, as --resume names it" in capsys.readouterr().err
    write_shards(other, {"train": [12, 4], "val": [4]})  # a shard added where the run's data is
    loop.train(tiny_run(other, output, workers=0, resume="auto", epochs=4))
    assert (
        f"warning: the shards at {other} changed since {output / 'last.pt'} was trained on them"
        in capsys.readouterr().err
    )
    assert [r["epoch"] for r in metrics(output) if r["kind"] == "val"] == [1, 2, 3, 4]


def test_bad_inputs_get_one_line_errors(tmp_path: Path) -> None:
    proc = train_here("--data", tmp_path, "--output", tmp_path / "o", check=False)
    assert proc.returncode == 1 and f"no manifest.json in {tmp_path}" in proc.stderr
    write_shards(tmp_path, {"train": [8]})
    proc = train_here("--data", tmp_path, "--output", tmp_path / "o", "--arch", "resnet5000", check=False)
    assert proc.returncode == 1 and "'resnet5000' is not a torchvision classification model" in proc.stderr
    proc = train_here(
        "--data",
        tmp_path,
        "--output",
        tmp_path / "o",
        "--epoch-mode",
        "exact",
        "--batch-size",
        "16",
        check=False,
    )
    assert proc.returncode == 1 and "fewer than one global batch" in proc.stderr
    proc = train_here("--data", tmp_path, "--output", tmp_path / "o", "--progressive", "224:128", check=False)
    assert proc.returncode == 1 and "--progressive '224:128': give START:END" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    afile, picture = tmp_path / "afile", tmp_path / "tree" / "train" / "c0" / "a.jpg"
    afile.write_text("mine\n")
    picture.parent.mkdir(parents=True)
    picture.write_bytes(tiny_jpeg(random.Random(0), 0))
    convert = ["imagenet_shards.py", "convert", "--splits", "train", tmp_path / "tree"]
    for cli in (["train.py", "--data", tmp_path, "--output"], convert):
        proc = run_cli(*cli, afile, check=False)
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"Error: {afile}: a file is there or on the way to it, not a folder: name a folder"
        )
    assert afile.read_text() == "mine\n"


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_training_learns_the_synthetic_classes(decode: str, tmp_path: Path) -> None:
    tree, data, output = tmp_path / "tree", tmp_path / "shards", tmp_path / "run"
    synth.make_tree(tree, classes=4, train_per_class=48, val_per_class=12, seed=3)
    shards_here("convert", tree, data, "--maxcount", "40", "--workers", "2")
    out = train_here(
        "--data",
        data,
        "--output",
        output,
        "--arch",
        "resnet18",
        "--image-size",
        "48",
        "--batch-size",
        "16",
        "--lr",
        "0.4",
        "--warmup-epochs",
        "1",
        "--epochs",
        "5",
        "--workers",
        "2",
        "--decode",
        decode,
    )
    final = [r for r in metrics(output) if r["kind"] == "val"][-1]
    assert final["samples"] == 48
    assert final["top1"] >= 3 * 25, out.stdout  # chance is 25%
    assert "final validation top-1" in out.stdout
    assert (output / "best.pt").exists()


def test_synthetic_mode_trains_without_data(tmp_path: Path) -> None:
    out = train_here("--synthetic", "--output", tmp_path, *TINY, "--epochs", "1", "--max-steps", "3")
    assert "stopped at step 3" in out.stdout
    assert [r["step"] for r in metrics(tmp_path) if r["kind"] == "train"][-1] == 3


def test_step_checkpoints_are_pruned_to_keep_last(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN})
    train_here(
        "--data",
        data,
        "--output",
        output,
        *TINY,
        "--epochs",
        "2",
        "--workers",
        "1",
        "--checkpoint-every",
        "5",
        "--keep-last",
        "2",
    )
    # steps 5, 10, 12 (epoch end), 15, 20, 24 (epoch end): the newest two stay
    assert sorted(p.name for p in output.glob("ckpt-*.pt")) == ["ckpt-00000020.pt", "ckpt-00000024.pt"]
    assert (output / "last.pt").samefile(output / "ckpt-00000024.pt")
    state = torch.load(output / "ckpt-00000020.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (1, 8)


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_both_ranks_mid_epoch_and_resumes(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40, 40, 48], "val": [4]})  # 16 steps per epoch at 2 ranks × 4
    args = [
        "--data",
        data,
        "--output",
        output,
        *TINY,
        "--image-size",
        "48",
        "--epochs",
        "2",
        "--workers",
        "1",
        "--epoch-mode",
        "exact",
        "--log-keys",
        "--log-every",
        "1",
        "--resume",
        "auto",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", ROOT / "train.py"]
    proc = subprocess.Popen(
        [*map(str, cmd), *map(str, args)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        proc, lambda: (output / "metrics.jsonl").exists() and any(r["step"] >= 19 for r in metrics(output)), "step 19"
    )
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    proc.wait(timeout=300)
    state = torch.load(output / "last.pt", weights_only=True)
    assert state["epoch"] == 1 and 0 < state["step_in_epoch"] < 16, "saved inside the second epoch"
    assert sum(map(len, state["data"]["position"]["delivered"].values())) == state["step_in_epoch"] * 8

    ranks(2, *args)
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 32
    seen = [k for r in range(2) for k in (output / "keys" / f"epoch002-rank{r}.txt").read_text().split()]
    assert len(seen) == len(set(seen)) == 128, "the interrupted epoch: every key once across the restart"


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_progressive_resizing_follows_its_schedule(decode: str, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [16, 16], "val": [6]})
    train_here(
        "--data",
        data,
        "--output",
        output,
        *UNSIZED,
        "--epochs",
        "3",
        "--progressive",
        "32:96",
        "--val-size",
        "64",
        "--workers",
        "1",
        "--decode",
        decode,
        "--log-every",
        "2",
        *(["--cpu-share", "0.5"] if decode == "gpu" else []),  # half of them cropped by the worker, at each size
    )
    records = metrics(output)
    # the sizes of the batches actually trained on, per epoch, and of the validation batches
    train = {(r["epoch"], r["image_size"]) for r in records if r["kind"] == "train"}
    assert train == {(1, 32), (2, 64), (3, 96)}
    assert [(r["image_size"], r["samples"]) for r in records if r["kind"] == "val"] == [(64, 6)] * 3
    if decode == "gpu":
        assert "gpu decode, 1 worker per process cropping 50% of the samples" in (output / "train.log").read_text()
        assert [r for r in records if r["kind"] == "train"][-1]["cropped"] >= 3 * 32 // 2 - 2


def test_a_run_shows_in_tensorboard_and_plots_to_a_png(tmp_path: Path) -> None:
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, output, up = tmp_path / "shards", tmp_path / "run", tmp_path / "up"
    write_shards(data, {"train": [16, 8], "val": [6]})  # 4 classes: top-5 is 100% whatever the model
    args = ["--data", data, "--output", output, *TINY, "--epochs", "2", "--workers", "1", "--log-every", "2"]
    no_venv_on_path = {"PATH": str(tmp_path / "no-bin")}
    said = train_here(*args, "--upload", up, env=no_venv_on_path).stdout.splitlines()
    records = metrics(output)

    # the hint names a command that runs (tensorboard is in the venv's bin, not on PATH)
    tensorboard = Path(sys.executable).parent / "tensorboard"
    assert f"TensorBoard: event files in {output} ({tensorboard} --logdir {output})" in said
    # the last line says where the checkpoints are
    saved = ", ".join(name for name in ("last.pt", "best.pt") if (output / name).is_file())
    assert said[-1] == f"checkpoints in {output}: {saved}; uploaded to {up} (its latest.json names the last)"
    # no top-5 of 4 classes: not said, recorded, tracked or plotted
    assert not [line for line in said if "top-5" in line]
    assert not [r for r in records if "top5" in r]
    board = EventAccumulator(str(output))
    board.Reload()
    assert {"train/loss", "train/lr", "train/img_per_s", "train/data_wait", "val/top1"} <= set(board.Tags()["scalars"])
    assert "val/top5" not in board.Tags()["scalars"]
    logged = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [(e.step, round(e.value, 4)) for e in board.Scalars("train/loss")] == [(s, round(v, 4)) for s, v in logged]

    out = here(plot.main, output).stdout.strip()
    assert out == str(output / "metrics.png")
    with Image.open(output / "metrics.png") as png:
        assert png.format == "PNG" and png.size == (1500, 680)  # 2 rows of 3 panels (no GPU panel on CPU)
        assert len(png.convert("RGB").getcolors(1 << 16) or []) > 50  # drawn, not blank
    assert not list(output.glob(".*.tmp"))

    # one log interval: one record per panel, drawn as a point (a line of one point drew nothing)
    lines = (output / "metrics.jsonl").read_text().splitlines()
    one = tmp_path / "one"
    one.mkdir()
    (one / "metrics.jsonl").write_text(lines[0] + "\n" + next(line for line in lines if '"val"' in line) + "\n")
    with Image.open(plot.plot(one, one / "metrics.png")) as png:
        pixels = png.convert("RGB")
    blue = (31, 119, 180)  # matplotlib's first colour: the series'
    # loss, learning rate, img/s and data wait, 500 × 340 px each (validation's had its points already)
    for row, col in [(0, 0), (0, 2), (1, 0), (1, 1)]:
        panel = pixels.crop((col * 500, row * 340, col * 500 + 500, row * 340 + 340))
        assert blue in {colour for _, colour in panel.getcolors(1 << 16) or []}, f"panel {row, col} is empty"

    proc = here(plot.main, tmp_path, check=False)
    assert proc.returncode == 1 and f"no metrics.jsonl in {tmp_path}" in proc.stderr
    dry = run_cli(ROOT / "run", "-n", "plot", output, env={"VENV": ".venv"}).stdout.splitlines()[-1]
    assert dry == f".venv/bin/python -m imagenet_ais.cli.plot {output}"


@pytest.mark.parametrize(("cpus", "local_world", "workers"), [("0", "1", 1), ("0,1", "1", 2), ("0,1", "2", 1)])
def test_the_defaults_are_sized_on_the_machine_that_trains(
    cpus: str, local_world: str, workers: int, tmp_path: Path
) -> None:
    """No --workers/--decode/--compile: workers from the CPUs this process may use per local rank
    (taskset stands in for Slurm's binding), CPU decode and eager where there is no GPU."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [8]})
    env = {"LOCAL_WORLD_SIZE": local_world}  # what torchrun tells each of a node's ranks
    args = ["--data", data, "--output", output, *TINY, "--epochs", "1", "--max-steps", "1"]
    run_cli("taskset", "-c", cpus, sys.executable, ROOT / "train.py", *args, env=env)
    said = f"{workers} worker{'' if workers == 1 else 's'} per process"  # ("1 workers" before)
    assert f"cpu decode, {said}, eager" in (output / "train.log").read_text()


def test_workers_must_be_auto_or_a_count(tmp_path: Path) -> None:
    proc = train_here("--synthetic", "--output", tmp_path, "--workers", "many", check=False)
    assert proc.returncode == 2 and "'many' is neither 'auto' nor a number of workers" in proc.stderr


def test_a_run_resumed_before_its_first_checkpoint_logs_each_step_once(tmp_path: Path) -> None:
    """A crash before any checkpoint leaves records (the last one cut short); --resume auto
    starts over and must neither count those steps twice nor choke on the torn line."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [16]})
    output.mkdir()
    (output / "metrics.jsonl").write_text(
        '{"kind": "train", "epoch": 0, "step": 1, "loss": 9.0}\n{"kind": "train", "epoch": 0, "st'
    )
    args = ["--data", data, "--output", output, *TINY, "--epochs", "1", "--log-every", "1", "--resume", "auto"]
    train_here(*args, "--workers", "1")
    assert [r["step"] for r in metrics(output) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert all(r.get("loss") != 9.0 for r in metrics(output)), "the crashed run's record is gone"


def test_a_damaged_checkpoint_is_never_trained_on(tmp_path: Path) -> None:
    """64 flipped bytes inside last.pt's tensor data load without a word from torch: the
    checksum catches them; --resume auto falls back to the newest intact checkpoint and says
    so, an explicit --resume of the damaged file is one line, and so is a foreign file."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [16]})
    args = ["--data", data, "--output", output, *TINY, "--workers", "1", "--log-every", "1", "--keep-last", "5"]
    train_here(*args, "--epochs", "2")  # checkpoints at steps 4 and 8; last.pt is step 8
    last = output / "last.pt"
    raw = bytearray(last.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    last.write_bytes(raw)  # in place: ckpt-00000008.pt is the same file
    assert torch.load(last, weights_only=True)["step"] == 8, "torch itself loads it without complaint"

    explicit = train_here(*args, "--epochs", "3", "--resume", last, check=False)
    assert explicit.returncode == 1 and "Traceback" not in explicit.stderr
    assert f"{last}: damaged" in explicit.stderr.strip().splitlines()[-1]

    out = train_here(*args, "--epochs", "3", "--resume", "auto")
    assert "resuming from" in out.stderr and "ckpt-00000004.pt, the newest intact checkpoint" in out.stderr
    assert "resumed from" in out.stdout and "step 4" in out.stdout
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 12, "epochs 2 and 3 trained again from step 4"

    foreign = tmp_path / "notes.pt"
    foreign.write_text("not a checkpoint\n")
    proc = train_here(*args, "--epochs", "3", "--resume", foreign, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "weights_only" not in proc.stderr
    assert f"{foreign}: not a checkpoint this tool can load" in proc.stderr.strip().splitlines()[-1]


def test_damaged_shards_are_named_once_counted_and_bounded(tmp_path: Path) -> None:
    data = tmp_path / "shards"
    manifest = write_shards(data, {"train": UNEVEN, "val": [5]}, corrupt={"train-1-4"})
    shards = manifest.splits["train"].shards
    (data / shards[0].name).unlink()  # listed, missing
    cut = data / shards[3].name
    cut.write_bytes(cut.read_bytes()[: shards[3].samples * MIN_SAMPLE_BYTES + 300])  # cut mid-member
    shards[4].samples += 3  # the manifest claims more than the shard holds
    with wds.TarWriter(str(data / shards[2].name)) as tar:  # a label outside the 4 classes
        for i in range(shards[2].samples):
            tar.write(
                {"__key__": f"train-2-{i}", "jpg": tiny_jpeg(random.Random(i), 1), "cls": b"99" if i == 0 else b"1"}
            )
    (data / "manifest.json").write_text(manifest.to_json())
    relist(data)  # the shards' sizes and checksums as they now are: only reading them tells
    named = {
        shards[0].name: "could not be read",
        shards[1].name: "sample 'train-1-4' skipped",
        shards[2].name: "label 99 is not among the manifest's 4 classes",
        shards[3].name: "read failed at sample",
        shards[4].name: f"ends after 8 samples, the manifest lists {shards[4].samples}",
    }
    common = ["--data", data, *TINY, "--epochs", "2", "--workers", "2", "--epoch-mode", "exact", "--log-every", "2"]

    out = ranks(2, *common, "--output", tmp_path / "tolerant", "--max-bad", "1")
    log = (tmp_path / "tolerant" / "train.log").read_text()
    for name, problem in named.items():
        lines = [line for line in log.splitlines() if name in line]
        assert len(lines) == 1 and problem in lines[0], (name, lines)  # once, though read in both epochs
        assert sum(name in line for line in out.stderr.splitlines()) == 1
    # counted every time they are read: both epochs, and by both ranks where a shard is split
    last = [r for r in metrics(tmp_path / "tolerant") if r["kind"] == "train"][-1]
    assert last["read_errors"] >= 6 and last["skipped"] >= 2 and last["padded"] > 0
    summary = f"data: {last['skipped']} samples skipped, {last['padded']} padded with repeats, "
    assert summary + f"{last['read_errors']} shard read errors ({last['unread']} samples unread) over the run" in log

    out = ranks(2, *common, "--output", tmp_path / "strict", check=False)
    assert out.returncode != 0
    assert "ERROR: epoch 1: " in out.stderr and "over --max-bad 0.01" in out.stderr
    assert (tmp_path / "strict" / "last.pt").exists(), "the epoch's checkpoint is saved before stopping"
    assert not any(r["epoch"] == 2 for r in metrics(tmp_path / "strict")), "the run stopped after epoch 1"


def tiny_run(data: Path, output: Path, **changes: object) -> config.TrainConfig:
    """A short CPU run of a tiny model on ``data``, in this process."""
    cfg = config.TrainConfig(
        data=str(data), output=str(output), arch=TINY_ARCH, image_size=32, batch_size=4, warmup_epochs=0, epochs=1,
        workers=1, log_every=2,
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


def test_epochs_too_short_to_learn_from_are_said_with_a_batch_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # 166 images at the default batch 256: one step an epoch, loss 52, top-1 at chance, no word
    data = tmp_path / "shards"
    write_shards(data, {"train": [12, 12], "val": [4]})
    assert loop.train(tiny_run(data, tmp_path / "big", batch_size=32))["exit_code"] == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "too few to learn from" in line]
    assert warned == [
        "warning: an epoch is 1 step of 32 images (--batch-size 32; the batch is larger than the 24 samples): too "
        "few to learn from; for these 24 samples try --batch-size 2, and see --help for a quick CPU run"
    ]
    assert loop.train(tiny_run(data, tmp_path / "fits", batch_size=2))["exit_code"] == 0
    assert "too few to learn from" not in capsys.readouterr().err, "12 steps: said no more"


@pytest.mark.parametrize("opt", ["sgd", "lamb", "lars"])
def test_a_timm_model_trains_resumes_and_loads_back_into_timm(opt: str, tmp_path: Path) -> None:
    import timm

    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [12, 12], "val": [4]})
    cfg = tiny_run(data, output, arch="timm/test_convnext", opt=opt, epochs=2, batch_size=2, resume="auto")
    stopped = loop.train(dataclasses.replace(cfg, max_steps=3))
    assert stopped["step"] == 3 and stopped["exit_code"] == 0
    done = loop.train(cfg)  # resumed: the model, its optimizer's state (LAMB's, LARS's), the data
    assert done["complete"] and done["step"] == 24
    state = torch.load(output / "last.pt", weights_only=True)
    assert state["arch"] == "timm/test_convnext" and state["config"]["opt"] == opt
    again = timm.create_model("test_convnext", num_classes=4)
    again.load_state_dict(state["model"], strict=True)  # timm's own model takes the weights as they are
    assert not torch.isnan(next(iter(again.parameters()))).any()


def hub_cache(tmp_path: Path, monkeypatch, state: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face cache (as the hub lays it out) holding ``state`` as timm's test_convnext.r160_in1k."""
    import huggingface_hub.constants
    from safetensors.torch import save_file

    snapshot = tmp_path / "hub" / "models--timm--test_convnext.r160_in1k" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    save_file(state, snapshot / "model.safetensors")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot / "model.safetensors"


def test_timm_pretrained_weights_come_from_the_hugging_face_cache(tmp_path: Path, monkeypatch) -> None:
    import timm

    released = timm.create_model("test_convnext", num_classes=1000)  # as the hub's file: 1,000 classes
    hub_cache(tmp_path, monkeypatch, released.state_dict())
    arch, tag = "timm/test_convnext", "timm/test_convnext.r160_in1k"
    mine = model.build_model(arch, 4)
    model.load_weights(mine, tag, arch)
    ours, theirs = mine.state_dict(), released.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.startswith("head.fc.")), "all but the head"
    assert ours["head.fc.weight"].shape == (4, theirs["head.fc.weight"].shape[1]), "a head for these 4 classes"
    data = tmp_path / "shards"
    write_shards(data, {"train": [8], "val": [4]})
    cfg = tiny_run(data, tmp_path / "run", arch=arch, weights=tag, max_steps=1, batch_size=2)
    assert loop.train(cfg)["exit_code"] == 0
    with pytest.raises(ConfigError, match=r"^--weights timm/test_convnext.r160_in1k: weights of timm's test_conv"):
        model.load_weights(mine, tag, "timm/test_resnet")
    with pytest.raises(DataError, match=r"^--weights timm/test_convnext.nope: timm has no such pretrained tag"):
        model.load_weights(mine, "timm/test_convnext.nope", arch)
    with pytest.raises(DataError, match=r"^--weights timm/test_resnet.r160_in1k: not in the Hugging Face cache"):
        model.load_weights(model.build_model("timm/test_resnet", 4), "timm/test_resnet.r160_in1k", "timm/test_resnet")


def test_timm_weights_partial_damaged_or_of_another_model_in_the_cache_are_refused(tmp_path: Path, monkeypatch) -> None:
    import timm
    from safetensors.torch import save_file

    released = timm.create_model("test_convnext", num_classes=1000).state_dict()
    file = hub_cache(tmp_path, monkeypatch, {k: v for k, v in released.items() if not k.startswith("stages.1.")})
    arch, tag = "timm/test_convnext", "timm/test_convnext.r160_in1k"
    cache = rf"^--weights {tag}: the Hugging Face cache's"
    refused = rf"{cache} {re.escape(str(file))} is damaged or not timm's test_convnext"
    fetch = r"\): delete that file and fetch it again, python -c .+timm.create_model\('test_convnext.r160_in1k', pre"
    with pytest.raises(DataError, match=rf"{refused} \(Missing key\(s\) in state_dict: 22 \(stages.1.downsample.0.we"):
        model.load_weights(model.build_model(arch, 4), tag, arch)  # a partial download: before, what it held
    save_file(timm.create_model("test_convnext2", num_classes=1000).state_dict(), file)  # another model's
    with pytest.raises(DataError, match=rf"{refused} \(Missing key.+size mismatch for stem.0.weight: .+{fetch}"):
        model.load_weights(model.build_model(arch, 4), tag, arch)
    save_file(released, file)
    file.write_bytes(file.read_bytes()[:-100])  # cut short
    with pytest.raises(DataError, match=rf"{refused} \(SafetensorError: Error while deserializing header: .+{fetch}"):
        model.load_weights(model.build_model(arch, 4), tag, arch)
    blob = tmp_path / "blob"  # as the hub keeps them: the snapshot's file links to a blob
    blob.write_bytes(b"\0" * 100)
    file.unlink()
    file.symlink_to(blob)
    refused = rf"{cache} {re.escape(str(blob))} is damaged or not timm's test_convnext"
    with pytest.raises(DataError, match=rf"{refused} \(SafetensorError: .+{fetch}"):
        model.load_weights(model.build_model(arch, 4), tag, arch)
    blob.unlink()  # so deleted: the cache holds it no more
    with pytest.raises(DataError, match=rf"^--weights {tag}: not in the Hugging Face cache \(HF_HOME\): fetch it"):
        model.load_weights(model.build_model(arch, 4), tag, arch)


def test_timm_names_are_checked_and_a_missing_timm_is_one_line(tmp_path: Path, monkeypatch) -> None:
    cfg = config.TrainConfig(output=str(tmp_path / "run"), synthetic=True, arch="timm/no_such_net", image_size=32)
    with pytest.raises(ConfigError, match=r"^--arch 'timm/no_such_net': timm has no model 'no_such_net' \(timm"):
        loop.train(cfg)
    monkeypatch.setitem(sys.modules, "timm", None)  # as where the extra is not installed
    missing = r"needs timm, which is not installed: \./run venv --extra timm \(pip: "  # (./run's venv, or pip's)
    with pytest.raises(ConfigError, match=rf"^--arch timm/test_convnext {missing}"):
        loop.train(dataclasses.replace(cfg, arch="timm/test_convnext"))
    with pytest.raises(ConfigError, match=rf"^--opt lamb {missing}"):
        loop.train(dataclasses.replace(cfg, arch=TINY_ARCH, opt="lamb", max_steps=1))
    assert not (tmp_path / "run").exists(), "refused before anything was made"


def test_resampled_epochs_count_the_samples_of_shards_that_failed_to_read(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # One of three train shards missing: exact mode padded and stopped, resampled mode said
    # "0 skipped, 0 padded, 139 shard read errors" and exited 0.
    data = tmp_path / "shards"
    manifest = write_shards(data, {"train": [16, 16, 16], "val": [4]})
    (data / manifest.splits["train"].shards[1].name).unlink()
    outcome = loop.train(tiny_run(data, tmp_path / "strict"))
    said = capsys.readouterr().err
    assert outcome["exit_code"] == EXIT_BAD_DATA
    found = re.search(r"ERROR: epoch 1: (\d+) of its 48 samples could not be read .* leaving (\d+) of the (\d+)", said)
    assert found and 8 <= int(found[1]) <= 24 and int(found[1]) == round(48 * int(found[2]) / int(found[3]))
    assert loop.train(tiny_run(data, tmp_path / "tolerant", max_bad=1.0))["exit_code"] == 0


@pytest.mark.parametrize("mode", ["resampled", "exact"])
def test_a_dataset_with_no_readable_shard_ends_the_run_with_exit_4_not_a_hang(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # every train shard gone (a deleted folder or bucket): a worker drew and failed shards for ever
    data = tmp_path / "shards"
    manifest = write_shards(data, {"train": UNEVEN})
    for shard in manifest.splits["train"].shards:
        (data / shard.name).unlink()
    outcome = loop.train(tiny_run(data, tmp_path / "run", epoch_mode=mode, max_bad=1.0))
    assert outcome["exit_code"] == EXIT_BAD_DATA
    said = capsys.readouterr()
    errors = [line for line in said.err.splitlines() if line.startswith("ERROR")]
    says = "the last 50 shard reads of a loader worker failed" if mode == "resampled" else "no training sample of"
    assert len(errors) == 1 and errors[0].startswith(f"ERROR: {data}: {says}"), errors
    # what could not be read is named above the error, and the closing summary does not deny it
    named = said.err.partition("ERROR")[0]
    assert re.search(rf"warning: {re.escape(str(data))}/\S+\.tar: ", named), said.err
    assert "every sample was read" not in said.out + said.err
    assert re.search(r"data: \d+ samples skipped, \d+ padded with repeats, [1-9]\d* shard read errors", said.out)


@pytest.mark.parametrize(
    ("option", "value"),
    [("lr", float("nan")), ("lr", float("inf")), ("lr", -0.1), ("weight_decay", -1e-4), ("flush_timeout", -1.0)],
)
def test_numbers_no_run_can_train_with_are_refused_in_one_line(option: str, value: float, tmp_path: Path) -> None:
    cfg = config.TrainConfig(output=str(tmp_path / "run"), synthetic=True, **{option: value})
    with pytest.raises(ValueError, match=rf"^--{option.replace('_', '-')} {value}: give a finite number, 0 or more$"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_warmup_as_long_as_the_run_is_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the default 5 warmup epochs with --epochs 1: the peak learning rate never came, without a word
    cfg = config.TrainConfig(output=str(tmp_path / "run"), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=2)
    loop.train(dataclasses.replace(cfg, epochs=1, max_steps=1))
    said = capsys.readouterr()
    # the rate the optimizer uses, not --lr's per-256 figure (the lines showed 0.00625 beside "--lr 0.1")
    assert "warning: --warmup-epochs 5 covers all 1 epochs: the learning rate reaches its peak 0.00078125 " in said.err
    says = "learning rate 0.00078125 at its peak: --lr 0.1 is per 256 images, scaled to the global batch of 2"
    assert says in said.out
    loop.train(dataclasses.replace(cfg, output=str(tmp_path / "short"), epochs=2, warmup_epochs=1, max_steps=1))
    assert "--warmup-epochs" not in capsys.readouterr().err


def test_torchvisions_reference_options_train_as_they_say(tmp_path: Path) -> None:
    # torchvision's train.py habits (--model, --output-dir, -b, -j, --print-freq, --opt, --lr-scheduler,
    # --norm-weight-decay, ...) were unknown options
    out = tmp_path / "run"
    common = ["--synthetic", "--model", TINY_ARCH, "--output-dir", out, "-b", "2", "-j", "0", "--image-size", "32"]
    common += ["--epoch-size", "6", "--print-freq", "1", "--lr-warmup-epochs", "0", "--lr", "0.256"]
    chosen = ["--opt", "adamw", "--lr-scheduler", "steplr", "--lr-step-size", "1", "--lr-gamma", "0.5"]
    train_here(*common, "--epochs", "3", *chosen, "--wd", "0.02", "--norm-weight-decay", "0.01")
    peak = 0.256 * 2 / 256
    lrs = [r["lr"] for r in metrics(out) if r["kind"] == "train"]
    assert lrs == pytest.approx([peak] * 3 + [peak / 2] * 3 + [peak / 4] * 3), "halved every epoch"
    groups = torch.load(out / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.02, 0.01] and "amsgrad" in groups[0], "AdamW's"
    # resumed with another optimizer: its state cannot carry over (torch's error was a KeyError traceback)
    again = train_here(*common, "--epochs", "4", "--opt", "sgd", "--resume", "auto", check=False)
    assert again.returncode == 1 and "was trained with --opt adamw, not sgd" in again.stderr
    assert len([r for r in metrics(out) if r["kind"] == "train"]) == 9, "nothing trained"


@pytest.mark.parametrize("kind", ["cosine", "step", "onecycle"])
def test_each_lr_schedule_has_its_shape(kind: str) -> None:
    cfg = config.TrainConfig(lr_scheduler=kind, lr_step_size=2, lr_gamma=0.1)
    factor = model.lr_lambda(cfg, warmup=10, total=100, per_epoch=10)
    curve = [factor(step) for step in range(100)]
    assert curve[9] == pytest.approx(1.0) and max(curve) == pytest.approx(1.0), "the peak at the warmup's end"
    if kind == "onecycle":  # torch's OneCycleLR: from 1/25 of the peak on a cosine, down to 1/250,000 of it
        assert 1 / 25 < curve[0] < 0.07 and curve[-1] < 1e-3 and curve[4] == pytest.approx(0.52), (
            "half way up: 1/25 + half"
        )
    else:
        assert curve[:10] == pytest.approx([(s + 1) / 10 for s in range(10)]), "a linear warmup"
    if kind == "step":
        assert curve[19] == 1 and curve[20] == pytest.approx(0.1) and curve[40] == pytest.approx(0.01)
    if kind == "cosine":
        assert curve[55] == pytest.approx(0.5) and curve[-1] < 1e-3
    assert factor(50) == model.lr_lambda(cfg, 10, 100, 10, start=30)(20), "a resume picks the curve up"


def test_torchvisions_weights_by_name_come_from_torch_hubs_cache(tmp_path: Path, monkeypatch) -> None:
    # --weights ResNet18_Weights.IMAGENET1K_V1 was "no such file"; offline it must say where the file goes
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    net = torchvision.models.resnet18()
    cached = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    with pytest.raises(
        ValueError, match=rf"could not fetch .*; without a network, put that file at {re.escape(str(cached))}"
    ):
        model.load_weights(net, "ResNet18_Weights.IMAGENET1K_V1")  # (this machine reaches no download server)
    assert not list((tmp_path / "hub").rglob("*.pth*")), "no partial download left where the file goes"
    trained = torchvision.models.resnet18()
    torch.save(trained.state_dict(), cached)
    model.load_weights(net, "ResNet18_Weights.IMAGENET1K_V1")
    assert torch.equal(net.fc.weight, trained.fc.weight), "loaded from the cache"
    with pytest.raises(ValueError, match="torchvision has no such weights"):
        model.load_weights(net, "ResNet18_Weights.NO_SUCH")


def test_an_output_weights_or_arch_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--output '': name a folder"):  # it wrote into the current directory
        loop.train(config.TrainConfig(output="", synthetic=True))
    for path, says in ((tmp_path, "a folder"), (tmp_path / "none.pt", "no such file")):  # a folder exited 2
        with pytest.raises(ValueError, match=rf"^--weights {re.escape(str(path))}: {says}, not a state dict$"):
            model.load_weights(torch.nn.Linear(1, 1), str(path))
    # a detection model fetched its backbone's weights from the network
    with pytest.raises(ValueError, match="'fasterrcnn_resnet50_fpn' is not a torchvision classification model"):
        model.build_model("fasterrcnn_resnet50_fpn", 10)
    # another model's weights: every missing and unexpected key listed, in one "line" of thousands of characters
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "resnet18.pt")
    with pytest.raises(ValueError, match=r"does not fit this model \(Missing key\(s\) in state_dict: \d+ \(") as e:
        model.load_weights(model.build_model(TINY_ARCH, 10), str(tmp_path / "resnet18.pt"))
    assert "Unexpected key(s) in state_dict: 120 (bn1.weight, bn1.bias, bn1.running_mean, …)" in str(e.value)
    assert len(str(e.value)) < 600


def test_a_start_that_fails_leaves_no_output_folder(tmp_path: Path) -> None:
    # a bad --arch, an unreachable ais://, --test-only without weights: an empty --output was left
    output = tmp_path / "run"
    cfg = config.TrainConfig(output=str(output), arch=TINY_ARCH, image_size=32, batch_size=2, workers=0)
    for changes, says in (
        ({"synthetic": True, "arch": "fasterrcnn_resnet50_fpn"}, "is not a torchvision classification model"),
        ({"synthetic": True, "test_only": True}, "--test-only: nothing to test"),
        ({"data": str(tmp_path / "nowhere")}, "no manifest.json in"),
    ):
        with pytest.raises((ValueError, OSError), match=re.escape(says)):
            loop.train(dataclasses.replace(cfg, **changes))
        assert not output.exists(), changes
    output.mkdir()  # a folder the user made stays
    with pytest.raises(OSError, match=r"no manifest\.json in"):
        loop.train(dataclasses.replace(cfg, data=str(tmp_path / "nowhere")))
    assert output.is_dir()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda s: s.pop("optimizer"), "not a checkpoint train.py can continue from (no 'optimizer' in it)"),
        (
            lambda s: s["model"].update({"fc.weight": torch.zeros(7, 512), "fc.bias": torch.zeros(7)}),
            "its weights do not fit resnet18 (size mismatch for fc.weight: copying a param with shape",
        ),
        (
            lambda s: s["classes"].__setitem__(2, "other"),
            "was trained on other classes ('other' where the data has '2'): give another --output for a new run",
        ),
    ],
)
def test_a_checkpoint_with_a_valid_digest_that_cannot_continue_this_run_is_one_line(
    edit, says: str, tmp_path: Path
) -> None:
    # a raw KeyError; a size mismatch thousands of characters long; "resnet18 on 1000 classes, not resnet18 on 1000"
    cfg = config.TrainConfig(
        output=str(tmp_path / "run"), synthetic=True, arch="resnet18", image_size=32, batch_size=2, max_steps=1,
    )  # fmt: skip
    loop.train(cfg)
    path = tmp_path / "run" / "last.pt"
    state = checkpoint.load(path)
    edit(state)
    path.unlink()
    torch.save({**state, checkpoint.DIGEST: checkpoint.digest(state)}, path)
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        loop.train(dataclasses.replace(cfg, resume="auto", max_steps=2))
    assert "\n" not in str(e.value) and len(str(e.value)) < 500


def nan_weights(tmp_path: Path) -> str:
    """A tiny model's state dict (1,000 classes) with one NaN weight, as a --weights file."""
    weights = torchvision.models.get_model(TINY_ARCH, num_classes=1000).state_dict()
    weights["fc.weight"][0, 0] = float("nan")
    torch.save(weights, tmp_path / "nan.pt")
    return str(tmp_path / "nan.pt")


def test_a_loss_that_stays_nan_stops_the_run_with_exit_5_and_saves_nothing_past_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # --lr nan, or weights holding NaN (with a valid digest): "loss nan" at every step, a final validation, exit 0
    cfg = config.TrainConfig(
        output=str(tmp_path / "run"), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=2, epochs=1,
        log_every=4, weights=nan_weights(tmp_path),
    )  # fmt: skip
    outcome = loop.train(cfg)
    assert outcome["exit_code"] == EXIT_DIVERGED and outcome["step"] == 12  # 3 windows of 4 steps
    assert "ERROR: the loss was NaN or infinite for the last 12 steps, up to step 12" in capsys.readouterr().err
    assert not list((tmp_path / "run").glob("*.pt")), "no checkpoint of NaN weights"


def test_a_fresh_start_clears_what_an_attempt_that_died_before_its_first_checkpoint_left(tmp_path: Path) -> None:
    # after a SIGINT and a rerun: 36 key lines for 24 keys, and an old event file's steps shown twice
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN})
    (output / "keys").mkdir(parents=True)
    (output / "keys" / "epoch001-rank0.txt").write_text("train-0-0\ntrain-0-1\n")
    (output / "metrics.jsonl").write_text('{"kind": "train", "epoch": 0, "step": 2, "loss": 9.0}\n')
    with SummaryWriter(str(output)) as old:
        old.add_scalar("train/loss", 9.0, 2)
    for how in (None, "auto"):  # afresh, or --resume auto finding no checkpoint
        loop.train(tiny_run(data, output, resume=how, workers=0, log_keys=True, max_steps=3))
        assert len((output / "keys" / "epoch001-rank0.txt").read_text().split()) == 3 * 4
        train = [r for r in metrics(output) if r["kind"] == "train"]
        assert [r["step"] for r in train] == [2, 3] and all(r["loss"] < 9 for r in train)
        assert len(list(output.glob("events.out.tfevents.*"))) == 1
        for path in output.glob("*.pt"):  # as if that run too had died before its first checkpoint
            path.unlink()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b"resource_tracker"  # gone: as good as not there


def test_weights_gone_nan_before_the_loss_could_stop_the_run_are_never_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # 4 NaN steps to an epoch's end are fewer than the loss's 10: the epoch's checkpoint would have held them
    cfg = config.TrainConfig(
        output=str(tmp_path / "run"), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=2, epochs=2,
        epoch_size=8, log_every=20, weights=nan_weights(tmp_path),
    )  # fmt: skip
    assert loop.train(cfg)["exit_code"] == EXIT_DIVERGED
    assert "ERROR: the weights hold NaN or infinity at step 4, up to step 4" in capsys.readouterr().err
    assert not list((tmp_path / "run").glob("*.pt"))


def test_a_validation_that_reads_nothing_still_saves_its_epoch_then_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # over 50 val shards gone: the val worker gave up like a train worker, and the epoch's training was lost
    data = tmp_path / "shards"
    manifest = write_shards(data, {"train": [8], "val": [1] * 55})
    for shard in manifest.splits["val"].shards:
        (data / shard.name).unlink()
    outcome = loop.train(tiny_run(data, tmp_path / "run"))
    assert outcome["exit_code"] == EXIT_BAD_DATA
    assert "validation could not read 55 of the 55 images" in capsys.readouterr().err
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["epoch"] == 1


def test_with_several_ranks_only_a_long_wait_for_data_ends_after_a_signal() -> None:
    alone = setup.StopSignal(world=1)
    try:
        assert not alone.stop_waiting(100)
        os.kill(os.getpid(), signal.SIGTERM)
        assert alone.received == signal.SIGTERM and alone.stop_waiting(0.2)
    finally:
        alone.restore()
    requested = threading.Event()  # (as a framework's thread asks: ray_train.py)
    several = setup.StopSignal(world=2, requested=requested)
    try:
        assert not several.stop_waiting(100)
        requested.set()
        assert several.received == signal.SIGTERM
        # a short stall: this rank goes on to the next agreement, where every rank saves together
        assert not several.stop_waiting(0.2) and several.stop_waiting(several.GRACE + 1)
    finally:
        several.restore()


class _ShardsNeverCome(http.server.SimpleHTTPRequestHandler):
    """Serves the manifest and the shards' sizes, but never a shard's bytes (a stalled store)."""

    def do_GET(self) -> None:
        if self.path.endswith(".tar"):
            time.sleep(300)
        else:
            super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


def test_sigterm_stops_a_run_whose_data_never_comes(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": UNEVEN})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_ShardsNeverCome, directory=str(data)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    location = f"http://127.0.0.1:{server.server_address[1]}"
    proc = Started("--data", location, "--output", output, *TINY, "--workers", "1")

    # its DataLoader worker started (beside multiprocessing's resource tracker): it waits for a batch
    def workers() -> list[int]:
        return [p for p in child_pids(proc.pid) if b"resource_tracker" not in _cmdline(p)]

    wait_until(proc, workers, "a worker", log=proc.log)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    server.shutdown()
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped by a signal (SIGTERM) at step 0, checkpoint saved" in out


def test_ctrl_c_saves_and_exits_as_stopped_and_the_run_goes_on(tmp_path: Path) -> None:
    # a terminal's Ctrl-C reaches the whole process group, the DataLoader workers too: it printed
    # "Aborted!" and exited 1 with nothing saved
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [200] * 4, "val": [4]})
    args = ["--data", data, "--output", output, *TINY, "--epochs", "2", "--workers", "2", "--log-every", "1"]
    proc = Started(*args, new_session=True)
    records = output / "metrics.jsonl"
    wait_until(proc, lambda: records.exists() and len(records.read_text().splitlines()) >= 3, "3 steps", log=proc.log)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Ctrl-C: stopping after this step, with a checkpoint" in err
    assert "stopped by a signal (SIGINT, Ctrl-C) at step" in out and "Aborted!" not in err and "Traceback" not in err
    saved = torch.load(output / "last.pt", weights_only=True)
    assert saved["epoch"] == 0 and saved["step_in_epoch"] > 0, "saved mid-epoch"
    again = train_here(*args, "--resume", "auto", "--max-steps", str(saved["step"] + 1))
    assert f"resumed from {output / 'last.pt'}" in again.stdout + again.stderr


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the second Ctrl-C printed click's "Aborted!" and exited 1, as if the input were bad
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40], "val": [4]})
    args = ["--data", data, "--output", output, *TINY, "--epochs", "3", "--workers", "0", "--log-every", "1"]
    train_here(*args, "--epochs", "1")
    records, pressed = output / "metrics.jsonl", threading.Event()

    def first() -> None:  # a user's Ctrl-C in the second epoch
        while len(records.read_text().splitlines()) < 14:
            time.sleep(0.01)
        pressed.set()
        os.kill(os.getpid(), signal.SIGINT)

    def save_then_press(*a: object, **kw: object) -> object:  # and again while the run saves for it
        if pressed.is_set():
            os.kill(os.getpid(), signal.SIGINT)
        return save(*a, **kw)

    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", save_then_press)
    presser = threading.Thread(target=first)
    presser.start()
    stopped = train_here(*args, "--resume", "auto", check=False)
    presser.join()
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.count("Ctrl-C: stopping after this step") == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        "main: stopped at once by a second Ctrl-C, unsaved: --resume auto goes on from the last checkpoint"
    )
    assert "Aborted!" not in stopped.stderr and "Traceback" not in stopped.stderr
    assert torch.load(output / "last.pt", weights_only=True)["epoch"] == 1, "the last checkpoint stands"


def test_too_few_file_descriptors_for_the_workers_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    # "Too many open files", then it never exited: the workers started before the failure ignore
    # SIGTERM, and multiprocessing's exit hook waited for them
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40, 40], "val": [4]})

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    proc = subprocess.run(
        [sys.executable, ROOT / "train.py", "--data", data, "--output", output, *TINY, "-j", "8", "--epochs", "1"],
        cwd=ROOT, preexec_fn=few_files, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "Error: [Errno 24] Too many open files"
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(output).encode() in _cmdline(int(p.name))]
    assert not left, "no worker of the run left behind"


def test_sigterm_before_the_run_can_save_still_ends_it_as_stopped(tmp_path: Path) -> None:
    # outside the run's own handler (here: its manifest's server never answers) SIGTERM killed it (143)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, answers none
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/data"
        proc = subprocess.Popen(
            [sys.executable, ROOT / "train.py", "--data", url, "--output", tmp_path / "run", *TINY],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        silent.settimeout(60)
        with silent.accept()[0]:  # its request for manifest.json, left waiting for an answer
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in err, err
    assert not (tmp_path / "run").exists(), "nothing of a start that did not get going"


def test_a_run_killed_outright_leaves_no_workers_and_keeps_its_keys(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [200] * 4})
    args = ["--data", data, "--output", output, *TINY, "--epochs", "50", "--workers", "3", "--log-keys"]
    proc = Started(*args, "--log-every", "2")
    records = output / "metrics.jsonl"
    wait_until(proc, lambda: records.exists() and records.read_text().count("\n") >= 2, "2 records", log=proc.log)
    workers = child_pids(proc.pid)
    assert len(workers) >= 3
    proc.kill()  # SIGKILL: nothing in the training process runs again
    proc.wait()
    logged = max(r["step"] for r in metrics(output))
    # the DataLoader's own check would take 5 s at best
    assert not (alive := outliving(workers, 3)), f"workers {sorted(alive)} outlived their training process"
    keys = (output / "keys" / "epoch001-rank0.txt").read_text().split()
    assert len(keys) >= logged * 4, "every step's keys written before the kill are kept"


@pytest.mark.parametrize("full", ["file-size limit", "full disk"])
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing(full: str, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [8]})
    train = [sys.executable, ROOT / "train.py", "--data", data, "--output", output, *TINY, "--workers", "0"]
    if full == "file-size limit":

        def limited() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the checkpoint: 3 MB

        proc = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, preexec_fn=limited)
        reason = "File too large"
    else:
        if not shutil.which("unshare") or run_cli("unshare", "-rm", "true", check=False).returncode:
            pytest.skip("no unshare, or user namespaces are not allowed here")
        output.mkdir()
        mount = 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"'
        proc = run_cli("unshare", "-rm", "sh", "-c", mount, output, *train, check=False)
        reason = "No space left on device"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"Error: {output}/ckpt-00000002.pt: not written ({reason}): free some space, or lift the file-size limit, "
        "then continue with --resume auto (the checkpoints already there are intact)"
    )
    if full == "file-size limit":  # (the tmpfs went with its namespace)
        assert not list(output.glob("*.pt")) and not list(output.glob(".*"))


@pytest.mark.parametrize("kind", ["tar", "foreign .pt", "damaged header", "pickle with code"])
def test_resume_of_what_is_not_our_checkpoint_is_one_line(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    if kind == "tar":
        with wds.TarWriter(str(path)) as tar:
            tar.write({"__key__": "a", "cls": b"1"})
        expected = "not a checkpoint this tool can load"
    elif kind == "foreign .pt":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
        expected = "not a checkpoint written by train.py (no model state in it)"
    elif kind == "damaged header":
        torch.save({"model": {"w": torch.zeros(2)}}, path)
        path.write_bytes(b"\0" * 64 + path.read_bytes()[64:])
        expected = "not a checkpoint this tool can load"
    else:
        path.write_bytes(pickle.dumps(Path("/")))  # loading it would call code: weights_only refuses
        expected = "not a checkpoint this tool can load"
    with pytest.raises(checkpoint.DamagedCheckpoint) as raised:
        checkpoint.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: {expected}") and "\n" not in message and "weights_only" not in message


@pytest.mark.slow
def test_a_second_training_into_one_output_is_refused(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [200] * 2})
    args = ["--data", data, "--output", output, *TINY, "--epochs", "50", "--workers", "1"]
    first = Started(*args)
    try:
        wait_until(first, (output / "train.lock").exists, "the first run's lock", log=first.log)
        second = train_here(*args, "--log-every", "1", check=False)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1] == (
            f"Error: {output} is being trained into by PID {first.pid} on {socket.gethostname()}: "
            "wait for it to finish (nothing was changed)"
        )
        assert first.poll() is None, "the first run goes on"
    finally:
        first.kill()
        first.wait()
    again = train_here(*args, "--max-steps", "2", "--resume", "auto")
    assert again.returncode == 0, "a killed holder's lock is free"


def test_a_validation_that_cannot_read_all_of_its_split_says_so(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [16], "val": [5, 5, 5]})
    (data / "imagenet-val-000000.tar").unlink()
    out = train_here("--data", data, "--output", output, *TINY, "--workers", "1", "--epochs", "1", check=False)
    assert out.returncode == EXIT_BAD_DATA, "a third of the split unread is over --max-bad"
    assert "ERROR: epoch 1: validation could not read 5 of the 15 images the manifest lists" in out.stderr
    assert f"{data}/imagenet-val-000000.tar: could not be read" in out.stderr
    assert "validation covered 10 of the 15 images the manifest lists (5 could not be read, named above)" in out.stderr
    val = [r for r in metrics(output) if r["kind"] == "val"][-1]
    assert val["samples"] == 10 and val["missing"] == 5
    log = (output / "train.log").read_text()
    assert "every sample was read" not in log and "5 validation images missing from the last validation" in log


def test_a_fresh_run_into_an_output_holding_one_is_refused_and_one_without_last_pt_resumes(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [16]})
    args = ["--data", data, "--output", output, *TINY, "--workers", "1", "--keep-last", "5"]
    train_here(*args, "--epochs", "2")  # checkpoints at steps 4 and 8; last.pt is step 8
    files = {p: p.read_bytes() for p in output.iterdir() if p.is_file()}

    fresh = train_here(*args, "--epochs", "1", "--seed", "5", check=False)
    assert fresh.returncode == 1 and "Traceback" not in fresh.stderr
    assert fresh.stderr.strip().splitlines()[-1] == (
        f"Error: {output} holds a run (last.pt, ckpt-00000008.pt): continue it with --resume auto, "
        "or use another --output"
    )
    assert {p: p.read_bytes() for p in output.iterdir() if p.is_file()} == files, "nothing was changed"

    (output / "last.pt").unlink()  # a kill between a checkpoint and its link, or a copy that left it out
    out = train_here(*args, "--epochs", "3", "--resume", "auto")
    newest = output / "ckpt-00000008.pt"
    assert f"{output / 'last.pt'} is missing; resuming from {newest}, the newest checkpoint there" in out.stderr
    assert "resumed from" in out.stdout and "step 8" in out.stdout
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 12, "epoch 3 only, after the first two"


def test_an_output_on_a_file_system_without_locks_trains_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(locks.fcntl, "flock", no_locks)
    with locks.lock_output(tmp_path) as lock:
        lock.check()
    assert capsys.readouterr().err == (
        f"warning: {tmp_path}/train.lock: this file system cannot lock (No locks available): nothing stops "
        f"a second run from using {tmp_path} at the same time\n"
    )
    assert not list(tmp_path.iterdir())


def test_the_training_process_asks_cuda_for_32_work_queues_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With CUDA's default 8, nvJPEG's stream queued behind the training step's kernels
    # (bench/RESULTS.md, run L); set before CUDA starts, and a user's own value stands. Both only
    # while the run lasts, as its CPU threads.
    threads = torch.get_num_threads()
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with distributed.joined():
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and torch.get_num_threads() == threads
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    with distributed.joined():
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"


def test_each_records_img_per_s_accounts_for_all_the_time_since_the_last_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Time spent after a record (writing it, the health poll; on a GPU, the steps it has still
    # queued) belongs to the next window: a rate without it reads high (by 11% on one H100).
    monkeypatch.setattr(DataHealth, "poll", lambda self, totals: time.sleep(0.3))
    seen: list[tuple[float, dict]] = []
    cfg = loop.TrainConfig(
        data=None, output=str(tmp_path), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=4,
        warmup_epochs=0, epochs=1, max_steps=8, log_every=2,
    )  # fmt: skip
    loop.train(cfg, report=lambda record: seen.append((time.perf_counter(), record)))
    windows = [(t, r) for t, r in seen if r["kind"] == "train"]
    assert len(windows) == 4
    for (before, _), (at, record) in itertools.pairwise(windows):
        assert 2 * 4 / record["img_per_s"] == pytest.approx(at - before, rel=0.1)
        (rank,) = record["ranks"]  # a window's two steps, each timed from its start to the next's
        assert 0 < rank["step_ms_p50"] <= rank["step_ms_p90"] <= 1000 * (at - before)


def test_a_run_freezes_what_the_process_holds_past_its_first_steps_and_gives_it_back(tmp_path: Path) -> None:
    # A full collection walked the training process's objects with the interpreter lock held,
    # 200-260 ms on a GPU host, stopping the feed's threads and the step's launches (RESULTS run BE)
    def run(output: str) -> list[int]:
        seen: list[tuple[str, int]] = []
        cfg = loop.TrainConfig(
            data=None, output=output, synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=4,
            warmup_epochs=0, epochs=2, epoch_size=16, log_every=2,
        )  # fmt: skip
        loop.train(cfg, report=lambda r: seen.append((r["kind"], gc.get_freeze_count())))
        return [frozen for kind, frozen in seen if kind == "train"]

    gc.collect()  # (Python 3.12 puts its 375 immortal objects among the frozen at each full collection)
    immortal = gc.get_freeze_count()
    windows = run(str(tmp_path / "a"))  # (frozen after the first window's record)
    assert len(windows) == 4 and windows[0] <= immortal and all(frozen > immortal + 1000 for frozen in windows[1:])
    assert gc.get_freeze_count() <= immortal, "the run's end gives every object back to the collector"
    gc.disable()  # a caller that wants no collections: it gets none, nor a freeze
    try:
        assert max(run(str(tmp_path / "b"))) <= immortal and not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()  # objects frozen before the run: a caller's
    theirs = gc.get_freeze_count()
    try:
        windows = run(str(tmp_path / "c"))
        assert windows[0] <= theirs and all(frozen > theirs + 1000 for frozen in windows[1:])
        assert gc.get_freeze_count() <= immortal, "one set: given back with the run's"
    finally:
        gc.unfreeze()


def test_compiled_training_uses_cuda_graphs_on_a_gpu_unless_told_otherwise() -> None:
    # Without CUDA graphs, 2 H100s ran at 0.77 of their ceiling instead of 0.92 (bench/RESULTS.md, run P)
    cfg = loop.TrainConfig(data=None, output="unused")
    assert model.compile_mode(cfg, cuda=True) == "reduce-overhead"
    assert model.compile_mode(cfg, cuda=False) == "default"
    cfg.compile_mode = "max-autotune-no-cudagraphs"
    assert model.compile_mode(cfg, cuda=True) == "max-autotune-no-cudagraphs"


def test_train_py_takes_its_defaults_from_the_config() -> None:
    assert train_cli.parse([]) == config.TrainConfig()


def test_a_log_that_is_no_terminal_gets_one_plain_line_per_record_and_no_progress_bar(tmp_path: Path) -> None:
    proc = train_here(
        "--synthetic", "--output", tmp_path, *TINY, "--epochs", "1", "--max-steps", "6", "--log-every", "2"
    )
    steps = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/1 step")]
    assert [line.split(" loss ")[0] for line in steps] == [f"epoch 1/1 step {n}/100" for n in (2, 4, 6)]
    assert all(" lr " in line and " img/s " in line and " data wait " in line for line in steps)
    assert "\r" not in proc.stderr and "step/s" not in proc.stderr, "no progress-bar frames"


def test_a_killed_runs_temp_files_are_swept_but_not_one_being_written(tmp_path: Path) -> None:
    debris, live = tmp_path / ".ckpt-000040.pt.a1b2.partial", tmp_path / ".last.pt.c3d4.partial"
    debris.write_bytes(b"half a checkpoint")
    live.write_bytes(b"a download under way")  # another node fetching into a shared --output
    hour_ago = time.time() - 3600
    os.utime(debris, (hour_ago, hour_ago))
    checkpoint.sweep_partials(tmp_path)
    assert not debris.exists() and live.exists()
