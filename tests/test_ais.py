"""AIStore for real: a local aisnode cluster, ais:// shards written, verified, streamed and survived."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, free_port, run_cli, shards_here, train_here, wait_until, write_shards
from forked import Started

from imagenet_ais.errors import ConfigError
from imagenet_ais.loader import ShardLoader
from imagenet_ais.shards import convert
from imagenet_ais.shards.manifest import is_demo_at
from imagenet_ais.storage import AISStore, open_store
from imagenet_ais.storage import ais as ais_storage

# the AIStore the tests share (a session fixture): started once, in one of ./run test's processes
pytestmark = pytest.mark.xdist_group("ais")

TINY8 = [*TINY, "--batch-size", "8"]


def bucket_url(prefix: str = "imagenet") -> str:
    return f"ais://test-{uuid.uuid4().hex[:8]}/{prefix}"


@pytest.fixture
def env(ais, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("AIS_ENDPOINT", ais.endpoint)
    return {"AIS_ENDPOINT": ais.endpoint}


def objects(url: str) -> list[str]:
    return AISStore(url).list()


@pytest.mark.parametrize("mode", ["exact", "resampled"])
def test_convert_verify_and_train_from_ais(mode: str, tree: Path, env: dict, tmp_path: Path) -> None:
    url = bucket_url()
    out = shards_here("convert", tree, url, "--maxcount", "10", "--workers", "2", env=env)
    assert "3 rejected" in out.stdout
    names = objects(url)
    manifest = json.loads(AISStore(url).read_bytes("manifest.json"))
    shards = [s["name"] for split in manifest["splits"].values() for s in split["shards"]]
    assert sorted(names) == sorted([*shards, "manifest.json"]), "exactly the manifest's shards, no leftovers"
    assert "all shards match" in shards_here("verify", url, env=env).stdout
    assert "imagenet-train-{000000..000007}.tar" in shards_here("summary", url, env=env).stdout
    # synth's pictures, known from the manifest in AIStore too: ./run gives them the demo's settings (docs/storage.md's
    # playground step; test_run checks ./run's side on a local copy)
    assert is_demo_at(url) and not is_demo_at(bucket_url())

    output = tmp_path / "run"
    train_here(
        "--data",
        url,
        "--output",
        output,
        *TINY8,
        "--epochs",
        "1",
        "--workers",
        "2",
        "--epoch-mode",
        mode,
        "--log-keys",
        env=env,
    )
    keys = (output / "keys" / "epoch001-rank0.txt").read_text().split()
    assert len(keys) == 72 // 8 * 8
    if mode == "exact":
        assert len(set(keys)) == len(keys) == 72
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "val"]
    assert val and val[-1]["samples"] == 24
    assert all(r["read_errors"] == 0 and r["skipped"] == 0 for r in records if r["kind"] == "train")


@pytest.mark.slow
def test_the_playground_says_what_it_starts_as_it_goes(ais) -> None:
    # ./run ais-up: 20 s of silence
    said = (ais.root / "up.log").read_text().splitlines()
    assert said[0].startswith(
        f"AIStore playground in {ais.root}: starting aisnode as 1 proxy and 1 target on 127.0.0.1:"
    )
    assert said[1].startswith("waiting for the targets to join") and re.fullmatch(r"up in \d+s", said[2]), said
    again: list[str] = []
    ais.up(targets=1, echo=again.append)
    assert again == [f"AIStore playground in {ais.root}: already running"]


def test_training_survives_a_killed_and_restarted_target(tree: Path, ais, env: dict, tmp_path: Path) -> None:
    url = bucket_url()
    shards_here("convert", tree, url, "--maxcount", "4", "--workers", "2", env=env)
    output = tmp_path / "run"
    args = [
        "--data",
        url,
        "--output",
        output,
        *TINY8,
        "--epochs",
        "4",
        "--workers",
        "2",
        "--shuffle-buffer",
        "8",
        "--log-every",
        "1",
        "--resume",
        "auto",
    ]
    proc = Started(*args, env=env, merged=True)
    metrics = output / "metrics.jsonl"
    wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, "3 steps", log=proc.log)
    target = next(n for n in ais.nodes() if n.role == "target")
    ais.stop_node(target, signal.SIGKILL)
    time.sleep(3)  # the run goes on reading into a dead target for a while
    ais.start_node(target)
    ais.wait_healthy()
    log, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:  # a run that gave up must say why, and --resume auto must finish it
        assert "Error" in log, log
        train_here(*args, env=env)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "val"][-1] == 4
    assert torch.load(output / "last.pt", weights_only=True)["step"] == 4 * (72 // 8)


def test_a_read_cut_off_by_a_target_restart_resumes_where_it_broke_off(ais, env: dict, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(64 << 20))  # more than the sockets hold: the read is under way when the target dies
    store = AISStore(bucket_url())
    store.put_file(src, "big.bin", keep=True)
    target = next(n for n in ais.nodes() if n.role == "target")
    with store.open("big.bin") as f:
        head = f.read(1 << 20)
        ais.stop_node(target, signal.SIGKILL)
        restart = threading.Timer(1.0, ais.start_node, [target])  # down for a second: the reader retries
        restart.start()
        rest = f.read()
        restart.join()
        resumed = f.resumed  # type: ignore[attr-defined]
    ais.wait_healthy()
    assert head + rest == src.read_bytes()
    assert resumed >= 1, "the rest came with a second, ranged GET"


def test_a_resumed_read_that_fails_is_a_one_line_oserror(ais, env: dict, tmp_path: Path) -> None:
    """Raised mid-read, as in a worker process reading a shard back: the SDK's error would not
    come back to the parent (it cannot be unpickled), this one names the object."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(64 << 20))
    store = AISStore(bucket_url())
    store.put_file(src, "big.bin", keep=True)
    target = next(n for n in ais.nodes() if n.role == "target")
    with store.open("big.bin") as f:
        f.read(1 << 20)
        ais.stop_node(target, signal.SIGKILL)  # the GET breaks off
        ais.start_node(target)
        ais.wait_healthy()
        store.delete("big.bin")  # so the rest, asked for again, is not there
        with pytest.raises(OSError, match=r"/big\.bin: AIStore answered 404") as caught:
            f.read()
    assert "\n" not in str(caught.value)
    assert pickle.loads(pickle.dumps(caught.value)).args == caught.value.args


def test_killed_upload_resumes_to_exactly_the_manifest_shards(tree: Path, env: dict) -> None:
    url = bucket_url("killed")
    args = [tree, url, "--maxcount", "1", "--workers", "1", "--seed", "9"]
    proc = subprocess.Popen(
        [sys.executable, ROOT / "imagenet_shards.py", "convert", *map(str, args)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # uploaded as each shard finishes
    wait_until(proc, lambda: len([n for n in objects(url) if n.endswith(".tar")]) >= 5, "5 shards uploaded")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "manifest.json" not in objects(url)

    shards_here("convert", *args, env=env)
    manifest = json.loads(AISStore(url).read_bytes("manifest.json"))
    shards = sorted(s["name"] for split in manifest["splits"].values() for s in split["shards"])
    assert len(shards) == 75 + 24  # one per input file; the 3 unreadable ones leave valid empty shards
    assert sorted(objects(url)) == sorted([*shards, "manifest.json"])
    assert "all shards match" in shards_here("verify", url, env=env).stdout


def test_a_location_the_cluster_refuses_is_a_one_line_error(tree: Path, env: dict) -> None:
    out = shards_here("convert", tree, "ais://no:colons/x", check=False, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (  # the first object convert writes: its lock
        "Error: ais://no:colons/x/_convert.lock: AIStore answered 400: bucket name is invalid: "
        "may only contain letters, numbers, dashes (-), underscores (_), and dots (.)"
    )


def _put(url: str, src: Path) -> None:
    AISStore(url).put_file(src, "obj")


def test_a_refused_upload_comes_back_from_a_worker_process_as_an_oserror(env: dict, tmp_path: Path) -> None:
    src = tmp_path / "obj"
    src.write_bytes(b"payload")
    with (
        ProcessPoolExecutor(1) as pool,  # the shard converter's workers upload like this
        pytest.raises(OSError, match=r"^ais://no:colons/obj: AIStore answered 400"),
    ):
        pool.submit(_put, "ais://no:colons", src).result()


def test_large_objects_go_up_in_parts_and_read_back(env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AISStore, "MULTIPART_THRESHOLD", 1 << 20)
    monkeypatch.setattr(AISStore, "MULTIPART_PART", 300 << 10)
    store = AISStore(bucket_url("big"))
    payload = os.urandom(3 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(payload)
    store.put_file(src, "big.bin")
    assert not src.exists()
    assert store.size("big.bin") == len(payload)
    assert store.read_bytes("big.bin") == payload
    with store.open("big.bin") as f:
        assert f.read() == payload


def test_an_upload_is_checked_by_the_target_not_read_back(
    env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AISStore(bucket_url())
    payload = os.urandom(1 << 20)
    src = tmp_path / "shard.tar"
    src.write_bytes(payload)

    def no_read_back(self: AISStore, name: str) -> None:
        raise AssertionError(f"{name} was read back")

    with monkeypatch.context() as m:
        m.setattr(AISStore, "open", no_read_back)
        store.put_file(src, "shard.tar", keep=True)
    assert store.read_bytes("shard.tar") == payload


class CountingRelay:
    """A TCP relay on loopback to ``port`` that counts the bytes its clients send through it."""

    def __init__(self, port: int):
        self.port, self.sent = port, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                self.sent += len(data) if count else 0
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.mark.parametrize("how", ["whole", "in parts"])
def test_an_upload_sends_its_bytes_to_the_target_not_to_the_proxy(
    how: str, ais, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "in parts":
        monkeypatch.setattr(AISStore, "MULTIPART_THRESHOLD", 1 << 20)
        monkeypatch.setattr(AISStore, "MULTIPART_PART", 512 << 10)
    relay = CountingRelay(int(ais.endpoint.rsplit(":", 1)[1]))  # in front of the proxy; targets are direct
    url, payload = bucket_url(), os.urandom(4 << 20)
    src = tmp_path / "shard.tar"
    src.write_bytes(payload)
    try:
        monkeypatch.setenv("AIS_ENDPOINT", relay.endpoint)
        AISStore(url).put_file(src, "shard.tar", keep=True)
    finally:
        relay.close()
    assert relay.sent < 64 << 10, f"{relay.sent} bytes went to the proxy for a 4 MiB upload"
    monkeypatch.setenv("AIS_ENDPOINT", ais.endpoint)
    assert AISStore(url).read_bytes("shard.tar") == payload


def test_a_stored_copy_whose_checksum_differs_is_deleted_and_the_upload_fails(
    env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as if the bytes had changed on the way: the target's checksum of them is not ours
    monkeypatch.setattr(ais_storage, "file_checksum", lambda path, kind: "0" * 16)
    monkeypatch.setattr(AISStore, "PUT_TRIES", 2)
    store = AISStore(bucket_url())
    src = tmp_path / "shard.tar"
    src.write_bytes(os.urandom(100_000))
    with pytest.raises(OSError, match="stored copy differs") as caught:
        store.put_file(src, "shard.tar", keep=True)
    assert "\n" not in str(caught.value)
    assert not store.exists("shard.tar")


def test_a_playground_stopped_again_says_none_runs(tmp_path: Path) -> None:
    # ./run ais-down twice said "stopped" twice
    out = run_cli("tools/ais_local.py", "--root", tmp_path / "ais", "down").stdout
    assert out.strip() == f"no AIStore playground is running in {tmp_path / 'ais'}"


def test_the_library_finds_the_running_playground_as_run_does(
    ais, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ./run took AIS_ENDPOINT from the playground, ShardLoader said "set AIS_ENDPOINT" (issue 64)
    monkeypatch.delenv("AIS_ENDPOINT", raising=False)
    monkeypatch.setenv("AIS_ROOT", str(ais.root))  # ./run's setting: its playground's root
    write_shards(tmp_path / "shards", {"train": [6, 6]})
    url = bucket_url()
    store = AISStore(url)
    for path in sorted((tmp_path / "shards").iterdir()):
        store.put_file(path, path.name, keep=True)
    with ShardLoader(url, "train", 4, image_size=16, workers=1, epoch_mode="exact", device="cpu") as loader:
        assert sum(len(batch.labels) for batch in loader) == 12
    assert "AIS_ENDPOINT" not in os.environ, "a library sets nothing for the rest of the process"


def test_missing_endpoint_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIS_ENDPOINT", raising=False)
    monkeypatch.setenv("AIS_ROOT", str(tmp_path / "ais"))  # no playground runs there
    with pytest.raises(ConfigError) as caught:
        open_store("ais://b/p")
    assert str(caught.value) == (
        "ais://b/p: set AIS_ENDPOINT to the cluster's URL (e.g. http://aistore-proxy:51080), "
        "or start the local playground with ./run ais-up"
    )


def test_read_back_finds_a_stored_shard_that_its_checksum_vouched_for(
    tree: Path, env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bytes change before the target checksums them (as a storage that corrupts, then
    # checksums what it holds, would do): the target's checksum agrees with the bad copy and
    # only --read-back finds it. The converter's worker processes are forked: they get the patch.
    put_file = AISStore.put_file

    def corrupt_then_put(self: AISStore, src: Path, name: str, **kw: bool) -> None:
        if name.endswith(".tar"):
            data = bytearray(src.read_bytes())
            data[len(data) // 2] ^= 0xFF
            src.write_bytes(bytes(data))
        put_file(self, src, name, **kw)

    monkeypatch.setattr(AISStore, "put_file", corrupt_then_put)
    blind = bucket_url()
    convert.convert(tree, blind, ["train"], 10, int(1e9), 1, 0)
    assert [o for o in objects(blind) if o.endswith(".tar")], "the checksum alone lets the bad copies through"
    checked = bucket_url()
    with pytest.raises(
        OSError, match=r"/imagenet-train-\d+\.tar: read back, it differs from the shard written; deleted"
    ):
        convert.convert(tree, checked, ["train"], 10, int(1e9), 1, 0, read_back=True)
    assert not [o for o in objects(checked) if o.endswith(".tar")]


def test_an_unreachable_endpoint_is_one_line_while_the_sdk_retries(tmp_path: Path) -> None:
    # the SDK logged each retry and then 4 chained tracebacks (79 lines) before our one-line error
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cmd = [sys.executable, ROOT / "imagenet_shards.py", "verify", "ais://demo/shards"]
    env = {**os.environ, "AIS_ENDPOINT": endpoint}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) as proc:
        first = proc.stderr.readline()  # type: ignore[union-attr]
        time.sleep(3)  # two more tries (1-2 s apart): said once, not once per try
        proc.kill()
        rest = proc.stderr.read()  # type: ignore[union-attr]
    assert first == f"note: AIStore at {endpoint}: [Errno 111] Connection refused; retrying for up to a minute\n"
    assert rest == "", rest
