"""Shards over HTTP(S) from a real nginx started by ./run serve: training, restarts, resumed reads, TLS."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import ROOT, TINY, Server, free_port, run_cli, shards_here, train_here, wait_until, write_shards

from imagenet_ais.errors import StorageError
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


def test_serve_serves_this_machine_alone_unless_told_whom(serve, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": [4]})
    plan = run_cli(ROOT / "run", "-n", "serve", data).stdout
    assert "listen 127.0.0.1:8080;" in plan and "allow 127.0.0.0/8; allow ::1; deny all;" in plan, "loopback by default"
    env = {"SERVE_ROOT": str(tmp_path / "elsewhere")}
    wide = run_cli(ROOT / "run", "serve", data, "--addr", "0.0.0.0", "--port", str(free_port()), check=False, env=env)
    assert wide.returncode == 1 and "name who may read in SERVE_ALLOW" in wide.stderr
    assert not (tmp_path / "elsewhere").exists(), "nothing started"
    server: Server = serve(data, SERVE_ALLOW="10.0.0.0/8")  # other networks: this machine may not read
    assert requests.get(f"{server.url}/manifest.json", timeout=10).status_code == 403
    out = train_here("--data", server.url, "--output", tmp_path / "run", *TINY, check=False)
    assert out.returncode == 1 and "refused (403): the server does not let this machine read" in out.stderr


def sha_htpasswd(user: str, password: str) -> str:
    """An htpasswd line nginx reads ({SHA}: base64 of the password's SHA-1)."""
    return f"{user}:{{SHA}}{base64.b64encode(hashlib.sha1(password.encode()).digest()).decode()}\n"


def test_served_with_credentials_only_a_reader_that_sends_them_reads(serve, tmp_path: Path, monkeypatch) -> None:
    data, htpasswd, token = tmp_path / "shards", tmp_path / "htpasswd", "t0ken-" + "k" * 24
    write_shards(data, {"train": [4, 4], "val": [2]})
    htpasswd.write_text(sha_htpasswd("reader", "opensesame"))
    by_token, by_password = serve(data, SERVE_TOKEN=token), serve(data, SERVE_HTPASSWD=str(htpasswd))
    for server in (by_token, by_password):
        assert requests.get(f"{server.url}/manifest.json", timeout=10).status_code == 401
        with pytest.raises(
            StorageError, match=r"refused \(401\): the server asks for credentials: set SHARDS_HTTP_TOKEN"
        ):
            HTTPStore(server.url).read_bytes("manifest.json")
    assert token not in run_cli(ROOT / "run", "-n", "serve", data, env={"SERVE_TOKEN": token}).stdout
    monkeypatch.setenv("SHARDS_HTTP_USER", "reader")
    monkeypatch.setenv("SHARDS_HTTP_PASSWORD", "wrong")
    with pytest.raises(StorageError, match=r"refused \(401\)"):
        HTTPStore(by_password.url).read_bytes("manifest.json")
    monkeypatch.setenv("SHARDS_HTTP_PASSWORD", "opensesame")
    assert json.loads(HTTPStore(by_password.url).read_bytes("manifest.json"))["splits"]
    monkeypatch.delenv("SHARDS_HTTP_USER")
    monkeypatch.setenv("SHARDS_HTTP_TOKEN", token)  # a run's workers send it too
    train_here("--data", by_token.url, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "1")
    assert by_token.gets()["imagenet-train-000001.tar"] >= 1
