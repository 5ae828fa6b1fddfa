"""Shards over HTTP(S) from a real nginx started by ./run serve: training, restarts, resumed reads, TLS."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from conftest import (
    ROOT,
    TINY,
    QuietHandler,
    Server,
    free_port,
    http_server,
    run_cli,
    shards_here,
    train_here,
    wait_until,
    write_shards,
)
from forked import Started

from imagenet_ais import ShardLoader
from imagenet_ais.errors import ConfigError, StorageError
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


def test_serve_refuses_a_directory_without_a_manifest_or_shards(tmp_path: Path) -> None:
    out = run_cli(ROOT / "run", "serve", tmp_path, check=False, env={"SERVE_ROOT": str(tmp_path / "serve")})
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"run: serve: {tmp_path} has no manifest.json and no .tar shards: give a directory of shards (./run shards "
        "convert, or another tool's to index)"
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
    proc = Started(*args, "--log-keys", "--log-every", "1", merged=True)
    metrics = output / "metrics.jsonl"
    wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 5, "5 steps", log=proc.log)
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
    args = ["--data", server.url, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "1"]

    untrusted = train_here(*args, check=False, env={"REQUESTS_CA_BUNDLE": "", "SSL_CERT_FILE": ""})
    assert untrusted.returncode == 1
    assert untrusted.stderr.strip().startswith(f"Error: {server.url}/manifest.json: TLS verification failed")
    assert "REQUESTS_CA_BUNDLE" in untrusted.stderr.strip().splitlines()[-1]

    trusted = train_here(*args, env={"REQUESTS_CA_BUNDLE": str(cert)})
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


@contextlib.contextmanager
def recording(address: str, root: Path | None = None, to: str = "") -> Iterator[tuple[str, list[str | None]]]:
    """Python's HTTP server on ``address`` (a free port), serving ``root``, or redirecting every
    request to ``to``: its URL, and each request's Authorization header (what it was sent)."""
    sent: list[str | None] = []

    class Handler(QuietHandler):
        def send_head(self):  # (GET's and HEAD's)
            sent.append(self.headers.get("Authorization"))
            if not to:
                return super().send_head()
            self.send_response(302)
            self.send_header("Location", f"{to}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None

    with http_server(root, Handler, address) as url:
        yield url, sent


def test_credentials_go_to_the_host_they_are_for_alone(serve, tmp_path: Path, monkeypatch) -> None:
    token = "t0ken-" + "h" * 24
    write_shards(tmp_path / "a", {"train": [4, 4]}, prefix="a-")
    write_shards(tmp_path / "b", {"train": [4]}, prefix="b-")
    mine = serve(tmp_path / "a", SERVE_TOKEN=token)
    monkeypatch.setenv("SHARDS_HTTP_TOKEN", token)
    options = {"image_size": 16, "workers": 1, "device": "cpu"}
    with recording("127.0.0.3", tmp_path / "b") as (other, sent):
        # it was sent to both (and a mixture's workers sent it on with every shard they read)
        says = f"{other}: SHARDS_HTTP_TOKEN would go to 127.0.0.1:{mine.port} and to {other[7:]}: set SHARDS_HTTP_HOST"
        with pytest.raises(ConfigError, match=re.escape(says)):
            ShardLoader([mine.url, other], "train", 4, **options)
        assert sent == [], "nothing sent to the second host"
        monkeypatch.setenv("SHARDS_HTTP_HOST", f"127.0.0.1:{mine.port}")
        with ShardLoader([mine.url, other], "train", 4, epoch_mode="exact", **options) as loader:
            keys = [key for _, _, batch in loader for key in batch]
        assert sorted(key[0] for key in keys) == ["a"] * 8 + ["b"] * 4
        assert sent and not any(sent), "the second host read from without the token"
    # a redirect to another host does not take them along
    monkeypatch.setenv("SHARDS_HTTP_HOST", "127.0.0.1")  # (any port of it)
    with (
        recording("127.0.0.3", tmp_path / "b") as (elsewhere, theirs),
        recording("127.0.0.1", to=elsewhere) as (moved, ours),
    ):
        assert json.loads(HTTPStore(moved).read_bytes("manifest.json"))["splits"]
    assert (ours, theirs) == ([f"Bearer {token}"], [None])


def test_credentials_in_a_url_are_refused_and_not_repeated(tmp_path: Path) -> None:
    secret = "pa55-" + "w" * 12
    write_shards(tmp_path / "shards", {"train": [4], "val": [2]})
    with recording("127.0.0.1", tmp_path / "shards") as (url, sent):
        given = url.replace("http://", f"http://alice:{secret}@") + "/"
        says = f"{url}/: credentials in a location would be written to logs, metrics and config.json: give it "
        says += "without them, and set SHARDS_HTTP_USER and SHARDS_HTTP_PASSWORD (or SHARDS_HTTP_TOKEN) instead"
        with pytest.raises(ConfigError) as refused:
            HTTPStore(given)
        assert str(refused.value) == says
        # (it trained, the password in its log, metrics and config.json)
        out = train_here("--data", given, "--output", tmp_path / "run", *TINY, "--epochs", "1", check=False)
        assert out.returncode == 1 and out.stderr.strip() == f"Error: {says}"
        assert secret not in out.stdout and not (tmp_path / "run").exists()
    assert sent == [], "nothing asked of the server"


def test_one_shard_set_under_two_spellings_of_its_url_is_given_twice(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", {"train": [4]})
    with recording("127.0.0.1", tmp_path / "shards") as (url, _):
        # each was mixed as two sets: every sample trained twice an epoch
        for other in (url.replace("127.0.0.1", "localhost"), f"{url}/./", f"{url}//"):
            with pytest.raises(ConfigError, match=re.escape(f"{other}: given twice in the mixture (as {url}")):
                ShardLoader([url, other], "train", 4, image_size=16, workers=1, device="cpu")
