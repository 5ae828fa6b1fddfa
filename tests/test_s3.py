"""``s3://`` against two real S3-compatible servers: AIStore's own ``/s3`` API (the playground)
and moto's S3 server, through boto3 and the standard AWS settings."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ROOT, TINY, free_port, run_cli, shards_here, train_here, wait_until

from imagenet_ais.errors import AlreadyThere, NotFound, StorageError
from imagenet_ais.storage import S3Store, open_store
from imagenet_ais.storage import s3 as s3_storage

pytestmark = pytest.mark.xdist_group("ais")


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server (PyPI's moto[s3], served by flask) on a free loopback port, for this module."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"  # (a pipe would fill with its request lines)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
        except OSError:
            return False
        return True

    wait_until(proc, answers, "moto's S3 server", timeout=60, poll=0.2, log=log)
    yield endpoint
    proc.terminate()
    proc.wait()


@pytest.fixture(params=["aistore", "moto"])
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[], str]:
    """The standard AWS settings pointed at the server; a function that makes a new bucket there."""
    if request.param == "aistore":
        from aistore.sdk import Client

        ais = request.getfixturevalue("ais")
        endpoint = f"{ais.endpoint}/s3"

        def make_bucket() -> str:
            name = f"s3-{uuid.uuid4().hex[:8]}"
            Client(ais.endpoint).bucket(name).create()
            return name
    else:
        endpoint = request.getfixturevalue("moto_endpoint")

        def make_bucket() -> str:
            name = f"s3-{uuid.uuid4().hex[:8]}"
            s3_storage._client().create_bucket(Bucket=name)
            return name

    for key, value in {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return make_bucket


def test_objects_go_up_verified_once_and_come_back_whole(server: Callable[[], str], tmp_path: Path) -> None:
    store = open_store(f"s3://{server()}/runs/r1")
    assert isinstance(store, S3Store)
    src = tmp_path / "ckpt.pt"
    src.write_bytes(bytes(range(256)) * 12_000)  # 3 MB
    store.put_file(src, "ckpt.pt", keep=True)
    assert store.exists("ckpt.pt") and store.size("ckpt.pt") == src.stat().st_size
    assert store.read_bytes("ckpt.pt") == src.read_bytes() and store.matches("ckpt.pt", src)
    other = tmp_path / "other.pt"
    other.write_bytes(b"another run's")
    with pytest.raises(AlreadyThere):
        store.put_file(other, "ckpt.pt", keep=True, once=True)
    assert store.read_bytes("ckpt.pt") == src.read_bytes(), "once: never replaced"
    assert not store.matches("ckpt.pt", other)
    store.write_bytes("sub/latest.json", b"{}")
    assert store.list() == ["ckpt.pt", "sub/latest.json"] and store.list("sub/") == ["sub/latest.json"]
    store.delete("sub/latest.json")
    assert not store.exists("sub/latest.json")
    with pytest.raises(NotFound, match=r"/runs/r1/missing\.pt: not found"):
        store.read_bytes("missing.pt")
    with pytest.raises(NotFound, match="no such bucket"):
        open_store("s3://no-such-bucket-here/x").list()


def test_an_upload_the_server_stored_otherwise_is_deleted_and_said(
    server: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(f"s3://{server()}/runs")
    src = tmp_path / "ckpt.pt"
    src.write_bytes(b"x" * 100_000)
    # our side of the comparison made wrong: what the server says it stored no longer matches
    monkeypatch.setattr(s3_storage, "file_checksum", lambda path, kind: "00" * 32)
    with pytest.raises(StorageError, match=r"stored object differs from .* \((sha256|xxhash2)\); deleted"):
        store.put_file(src, "ckpt.pt")
    assert not store.exists("ckpt.pt") and not src.exists(), "nothing left where a good one is expected"


def test_a_read_cut_off_midway_goes_on_from_where_it_stopped(server: Callable[[], str], tmp_path: Path) -> None:
    store = open_store(f"s3://{server()}/shards")
    data = bytes(range(256)) * 40_000  # 10 MB
    store.write_bytes("a.tar", data)
    with store.open("a.tar") as f:
        first = f.read(3_000_000)
        f.raw.body.close()  # type: ignore[attr-defined]  # the connection gone
        rest = f.read()
    assert first + rest == data and f.raw.resumed == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("server", ["aistore"], indirect=True)  # (the store's calls are tested on both above)
def test_convert_verify_train_and_upload_through_s3(server: Callable[[], str], tree: Path, tmp_path: Path) -> None:
    bucket = server()
    data, runs = f"s3://{bucket}/imagenet", f"s3://{bucket}/runs"
    shards_here("convert", tree, data, "--maxcount", "10", "--workers", "2")
    assert "all shards match" in shards_here("verify", data).stdout
    assert "imagenet-train-{000000..000007}.tar" in shards_here("summary", data).stdout
    shards_here("preload", data, tmp_path / "local")
    assert "all shards match" in shards_here("verify", tmp_path / "local").stdout
    output, cache = tmp_path / "run", tmp_path / "cache"
    out = train_here(
        "--data", data, "--output", output, *TINY, "--batch-size", "8", "--epochs", "1", "--workers", "2",
        "--epoch-mode", "exact", "--cache-dir", cache, "--upload", runs,
    )  # fmt: skip
    assert "final validation" in out.stdout and "over 24 images" in out.stdout
    assert len(list(cache.rglob("imagenet-train-*.tar"))) == 8, "the shards kept on the node's disk"
    uploaded = open_store(runs)
    latest = json.loads(uploaded.read_bytes("latest.json"))
    assert uploaded.matches(latest["checkpoint"], output / latest["checkpoint"])
    (output / "notes.txt").write_text("kept\n")
    synced = run_cli(ROOT / "upload.sh", output, f"{runs}-copy").stdout  # (a process: upload.sh is the point)
    assert "notes.txt" in synced and open_store(f"{runs}-copy").read_bytes("notes.txt") == b"kept\n"
