"""./run serve's own guarantees, against a real nginx: it binds only the address given, serves
only what lies inside its folder, never as root, and refuses a setting it cannot honour in one line."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from conftest import ROOT, child_pids, free_port, readable_to_nobody, run_cli, write_shards

ROOTLESS = pytest.mark.skipif(os.geteuid() != 0, reason="as root only: otherwise nginx's workers are the caller")


@pytest.fixture
def run_serve(tmp_path: Path) -> Iterator[Callable[..., tuple[int, str]]]:
    """``./run serve DATA ARGS`` with these settings on a free port: its status and stderr; what
    it started is stopped afterwards. DATA is made readable to nginx's workers, unless ``public``
    is false."""
    env = {"SERVE_ROOT": str(tmp_path / "serve"), "SERVE_PORT": str(free_port())}
    moved: list[Path] = []

    def run(data: Path, *args: str, public: bool = True, **settings: str) -> tuple[int, str]:
        if public and os.geteuid() == 0:
            moved.append(readable_to_nobody(data))
        proc = run_cli(ROOT / "run", "serve", data, *args, env={**env, **settings}, check=False)
        return proc.returncode, proc.stderr

    yield run
    run_cli(ROOT / "run", "serve", "--stop", env=env)
    for folder in moved:
        shutil.rmtree(folder)


def refused(answer: tuple[int, str], *said: str) -> bool:
    status, err = answer
    return status == 1 and len(err.splitlines()) == 1 and err.startswith("run: serve: ") and all(s in err for s in said)


@pytest.mark.parametrize(
    "addr", ["127.0.0.1:18961; listen 0.0.0.0", "127.0.0.1; allow all;", "127.0.0.1:8080", "127.0.0.1 ssl"]
)
@pytest.mark.parametrize("given", ["--addr", "SERVE_ADDR"])
def test_an_address_that_is_not_a_bare_host_is_refused(given: str, addr: str, run_serve, tmp_path: Path) -> None:
    # pasted into nginx.conf: '127.0.0.1:18961; listen 0.0.0.0' passed the loopback check and
    # served every address, 'allow all;' anyone
    write_shards(tmp_path / "shards", {"train": [4]})
    if given == "--addr":
        answer = run_serve(tmp_path / "shards", "--addr", addr)
    else:
        answer = run_serve(tmp_path / "shards", SERVE_ADDR=addr)
    assert refused(answer, given, "--port"), answer
    assert not list((tmp_path / "serve").rglob("nginx.conf")), "nothing written, nothing started"


def test_links_out_of_the_folder_are_not_followed_and_no_worker_is_root(serve, tmp_path: Path) -> None:
    # /etclink/passwd (a link to /etc) answered 200, from workers running as root
    data = tmp_path / "shards"
    write_shards(data, {"train": [4, 4]})
    (data / "etclink").symlink_to("/etc")
    (data / "imagenet-train-000001.tar").unlink()
    (data / "imagenet-train-000001.tar").symlink_to("/etc/passwd")  # a shard that is a link out
    server = serve(data)
    assert requests.get(f"{server.url}/imagenet-train-000000.tar", timeout=10).status_code == 200
    for path in ("etclink/passwd", "imagenet-train-000001.tar"):
        assert requests.get(f"{server.url}/{path}", timeout=10).status_code in (403, 404), path
    master = int((server.log.parent / "nginx.pid").read_text())
    workers = child_pids(master)
    assert workers and all(uid(pid) != 0 for pid in workers), "nginx's workers run as someone else than root"


def uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


@ROOTLESS
def test_a_folder_its_workers_cannot_read_is_refused(run_serve, tmp_path: Path) -> None:
    # as root the workers run as nobody: pytest's temporary folders (0700) do not let them in
    write_shards(tmp_path / "shards", {"train": [4]})
    answer = run_serve(tmp_path / "shards", public=False)
    assert refused(answer, "nobody", str(tmp_path / "shards" / "manifest.json"))


@pytest.mark.parametrize("allow", [" ", ",", " , ,"])
def test_a_blank_serve_allow_is_refused(allow: str, run_serve, tmp_path: Path) -> None:
    # it served no one, without a word (empty is this machine alone: the default)
    write_shards(tmp_path / "shards", {"train": [4]})
    assert refused(run_serve(tmp_path / "shards", SERVE_ALLOW=allow), "SERVE_ALLOW")


def test_an_htpasswd_that_is_no_file_is_refused(run_serve, tmp_path: Path) -> None:
    # a folder was taken, and every request answered 500
    write_shards(tmp_path / "shards", {"train": [4]})
    (tmp_path / "users").mkdir()
    assert refused(run_serve(tmp_path / "shards", SERVE_HTPASSWD=str(tmp_path / "users")), str(tmp_path / "users"))


@ROOTLESS
def test_an_htpasswd_its_workers_cannot_read_is_refused(run_serve, tmp_path: Path) -> None:
    # (they would answer 500 to every request)
    write_shards(tmp_path / "shards", {"train": [4]})
    users = tmp_path / "users"
    users.write_text("alice:{SHA}fEqNCco3Yq9h5ZUglD3CZJT4lBs=\n")
    users.chmod(0o600)
    assert refused(run_serve(tmp_path / "shards", SERVE_HTPASSWD=str(users)), "nobody", str(users))


def test_a_folder_whose_name_has_a_space_is_served(serve, tmp_path: Path) -> None:
    # nginx stopped with [emerg]: the paths went into nginx.conf unquoted
    data = tmp_path / "my shards"
    write_shards(data, {"train": [4]})
    server = serve(data, SERVE_ROOT=str(tmp_path / "serve state"))
    assert requests.get(f"{server.url}/manifest.json", timeout=10).json()["format"]
