"""Checkpoints to cloud storage against a real GCS emulator (fake-gcs-server): uploads, outages,
corruption in transit, preemption and resume on a fresh node, upload.sh."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, TINY_ARCH, GCSEmulator, free_port, run_cli, train_here, wait_until, write_shards
from forked import Started

from imagenet_ais.storage import GCSStore, LocalStore, file_crc32c
from imagenet_ais.train import loop, upload
from imagenet_ais.train.config import TrainConfig

UNEVEN = [3, 11, 7, 19, 8]  # 48 samples: 12 steps per epoch at batch 4
LOGGED = [*TINY, "--log-every", "1"]  # (the image size: each test's own)


class FlippingProxy:
    """A loopback TCP proxy that counts upload requests and can flip one byte of a request body."""

    def __init__(self, target_port: int, flip_at: int | None, port: int | None = None):
        self.port, self.target_port, self.flip_at = port or free_port(), target_port, flip_at
        self.client_bytes = b""
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if upstream:
                    self.client_bytes += data[:200]  # enough to read request lines
                    if self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                        i = self.flip_at - seen
                        data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
                    seen += len(data)
                dst.sendall(data)
        except OSError:
            pass  # either side hung up
        finally:
            dst.close()


def big_file(path: Path, size: int = 9 << 20) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_large_checkpoint_goes_up_resumable_and_verified(gcs, tmp_path: Path) -> None:
    proxy = FlippingProxy(gcs.port, flip_at=None)
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
    try:
        store = GCSStore(f"gs://{gcs.make_bucket()}/run")
        ckpt = big_file(tmp_path / "ckpt.pt")
        store.put_file(ckpt, "ckpt-00000001.pt", keep=True, once=True)
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = gcs.endpoint
    assert b"uploadType=resumable" in proxy.client_bytes
    assert store.matches("ckpt-00000001.pt", ckpt)
    with pytest.raises(FileExistsError):  # written once
        store.put_file(ckpt, "ckpt-00000001.pt", keep=True, once=True)


def test_upload_corrupted_in_transit_is_detected_and_removed(tmp_path: Path) -> None:
    binary = ROOT / ".cache" / "bin" / "fake-gcs-server"
    if not binary.exists():
        pytest.skip("fake-gcs-server missing")
    proxy_port = free_port()
    emulator = GCSEmulator(binary, tmp_path / "gcs", external_port=proxy_port)
    emulator.start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.endpoint
        bucket = emulator.make_bucket()
        # on the port the emulator advertises, so the resumable session's PUTs cross it too
        proxy = FlippingProxy(emulator.port, flip_at=5 << 20, port=proxy_port)
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy_port}"
        store = GCSStore(f"gs://{bucket}/run", retry_seconds=5)
        ckpt = big_file(tmp_path / "ckpt.pt")
        with pytest.raises(OSError, match=r"corrupted in transit|differs"):
            store.put_file(ckpt, "ckpt.pt", keep=True)
        assert ckpt.exists(), "the local copy is kept"
        proxy.flip_at = None
        assert not store.exists("ckpt.pt"), "a corrupted object never stays under its name"
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = old or ""
        emulator.stop()


def _train(args: list) -> Started:
    return Started(*args, merged=True)


def test_uploads_survive_an_emulator_outage_and_finish_at_exit(gcs, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [8, 8, 8], "val": [6]})
    dest = f"gs://{gcs.make_bucket()}/run"
    gcs.stop()
    try:
        proc = _train(
            [
                "--data",
                data,
                "--output",
                output,
                *LOGGED,
                "--image-size",
                "32",
                "--epochs",
                "3",
                "--workers",
                "1",
                "--upload",
                dest,
                "--upload-retry-seconds",
                "1",
                "--flush-timeout",
                "120",
            ]
        )

        def flushing() -> bool:  # training is done; its uploads wait in the flush
            return any(line.startswith("waiting up to") for line in proc.log.read_text().splitlines())

        wait_until(proc, flushing, "the flush at the end", log=proc.log)
        gcs.start()
        log, _ = proc.communicate(timeout=300)
    finally:
        if gcs.proc is None:
            gcs.start()
    assert proc.returncode == 0, log
    assert "WARNING: upload of ckpt-00000006.pt" in log and "local copy stays" in log
    assert sorted(p.name for p in output.glob("ckpt-*.pt")) == [
        "ckpt-00000006.pt",
        "ckpt-00000012.pt",
        "ckpt-00000018.pt",
    ]
    store = GCSStore(dest)
    for name in ("ckpt-00000006.pt", "ckpt-00000012.pt", "ckpt-00000018.pt", "metrics.jsonl", "train.log"):
        assert store.exists(name), name
    assert store.matches("ckpt-00000018.pt", output / "ckpt-00000018.pt")
    assert json.loads(store.read_bytes("latest.json"))["checkpoint"] == "ckpt-00000018.pt"


def test_exit_status_says_when_uploads_never_made_it(gcs, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [8]})
    dest = f"gs://{gcs.make_bucket()}/run"
    gcs.stop()
    try:
        proc = train_here(
            "--data",
            data,
            "--output",
            output,
            *LOGGED,
            "--image-size",
            "32",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--upload",
            dest,
            "--upload-retry-seconds",
            "1",
            "--flush-timeout",
            "3",
            check=False,
        )
    finally:
        gcs.start()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "never uploaded" in proc.stderr and "ckpt-00000002.pt" in proc.stderr
    assert (output / "ckpt-00000002.pt").exists()


def test_sigterm_mid_epoch_then_resume_on_a_fresh_node_from_gcs(gcs, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": UNEVEN, "val": [6]})
    dest = f"gs://{gcs.make_bucket()}/run"
    common = [
        "--data",
        data,
        *LOGGED,
        "--image-size",
        "64",
        "--epochs",
        "2",
        "--workers",
        "2",
        "--epoch-mode",
        "exact",
        "--log-keys",
        "--upload",
        dest,
        "--resume",
        "auto",
    ]
    first, second = tmp_path / "node1", tmp_path / "node2"
    proc = _train([*common, "--output", first])
    metrics = first / "metrics.jsonl"
    wait_until(
        proc,
        lambda: metrics.exists() and any(json.loads(r)["step"] >= 15 for r in metrics.read_text().splitlines()),
        "step 15",
        log=proc.log,
    )
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, log
    pointer = json.loads(GCSStore(dest).read_bytes("latest.json"))
    stopped_at = pointer["step"]
    assert 15 <= stopped_at < 24, "stopped inside the second epoch"
    assert "stopped by a signal" in log

    resumed = train_here(*common, "--output", second)  # an empty --output: all from gs://
    assert f"epoch 2, step {stopped_at}" in resumed.stdout
    assert torch.load(second / "last.pt", weights_only=True)["step"] == 24
    steps = [
        json.loads(r)["step"]
        for r in (second / "metrics.jsonl").read_text().splitlines()
        if json.loads(r)["kind"] == "train"
    ]
    assert steps == list(range(1, 25)), "the uploaded metrics continue without a gap or a repeat"
    seen = (first / "keys" / "epoch002-rank0.txt").read_text().split()
    seen += (second / "keys" / "epoch002-rank0.txt").read_text().split()
    assert len(seen) == len(set(seen)) == 48, "no training key twice in the interrupted epoch, none missed"

    # the first node, back with its own older checkpoints, continues from the uploaded newer one
    again = train_here(*common, "--output", first, "--epochs", "3")
    assert f"{dest} holds a newer checkpoint than {first / f'ckpt-{stopped_at:08d}.pt'}" in again.stdout
    assert "epoch 3, step 24" in again.stdout and "WARNING: upload" not in again.stderr
    log = (first / "train.log").read_text()  # the fetched log, and this run's lines after it
    assert f"{dest} holds a newer checkpoint" in log and f"epoch 2, step {stopped_at}" in log
    assert json.loads(GCSStore(dest).read_bytes("latest.json"))["step"] == 36

    # a fresh run (no --resume) would replace that run's uploaded metrics, log and pointer
    fresh = [a for a in common if a not in ("--resume", "auto")]
    refused = train_here(*fresh, "--output", tmp_path / "node3", check=False)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1] == (
        f"Error: {dest} holds a run's uploads (latest.json names ckpt-00000036.pt): continue it with "
        "--resume auto, or use another --upload"
    )
    assert json.loads(GCSStore(dest).read_bytes("latest.json"))["step"] == 36


def test_train_streams_shards_from_gcs_into_the_cache(gcs, tmp_path: Path) -> None:
    data, cache = tmp_path / "shards", tmp_path / "cache"
    manifest = write_shards(data, {"train": UNEVEN, "val": [6]})
    source = f"gs://{gcs.make_bucket()}/imagenet"
    store = GCSStore(source)
    for path in data.iterdir():
        store.put_file(path, path.name, keep=True)
    out = train_here(
        "--data", source, "--output", tmp_path / "run", *LOGGED, "--image-size", "32", "--epochs", "2",
        "--workers", "2", "--epoch-mode", "exact", "--cache-dir", cache,
    )  # fmt: skip
    assert "final validation" in out.stdout and "over 6 images" in out.stdout
    shards = sorted(s.name for split in manifest.splits.values() for s in split.shards)
    assert sorted(p.name for p in cache.rglob("imagenet-*.tar")) == shards
    for path in cache.rglob("imagenet-*.tar"):
        assert path.read_bytes() == (data / path.name).read_bytes()


def test_upload_sh_twice_uploads_nothing_the_second_time(gcs, tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "keys").mkdir(parents=True)
    big_file(results / "ckpt-00000001.pt", 1 << 20)
    (results / "metrics.jsonl").write_text('{"step": 1}\n')
    (results / "keys" / "epoch001-rank0.txt").write_text("a\nb\n")
    dest = f"gs://{gcs.make_bucket()}/results"
    env = {"STORAGE_EMULATOR_HOST": gcs.endpoint}
    first = run_cli(ROOT / "upload.sh", results, dest, env=env).stdout
    assert f"{dest}: 3 uploaded, 0 already there" in first
    second = run_cli(ROOT / "upload.sh", results, dest, env=env).stdout
    assert f"{dest}: 0 uploaded, 3 already there" in second
    (results / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    third = run_cli(ROOT / "upload.sh", results, dest, env=env).stdout
    assert "uploaded metrics.jsonl" in third and "1 uploaded, 2 already there" in third
    assert GCSStore(dest).matches("ckpt-00000001.pt", results / "ckpt-00000001.pt")
    assert file_crc32c(results / "ckpt-00000001.pt")


def test_upload_sh_sends_last_and_best_as_pointers_to_their_checkpoint(tmp_path: Path) -> None:
    # last.pt and best.pt, hard links to checkpoints, went up as two more full copies
    results, dest = tmp_path / "results", tmp_path / "dest"
    results.mkdir()
    for step in (1, 2):
        big_file(results / f"ckpt-0000000{step}.pt", 1 << 20)
    os.link(results / "ckpt-00000002.pt", results / "last.pt")
    os.link(results / "ckpt-00000001.pt", results / "best.pt")
    uploaded, _ = upload.sync(results, str(dest))
    assert sorted(p.name for p in dest.iterdir()) == [
        "best.json",
        "ckpt-00000001.pt",
        "ckpt-00000002.pt",
        "latest.json",
    ]
    assert "latest.json (for last.pt, the same file as ckpt-00000002.pt)" in uploaded
    assert json.loads((dest / "best.json").read_text())["checkpoint"] == "ckpt-00000001.pt"
    fetched = upload.fetch_latest(str(dest), tmp_path / "fresh")  # a --resume auto on a fresh node
    assert fetched and fetched.read_bytes() == (results / "last.pt").read_bytes()
    assert upload.sync(results, str(dest))[0] == [], "nothing the second time"


def test_no_gcs_call_reaches_outside_the_run_prefix(gcs, tmp_path: Path) -> None:
    store, path = GCSStore(f"gs://{gcs.make_bucket()}/run"), tmp_path / "last.pt"
    path.write_bytes(b"weights")
    for name in ("../other-run/last.pt", "/last.pt", ""):
        with pytest.raises(ValueError, match="invalid object name"):
            store.matches(name, path)
        with pytest.raises(ValueError, match="invalid object name"):
            store.put_file(path, name)


def tiny_synthetic(output: Path, upload_to: Path, **changes: object) -> TrainConfig:
    """A few steps of a tiny model on random data, in this process, uploading to ``upload_to``."""
    cfg = TrainConfig(
        output=str(output), upload=str(upload_to), synthetic=True, arch=TINY_ARCH, image_size=32, batch_size=2,
        warmup_epochs=0, epochs=1, resume="auto", upload_retry_seconds=1, flush_timeout=30,
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


@pytest.mark.parametrize(
    ("pointer", "says"),
    [
        ('{"checkpoint": "train.lock", "step": 9}', 'is {"checkpoint": "train.lock", "step": 9}: a run\'s pointer'),
        ('{"checkpoint": "ckpt-00000009.pt", "step": "9"}', "names one of its ckpt-<8-digit step>.pt and that step"),
        ('{"step": 9}', 'is {"step": 9}: a run\'s pointer names'),
        ("[9]", "is [9]: a run's pointer names"),
        ("{not json", "not JSON (Expecting property name"),
        ('{"checkpoint": "ckpt-00000009.pt", "step": 9}', "names ckpt-00000009.pt, which is not there"),
    ],
)
def test_a_latest_json_naming_no_checkpoint_of_its_location_is_one_line(
    pointer: str, says: str, tmp_path: Path
) -> None:
    # One naming train.lock was fetched over OUTPUT/train.lock: a second run into it was no longer refused.
    uploads, output = tmp_path / "up", tmp_path / "run"
    uploads.mkdir()
    (uploads / "latest.json").write_text(pointer)
    (uploads / "train.lock").write_text("another run's lock\n")
    with pytest.raises(upload.BadPointer, match=r"latest\.json.*" + re.escape(says)) as e:
        loop.train(tiny_synthetic(output, uploads, max_steps=1))
    assert "\n" not in str(e.value) and "fix or remove it" in str(e.value)
    assert not output.exists(), "nothing fetched into it: the start failed, and leaves no folder it made"
    if "not there" not in says:  # a fresh run there is refused by the same check
        with pytest.raises(ValueError, match=re.escape(says)):
            loop.train(tiny_synthetic(tmp_path / "fresh", uploads, max_steps=1, resume=None))


def test_files_fetched_for_a_resume_get_the_runs_usual_mode(tmp_path: Path) -> None:
    uploads = tmp_path / "up"
    loop.train(tiny_synthetic(tmp_path / "first", uploads, max_steps=2))
    loop.train(tiny_synthetic(tmp_path / "second", uploads, max_steps=3))  # a fresh node: fetched
    for name in ("ckpt-00000002.pt", "metrics.jsonl"):
        assert (tmp_path / "second" / name).stat().st_mode & 0o777 == 0o644, name
    # the same run, continued on another node: it keeps its id, and its location
    assert run_of(tmp_path / "second") == run_of(tmp_path / "first") == run_of(uploads)


def run_of(folder: Path) -> str:
    return json.loads((folder / "run.json").read_text())["run"]


def test_two_runs_given_one_upload_location_never_mix_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Two runs with one --upload: one ended with exit 0 while the uploaded metrics.jsonl was the
    # other's; another time ckpt-6 came from one run and ckpt-12 with latest.json from the other.
    uploads, first, second = tmp_path / "up", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    (first / "run.json").write_text('{"run": "0123abcd"}')  # the first run started, uploaded nothing yet
    upload.claim(LocalStore(uploads), "0123abcd")
    with pytest.raises(upload.Claimed) as e:
        loop.train(tiny_synthetic(second, uploads, max_steps=2, resume=None))
    assert str(e.value).startswith(f"{uploads}/run.json: the location is another run's (run 0123abcd, started ")
    assert "\n" not in str(e.value) and str(e.value).endswith(
        "continue that run with --resume auto, or use another --upload"
    )
    assert sorted(p.name for p in uploads.iterdir()) == ["run.json"]  # nothing of the second run's went up
    # the first run, restarted into its --output (it died before its first checkpoint), is that run
    loop.train(tiny_synthetic(first, uploads, max_steps=2, resume=None))
    assert {"ckpt-00000002.pt", "latest.json", "metrics.jsonl"} <= {p.name for p in uploads.iterdir()}
    assert "uploader" not in {t.name for t in threading.enumerate()}, "a run leaves no thread behind"
    assert run_of(uploads) == "0123abcd" and json.loads((uploads / "latest.json").read_text())["run"] == "0123abcd"
    assert not second.exists(), "the refused start left no folder of its own behind"
    # upload.sh from another run's output into it is refused the same way
    second.mkdir()
    (second / "run.json").write_text('{"run": "4567cdef"}')
    (second / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(upload.Claimed, match="the location is another run's"):
        upload.sync(second, str(uploads))
    # a location taken over mid-run (its run.json replaced): nothing more goes up, and the run says so
    with upload.Uploader(str(uploads), "0123abcd", first, retry_seconds=1) as uploader:
        (uploads / "run.json").write_text('{"run": "ffff0000"}')
        uploader.submit(first / "metrics.jsonl")
        assert uploader.flush(5) == ["metrics.jsonl"]
    assert "run.json: the location is another run's (run ffff0000" in capsys.readouterr().err


def test_a_nodes_stale_last_pt_alone_does_not_beat_a_newer_upload(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A node holding last.pt (no ckpt-*.pt) retrained steps the upload had, then failed for ever on FileExistsError
    uploads, first, stale = tmp_path / "up", tmp_path / "first", tmp_path / "stale"
    loop.train(tiny_synthetic(first, uploads, max_steps=4))
    stale.mkdir()
    shutil.copy(first / "last.pt", stale / "last.pt")  # step 4, alone
    loop.train(tiny_synthetic(first, uploads, max_steps=8))  # the run goes on elsewhere: the upload is at 8
    capsys.readouterr()
    outcome = loop.train(tiny_synthetic(stale, uploads, max_steps=10))
    said = capsys.readouterr().out
    assert f"{uploads} holds a newer checkpoint than {stale / 'last.pt'}: continuing from ckpt-00000008.pt" in said
    assert "epoch 1, step 8" in said and outcome == {**outcome, "step": 10, "exit_code": 0}


def test_a_full_upload_location_never_stops_training_and_a_rerun_uploads_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A full tmpfs as --upload stopped training and kept 17 .partial files; a rerun with --resume
    # auto then said "already trained", exit 0, with no checkpoint uploaded at all.
    if not shutil.which("unshare") or run_cli("unshare", "-rm", "true", check=False).returncode:
        pytest.skip("no unshare, or user namespaces are not allowed here")
    uploads, output = tmp_path / "up", tmp_path / "run"
    uploads.mkdir()
    train = [sys.executable, ROOT / "train.py", "--synthetic", *LOGGED, "--batch-size", "2", "--image-size", "32"]
    train += ["--epochs", "2", "--epoch-size", "4", "--output", output, "--upload", uploads]
    train += ["--upload-retry-seconds", "1", "--flush-timeout", "3"]
    # the location on a 512 KiB tmpfs (in a mount namespace of the run's own), listed after the run
    full = 'mount -t tmpfs -o size=512k tmpfs "$0" && "$@"; code=$?; echo "left: $(ls -A "$0")"; exit $code'
    proc = run_cli("unshare", "-rm", "sh", "-c", full, uploads, *train, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "final validation" not in proc.stdout and (output / "ckpt-00000004.pt").exists()  # trained to the end
    assert "WARNING: upload of ckpt-00000002.pt" in proc.stderr and "Traceback" not in proc.stderr
    assert "ERROR: never uploaded to" in proc.stderr and "ckpt-00000004.pt" in proc.stderr
    left = proc.stdout.strip().splitlines()[-1].split()[1:]
    assert not [name for name in left if name.endswith(".partial")], left  # snapshots stay beside --output
    # the same run again, the location writable now: its missing uploads go up, then it is done
    outcome = loop.train(tiny_synthetic(output, uploads, epochs=2, epoch_size=4))
    said = capsys.readouterr().out
    assert "its run has trained 2 epochs, --epochs 2 asks no more" in said and outcome["exit_code"] == 0
    assert f"uploaded to {uploads} what was missing or behind there: ckpt-00000004.pt, metrics.jsonl" in said
    assert json.loads((uploads / "latest.json").read_text())["checkpoint"] == "ckpt-00000004.pt"
    assert (uploads / "metrics.jsonl").read_bytes() == (output / "metrics.jsonl").read_bytes()
    assert "uploader" not in {t.name for t in threading.enumerate()}, "catching up leaves no thread behind"
    again = loop.train(tiny_synthetic(output, uploads, epochs=2, epoch_size=4))
    assert again["exit_code"] == 0 and "behind there: train.log\n" in capsys.readouterr().out  # its new line only
