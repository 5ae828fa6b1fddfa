"""What the CLIs tell in one line (a failure the user can act on) and what keeps its traceback (a bug)."""

from __future__ import annotations

import errno
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, TINY_ARCH, UNSIZED, shards_here, train_here

from imagenet_ais import errors
from imagenet_ais.shards import verify
from imagenet_ais.train import config, loop, out_of_memory, setup


def test_a_bad_option_and_a_missing_data_location_are_one_line(tmp_path: Path) -> None:
    bad = train_here("--synthetic", "--output", tmp_path / "run", *UNSIZED, "--progressive", "8:4", check=False)
    missing = train_here("--data", tmp_path / "nowhere", "--output", tmp_path / "run", *TINY, check=False)
    for proc in (bad, missing):
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("Error: ")
    assert "--progressive '8:4'" in bad.stderr and str(tmp_path / "nowhere") in missing.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # a --recipe's or --image-size's clash was checked outside the one-line handler: a traceback
        (["--image-size", "32", "--progressive", "32:64"], "--image-size 32 with --progressive 32:64"),
        (["--progressive", "²:³"], "--progressive '²:³': give START:END"),  # ValueError from int()
        (["-j", "²"], "'²' is neither 'auto' nor a number of workers"),
        (["-j", "99999"], "'99999' is neither 'auto' nor a number of workers (0 to"),  # the task limit, then a hang
        (["--epoch-size", "99999999999999999999999"], "99999999999999999999999 is not in the range"),  # OverflowError
        (["--image-size", "30000"], "30000 is not in the range 16<=x<=2048"),  # MemoryError in a worker
    ],
)
def test_options_out_of_bounds_are_one_line_not_a_traceback(args: list[str], says: str, tmp_path: Path) -> None:
    proc = train_here("--synthetic", "--output", tmp_path / "run", *args, check=False)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("Error: ") and says in proc.stderr


@pytest.mark.parametrize(
    "bug",
    [ValueError("a bug's bad value"), KeyError("key"), OSError("raised bare, with no errno"), RuntimeError("x")],
    ids=["ValueError", "KeyError", "OSError", "RuntimeError"],
)
def test_an_unexpected_error_keeps_its_traceback(bug: Exception, tmp_path: Path, monkeypatch) -> None:
    # here() raises what the CLI let through: the interpreter prints it with its traceback
    def broken(*args: object) -> None:
        raise bug

    monkeypatch.setattr(loop, "_train", broken)
    with pytest.raises(type(bug)):
        train_here("--synthetic", "--output", tmp_path / "run", *TINY)
    monkeypatch.setattr(verify, "verify", broken)
    with pytest.raises(type(bug)):
        shards_here("verify", tmp_path)


@pytest.mark.parametrize(
    "failure",
    [
        errors.DataError("shard 3 of 'train': 5 samples in 0 bytes"),
        errors.StorageError("gs://b/x: unreachable for 30s"),
        PermissionError(errno.EACCES, "Permission denied", "/data/x"),  # the system's own, with its errno
    ],
    ids=["DataError", "StorageError", "PermissionError"],
)
def test_an_expected_failure_is_one_line_with_exit_1(failure: Exception, tmp_path: Path, monkeypatch) -> None:
    def failing(*args: object) -> None:
        raise failure

    monkeypatch.setattr(verify, "verify", failing)
    proc = shards_here("verify", tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr == f"Error: {failure}\n"


def test_each_expected_failure_is_still_the_builtin_it_was_and_crosses_processes() -> None:
    # callers (and worker processes, whose errors come back pickled) catch them as before
    assert isinstance(errors.ConfigError("x"), ValueError) and isinstance(errors.DataError("x"), ValueError)
    assert isinstance(errors.NotFound("x"), FileNotFoundError) and isinstance(errors.AlreadyThere("x"), FileExistsError)
    for e in (errors.NotFound("gs://b/x: not found"), errors.DataError("bad")):
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and str(again) == str(e) and errors.expected(again)


def _out_of_memory(how: str) -> Exception:
    """What a CUDA step that ran out of memory raises: torch's own error, or (a compiled graph's
    warm-up, say) an error of another kind raised from it or in its place."""
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of ...")
    if how == "cuBLAS":  # (a library's own allocation: torch's plain error, no size)
        return RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as e:
            if how == "from":
                raise RuntimeError("compiled graph failed") from e
            if how == "in-place":
                raise RuntimeError("compiled graph failed") from None
            raise
    except Exception as raised:
        return raised


def says(batch: int = 4) -> str:
    return (
        f"ran out of memory for {TINY_ARCH} at --batch-size {batch} per GPU, images of 32 px: lower --batch-size (or "
        "the image size); a run that saved a checkpoint goes on from it with --resume auto and the new --batch-size"
    )


@pytest.mark.parametrize("how", ["raised", "from", "in-place", "cuBLAS"])
def test_a_gpu_out_of_memory_ends_the_run_in_one_line_and_resume_goes_on_with_a_smaller_batch(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (no GPU here: the step's allocation fails as CUDA's would, at step 6, the second of epoch 2)
    where = "cpu" if how == "cuBLAS" else "cpu, asked for 20.00 GiB more,"
    output, up = tmp_path / "run", tmp_path / "up"
    args = ["--synthetic", "--output", output, "--epochs", "2", "--epoch-size", "16", "--upload", up]
    real_step, real_build, steps = loop.train_step, setup.build, []

    def step(*a: object, **k: object) -> torch.Tensor:
        steps.append(1)
        if len(steps) == 6:
            raise _out_of_memory(how)
        return real_step(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "train_step", step)
    proc = train_here(*args, *TINY, "--log-every", "1", check=False)
    assert proc.returncode == errors.EXIT_OUT_OF_MEMORY == 1 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "ERROR" in line] == [f"ERROR: {where} {says()}"]
    # closed as a failed run: epoch 1's checkpoint uploaded and named; nothing of the failed step saved
    assert f"checkpoints in {output}: last.pt; uploaded to {up}" in proc.stdout
    assert [p.name for p in output.glob("ckpt-*.pt")] == ["ckpt-00000004.pt"]
    assert (up / "ckpt-00000004.pt").read_bytes() == (output / "ckpt-00000004.pt").read_bytes()

    def build(*a: object) -> None:  # (the model's move to the device, say)
        raise _out_of_memory(how)

    monkeypatch.setattr(setup, "build", build)  # resumed with the checkpoint's settings, but the batch named
    resumed = train_here(*args, "--resume", "auto", "--batch-size", "3", check=False)
    assert resumed.returncode == 1
    assert resumed.stderr.splitlines()[-1] == f"Error: {where} {says(3)}"
    monkeypatch.setattr(loop, "train_step", real_step)
    monkeypatch.setattr(setup, "build", real_build)
    train_here(*args, "--resume", "auto", "--batch-size", "2")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train" and r["epoch"] == 2]
    assert train[-1]["step"] == 4 + 8, "epoch 2 in 8 steps of 2 (its 16 samples), after epoch 1's 4 of 4"


def test_a_run_that_failed_keeps_its_status_where_its_uploads_fail_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (with several ranks, the others' status too: an upload failure would have made rank 0's 3)
    output, up = tmp_path / "run", tmp_path / "up"
    real_step, steps = loop.train_step, []

    def step(*a: object, **k: object) -> torch.Tensor:
        steps.append(1)
        if len(steps) == 4:  # (before epoch 1's checkpoint goes up)
            shutil.rmtree(up)
            up.write_text("the upload location, gone bad")
        if len(steps) == 6:
            raise _out_of_memory("raised")
        return real_step(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "train_step", step)
    proc = train_here(
        "--synthetic", "--output", output, "--epochs", "2", "--epoch-size", "16", "--upload", up,
        "--upload-retry-seconds", "1", "--flush-timeout", "3", *TINY, check=False,
    )  # fmt: skip
    assert proc.returncode == errors.EXIT_OUT_OF_MEMORY, proc.stderr
    assert f"ERROR: never uploaded to {up}: ckpt-00000004.pt" in proc.stderr
    assert proc.stdout.splitlines()[-1] == f"checkpoints in {output}: last.pt", "not said to be uploaded"


def test_a_gpu_out_of_memory_before_training_is_one_line_and_for_a_library_an_error_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(*args: object) -> None:
        raise _out_of_memory("raised")

    monkeypatch.setattr(setup, "build", build)
    proc = train_here("--synthetic", "--output", tmp_path / "run", *TINY, check=False)
    assert proc.returncode == 1 and proc.stderr == f"Error: cpu, asked for 20.00 GiB more, {says()}\n"
    assert not (tmp_path / "run").exists(), "a start that failed leaves no folder"
    cfg = config.TrainConfig(output=str(tmp_path / "lib"), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=4)
    with pytest.raises(errors.OutOfMemory) as raised:
        loop.train(cfg)
    assert isinstance(raised.value, RuntimeError) and errors.expected(raised.value)
    assert str(raised.value).endswith(says()) and isinstance(raised.value.__cause__, torch.OutOfMemoryError)


NCCL = "NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled cuda error, NCCL version 2.28.3\nLast error:\n"


@pytest.mark.parametrize(
    ("message", "full"),
    [
        (NCCL + "Cuda failure 2 'out of memory'", True),  # (the driver API's failure, NCCL 2.19+)
        (NCCL + "Cuda failure 'out of memory'", True),
        (NCCL + "Failed to CUDA calloc 6291456 bytes", True),
        (NCCL + "Cuda failure 1 'invalid argument'", False),
        ("CUDA error: an illegal memory access was encountered", False),
    ],
)
def test_nccl_out_of_memory_is_told_as_one_and_its_other_failures_are_not(message: str, full: bool) -> None:
    e = torch.distributed.DistBackendError(message)
    assert (out_of_memory.behind(e) is e) is full


def test_an_error_met_while_handling_an_out_of_memory_is_not_told_as_one() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError:
            raise KeyError("a bug in the handler")  # noqa: B904 (chained implicitly, as a bug's would be)
    except KeyError as e:
        assert out_of_memory.behind(e) is None
