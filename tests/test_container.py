"""The training image, built for real with ./run build (buildah) from a stand-in for NGC's base
(tools/ngc_standin.sh) and run as a non-root user. Needs root, buildah and debootstrap (./run test
installs them on Debian); without them the tests skip, or fail under CI=true.

What only a real NGC run shows: NGC's own base image and torch build, GPUs, the registry push."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, run_cli, tiny_run_env, write_shards

# the image the tests share (a module fixture): built once, in one of ./run test's processes
pytestmark = [pytest.mark.xdist_group("container"), pytest.mark.slow]

USER = "1234:1234"  # no user of the image: as NGC and docker run --user start it
CA = Path("/etc/ssl/certs/ca-certificates.crt")  # this machine's trust, for downloads in the build


def buildah(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli("buildah", *args, check=check, timeout=900)


def standin_tag() -> str:
    """Named by what it is built from: a changed script or torch pin builds a new one."""
    pins = [line for line in (ROOT / "requirements.lock").read_text().splitlines() if line.startswith("torch")]
    digest = hashlib.sha256(((ROOT / "tools" / "ngc_standin.sh").read_text() + "".join(pins)).encode())
    return f"localhost/imagenet-ais-ngc-standin:{digest.hexdigest()[:12]}"


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    missing = [tool for tool in ("buildah", "debootstrap") if not shutil.which(tool)]
    if missing or os.geteuid() != 0:
        message = (
            f"{', '.join(missing) or 'root'} needed to build the image (./run test installs them as root on Debian)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    base = standin_tag()
    if buildah("inspect", "--type", "image", base, check=False).returncode != 0:
        run_cli(ROOT / "tools" / "ngc_standin.sh", base, timeout=1800)
    tag = f"localhost/imagenet-ais-test:{uuid.uuid4().hex[:8]}"
    env = {"ENGINE": "buildah", "BASE_IMAGE": base, "IMAGE": tag, "BUILDAH_ISOLATION": "chroot"}
    if CA.exists():
        env["BUILD_OPTS"] = f"--volume {CA}:{CA}:ro"
    run_cli(ROOT / "run", "build", env=env, timeout=1800)
    try:
        yield tag
    finally:
        buildah("rmi", tag, check=False)


def inside(image: str, *cmd: str, volumes: tuple[str, ...] = (), user: str = USER) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh container of ``image`` as ``user``, with ``volumes`` (HOST:PATH[:ro])."""
    container = buildah("from", "--quiet", image).stdout.strip()
    try:
        mounts = [a for v in volumes for a in ("--volume", v)]
        return buildah("run", "--isolation", "chroot", "--user", user, *mounts, container, "--", *cmd, check=False)
    finally:
        buildah("rm", container, check=False)


def test_the_image_runs_as_any_user_keeps_its_torch_and_makes_no_venv(image: str) -> None:
    version = "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    base = inside(standin_tag(), "python", "-c", version, user="0:0").stdout  # the base sets no caches for others
    # one container for the image's checks (each one started costs seconds): their outputs apart
    checks = ["./run help", f"python -c '{version}'", "./run -n local1", "test -e .venv; echo $?"]
    done = inside(image, "sh", "-c", " && echo '<>' && ".join(f"{{ {c}; }}" for c in checks))
    assert done.returncode == 0, done.stderr
    helped, versions, planned, venv = done.stdout.split("<>\n")
    assert helped.startswith("usage: ./run"), done.stdout
    assert base and versions == base, "the pip step replaced torch"
    assert "-m venv" not in planned and "pip " not in planned, "./run would make a venv in the image"
    assert "/usr/bin/python train.py" in planned
    assert venv == "1\n", "the image holds no .venv"


def test_a_training_in_the_image_writes_metrics_and_a_checkpoint_to_the_mounted_results(
    image: str, tmp_path: Path
) -> None:
    write_shards(tmp_path / "shards", {"train": [8, 8], "val": [4]})
    results = tmp_path / "results"
    results.mkdir()
    results.chmod(0o777)  # the container's user is not this one
    args = [*TINY, "--epochs", "1", "--max-steps", "2"]
    trained = inside(
        image,
        *("python", "train.py", "--data", "/data", "--output", "/results/run", "--workers", "1", *args),
        volumes=(f"{tmp_path / 'shards'}:/data:ro", f"{results}:/results"),
    )
    assert trained.returncode == 0, trained.stdout + trained.stderr
    run = results / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2]
    checkpoint = run / "ckpt-00000002.pt"
    assert checkpoint.exists() and f"{checkpoint.stat().st_uid}:{checkpoint.stat().st_gid}" == USER


# What this host's podman allows (as root, in a sandbox): its default nproc and memlock limits are
# refused ("error setting rlimit type 6"), so the settings say which to pass (config.sh)
ULIMITS = "nofile=4096:4096 nproc=4096:4096 stack=67108864"


def need_podman() -> None:
    if not shutil.which("podman"):
        message = "podman needed to run the image (./run test --install-deps installs it as root on Debian)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)


def docker2_env(image: str, tmp_path: Path) -> dict[str, str]:
    need_podman()
    data = tmp_path / "shards"
    write_shards(data, {"train": [24, 24], "val": [4]})
    env = {**tiny_run_env(data, tmp_path / "unused"), "ENGINE": "podman", "IMAGE": image, "DOCKER_GPUS": "none"}
    return {**env, "DOCKER_ULIMITS": ULIMITS, "WORKERS": "1", "TRAIN_EXTRA": "--log-every 1"}


def engine_client(proc: subprocess.Popen) -> int:
    """The podman client that ./run started (or ./run itself, where it became the client)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    clients = [int(pid) for pid in [proc.pid, *children] if Path(f"/proc/{pid}/comm").read_text().strip() == "podman"]
    assert clients, "no podman client under ./run"
    return clients[0]


def stopped_docker2(env: dict[str, str], results: Path, stop: Callable[[subprocess.Popen], None]) -> None:
    """./run docker2 for 100 epochs, stopped by ``stop`` once 2 steps are logged: it must exit 75
    having saved where it stopped, and leave no container."""
    run = results / "docker2"
    proc = subprocess.Popen(
        [ROOT / "run", "docker2"], cwd=ROOT, env={**os.environ, **env, "RESULTS": str(results), "EPOCHS": "100"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and _steps(run) < 2:
            time.sleep(0.5)
        assert proc.poll() is None, "".join(proc.communicate())[-4000:]  # (a tuple: its repr is cut short)
        stop(proc)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out + err
    assert 2 <= torch.load(run / "last.pt", weights_only=True)["step"] < 100 * 6, "saved where it stopped"
    assert containers_of(env["IMAGE"]) == "", "no container left"


def containers_of(image: str) -> str:
    """The IDs of the image's containers, running or not."""
    listed = ["podman", "ps", "-aq", "--filter", f"ancestor={image}"]
    return subprocess.run(listed, capture_output=True, text=True).stdout.strip()


def test_run_docker2_trains_two_ranks_in_the_image_and_a_sigterm_saves_and_exits_75(image: str, tmp_path: Path) -> None:
    env = docker2_env(image, tmp_path)

    absent = {**env, "IMAGE": "localhost/imagenet-ais-absent:none"}
    planned = run_cli(ROOT / "run", "-n", "docker2", env=absent)
    says = "localhost/imagenet-ais-absent:none is not on this host: ./run build makes it"
    assert f"# {says}" in planned.stdout, planned.stdout
    refused = run_cli(ROOT / "run", "docker2", env=absent, check=False)
    assert (
        refused.returncode == 1
        and refused.stderr.strip() == f"run: {says} (or podman pull it from where ./run push put it)"
    )

    done = run_cli(ROOT / "run", "docker2", env={**env, "RESULTS": str(tmp_path / "whole")}, timeout=600)
    run = tmp_path / "whole" / "docker2"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 7)), done.stderr  # 48 / (2 × 4)
    checkpoint = run / "last.pt"
    assert (checkpoint.stat().st_uid, checkpoint.stat().st_gid) == (os.getuid(), os.getgid()), "the caller's"
    assert " on 2 × cpu" in (run / "train.log").read_text(), "two processes"

    # SIGTERM to ./run's PID: the engine, torchrun and the ranks pass it on; they save, and ./run exits 75
    stopped_docker2(env, tmp_path / "stopped", lambda proc: proc.send_signal(signal.SIGTERM))


def test_run_docker2_whose_engine_client_is_killed_stops_the_container_so_the_ranks_save(
    image: str, tmp_path: Path
) -> None:
    # the client gone (killed, or podman's that took a SIGTERM before it passed signals on), the
    # container ran on without anyone to stop it
    stopped_docker2(
        docker2_env(image, tmp_path), tmp_path / "killed", lambda proc: os.kill(engine_client(proc), signal.SIGKILL)
    )


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"kind": "train"' in line for line in lines)


def started_shell(image: str, tmp_path: Path) -> subprocess.Popen:
    """./run shell running a command that would go on for 5 minutes, once the command has started."""
    need_podman()
    write_shards(tmp_path / "shards", {"train": [4], "val": [2]})
    env = {**os.environ, "ENGINE": "podman", "IMAGE": image, "DOCKER_GPUS": "none", "DOCKER_ULIMITS": ULIMITS}
    env.update(RESULTS=str(tmp_path / "results"), DATA=str(tmp_path / "shards"))
    proc = subprocess.Popen(
        [ROOT / "run", "shell", "-c", "echo started; sleep 300"], cwd=ROOT, env=env, text=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    return proc


def ended_without_container(proc: subprocess.Popen, image: str) -> int | None:
    """./run's status within 30 s (None: it went on), once no container of the image is left."""
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (left := containers_of(image)) == "", f"container {left} left after ./run shell ended"
    return proc.returncode


def test_run_shell_ends_with_its_container_on_sigterm(image: str, tmp_path: Path) -> None:
    # bash as the container's first process ignored SIGTERM: ./run shell waited for whatever ran in it;
    # and podman under load ended its client with 0 on a SIGTERM as the container started, leaving it
    proc = started_shell(image, tmp_path)
    proc.send_signal(signal.SIGTERM)
    # ended by the signal, not by the shell's command (sleep 300); with --rm, podman reported 0 at
    # times for a container a signal ended (a race under load)
    assert ended_without_container(proc, image) in (143, 0), "./run shell went on after SIGTERM"


def test_run_shell_stops_its_container_when_the_engines_client_is_killed(image: str, tmp_path: Path) -> None:
    proc = started_shell(image, tmp_path)
    os.kill(engine_client(proc), signal.SIGKILL)
    assert ended_without_container(proc, image) == 143, "./run shell went on after its client was killed"


def test_a_dry_run_names_the_engine_the_run_would_use(tmp_path: Path) -> None:
    # -n docker2 planned "docker run" (and "docker pull") where docker's daemon did not answer:
    # the run itself used podman
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for engine in ("docker", "podman"):  # docker: no daemon; podman: no image yet
        (bin_dir / engine).write_text(f'#!/bin/sh\necho "{engine} $*" >>"{calls}"\nexit 1\n')
        (bin_dir / engine).chmod(0o755)
    write_shards(tmp_path / "shards", {"train": [8]})
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DATA": str(tmp_path / "shards"), "IMAGE": "localhost/i:1"}
    plan = run_cli(ROOT / "run", "-n", "docker2", env=env).stdout.splitlines()
    why = "# localhost/i:1 is not on this host: ./run build makes it (or podman pull it from where ./run push put it)"
    assert why in plan and plan[-1].startswith("podman run "), plan
    assert calls.read_text().splitlines() == ["docker info", "podman image inspect localhost/i:1"], "questions only"
