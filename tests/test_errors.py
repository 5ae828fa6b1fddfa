"""What the CLIs tell in one line (a failure the user can act on) and what keeps its traceback (a bug)."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import pytest
from conftest import TINY, UNSIZED, shards_here, train_here

from imagenet_ais import errors
from imagenet_ais.shards import verify
from imagenet_ais.train import loop


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
