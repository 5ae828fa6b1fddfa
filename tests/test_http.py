"""Shards over HTTP(S) from a real nginx started by ./run serve: training, restarts, resumed reads, TLS."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import ROOT, TINY, Server, run_cli, shards_here, train_here, wait_until, write_shards

from imagenet_ais.storage import HTTPStore

UNEVEN = [3, 11, 7, 19, 8]  # 48 training samples: 12 steps per epoch at batch 4


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("mode", ["exact", "resampled"])
def test_train_one_epoch_over_http(mode: str, serve, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    manifest = write_shards(data, {"train": UNEVEN, "val": [6, 6]})
    server = serve(data)
    out = train_here(
        "--data", server.url, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "2",
        "--epoch-mode", mode,
    )  # fmt: skip
    assert "final validation" in out.stdout and "over 12 images" in out.stdout
    gets = server.gets()
    assert gets["manifest.json"] == 1
    assert set(gets) - {"manifest.json"} <= {s.name for split in manifest.splits.values() for s in split.shards}
    assert all(gets[s.name] >= 1 for s in manifest.splits["val"].shards)


def test_serve_is_read_only_and_stop_stops_only_its_own(serve, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": [4]})
    mine, other = serve(data), serve(data)  # other: another SERVE_ROOT, as if another checkout's
    assert requests.put(f"{mine.url}/manifest.json", data=b"{}", timeout=10).status_code == 403
    assert requests.get(f"{mine.url}/manifest.json", timeout=10).json()["format"]
    ranged = requests.get(f"{mine.url}/imagenet-train-000000.tar", headers={"Range": "bytes=10-19"}, timeout=10)
    assert ranged.status_code == 206 and ranged.content == (data / "imagenet-train-000000.tar").read_bytes()[10:20]
    again = run_cli(ROOT / "run", "serve", data, "--port", str(mine.port), check=False, env=mine.env)
    assert again.returncode == 1 and "already serving on port" in again.stderr

    assert "stopped nginx" in mine.stop()
    assert refused(mine.port)
    assert requests.get(f"{other.url}/manifest.json", timeout=10).status_code == 200
    assert "no nginx started by ./run serve is running" in mine.stop()


def test_serve_refuses_a_directory_without_a_manifest(tmp_path: Path) -> None:
    out = run_cli(ROOT / "run", "serve", tmp_path, check=False, env={"SERVE_ROOT": str(tmp_path / "serve")})
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"run: serve: {tmp_path} has no manifest.json: give a directory of converted shards (./run shards convert)"
    )


def test_a_read_cut_off_by_a_server_restart_resumes_where_it_broke_off(serve, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": [200]})
    payload = (data / "imagenet-train-000000.tar").read_bytes()
    server = serve(data, SERVE_RATE="100k")  # so the read is still under way when nginx stops
    store = HTTPStore(server.url, retry_seconds=60)
    with store.open("imagenet-train-000000.tar") as f:
        head = f.read(50_000)
        server.stop()
        restart = threading.Timer(1.0, server.start)  # down for a second: the reader retries meanwhile
        restart.start()
        rest = f.read()
        restart.join()
    assert head + rest == payload
    ranges = [line for line in server.log.read_text().splitlines() if '" 206 ' in line]
    assert ranges, "the rest came with a range request"


@pytest.mark.slow
def test_nginx_stopped_and_restarted_mid_epoch_the_run_completes(serve, tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40] * 6, "val": [8]})  # 240 samples: 60 steps per epoch at batch 4
    server = serve(data, SERVE_RATE="50k")
    args = ["--data", server.url, "--output", output, *TINY, "--epochs", "1", "--workers", "2", "--epoch-mode", "exact"]
    proc = subprocess.Popen(
        [sys.executable, ROOT / "train.py", *map(str, [*args, "--log-keys", "--log-every", "1"])],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    metrics = output / "metrics.jsonl"
    wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 5, "5 training steps")
    server.stop()
    time.sleep(3)
    server.start()
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    records = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 61))
    keys = (output / "keys" / "epoch001-rank0.txt").read_text().split()
    assert len(keys) == len(set(keys)) == 240, "every sample once, none lost to the outage"


@pytest.mark.slow
def test_https_with_a_ca_bundle(serve, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    data = tmp_path / "shards"
    write_shards(data, {"train": [8, 8], "val": [4]})
    server = serve(data, SERVE_CERT=str(cert), SERVE_KEY=str(key))
    assert server.url.startswith("https://")
    args = ["train.py", "--data", server.url, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "1"]

    untrusted = run_cli(*args, check=False, env={"REQUESTS_CA_BUNDLE": "", "SSL_CERT_FILE": ""})
    assert untrusted.returncode == 1
    assert untrusted.stderr.strip().startswith(f"Error: {server.url}/manifest.json: TLS verification failed")
    assert "REQUESTS_CA_BUNDLE" in untrusted.stderr.strip().splitlines()[-1]

    trusted = run_cli(*args, env={"REQUESTS_CA_BUNDLE": str(cert)})
    assert "final validation" in trusted.stdout
    assert server.gets()["imagenet-train-000001.tar"] >= 1


def test_an_http_location_cannot_be_written(serve, tree: Path, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": [4]})
    server: Server = serve(data)
    out = shards_here("convert", tree, server.url, check=False)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"Error: {server.url}: HTTP locations are read-only (write to a directory, then ./run serve it)"
    )
