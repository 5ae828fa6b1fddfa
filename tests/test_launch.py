"""./run's container and NGC verbs: dry-run command lines, a recording ngc stand-in, the node
entry script, and real 2-process CPU runs of local2 and of the entry script."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_ARCH, descendants, free_port, outliving, run_cli, tiny_run_env, wait_until, write_shards

SECRET = "s3cr3t-token-value"


def dry(*args: str, env: dict | None = None) -> list[list[str]]:
    """The commands ./run -n prints (pip lines of a venv refresh left out)."""
    out = run_cli(ROOT / "run", "-n", *args, env={"AIS_AUTHN_TOKEN": SECRET, **(env or {})}).stdout
    assert SECRET not in out
    return [
        shlex.split(line) for line in out.splitlines() if line and "pip install" not in line and "pip sync" not in line
    ]


def flag(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name]


def test_dry_run_of_the_other_verbs() -> None:
    assert dry("shards", "summary", "some/dir")[-1] == [".venv/bin/python", "imagenet_shards.py", "summary", "some/dir"]
    assert dry("tail", "42")[-2:] == [
        ["ngc", "base-command", "job", "info", "42", "--format_type", "json"],
        ["ngc", "base-command", "job", "log", "42", "--tail", "--lines", "200"],
    ]
    listing, kill = dry("killall")[-2:]
    assert listing[:6] == ["ngc", "base-command", "job", "list", "--label", "imagenet_ais"]
    assert kill[:4] == ["ngc", "base-command", "job", "kill"]
    assert dry("ais-up", "--targets", "2")[-1][1:] == [
        "tools/ais_local.py",
        "--root",
        ".cache/ais",
        "up",
        "--targets",
        "2",
    ]
    assert dry("ais-down")[-1][1:] == ["tools/ais_local.py", "--root", ".cache/ais", "down"]


def test_build_and_push() -> None:
    env = {
        "NGC_ORG": "myorg",
        "NGC_TEAM": "vision",
        "IMAGE_TAG": "v3",
        "BASE_IMAGE": "nvcr.io/nvidia/pytorch:26.01-py3",
        "ENGINE": "docker",  # (auto: docker only where its daemon answers)
    }
    assert dry("build", env=env)[-1] == [
        "docker",
        "build",
        "--build-arg",
        "BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3",
        "-t",
        "nvcr.io/myorg/vision/imagenet-ais:v3",
        ".",
    ]
    assert dry("push", env=env)[-1] == ["docker", "push", "nvcr.io/myorg/vision/imagenet-ais:v3"]


def test_docker2_and_shell_mount_data_and_results(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", {"train": [8]})
    env = {"DATA": str(tmp_path / "shards"), "RESULTS": "runs/t", "AIS_ENDPOINT": "http://ais:1", "ENGINE": "docker"}
    cmd = dry("docker2", "--epochs", "1", env=env)[-1]
    assert cmd[:3] == ["docker", "run", "--rm"] and "--ipc=host" in cmd and flag(cmd, "--gpus") == ["all"]
    assert flag(cmd, "--ulimit") == ["memlock=-1", "stack=67108864"], "NGC's limits for PyTorch"
    assert f"{tmp_path / 'shards'}:/data:ro" in flag(cmd, "-v") and f"{ROOT}/runs/t:/results" in flag(cmd, "-v")
    i = cmd.index("imagenet_ais.cli.torchrun")
    assert cmd[i + 1 : i + 4] == ["--standalone", "--nproc-per-node", "2"]
    assert flag(cmd, "--data") == ["/data"] and flag(cmd, "--output") == ["/results/docker2"]
    remote = dry("docker2", env={**env, "DATA": "ais://b/p"})[-1]
    assert flag(remote, "--data") == ["ais://b/p"] and {"AIS_ENDPOINT", "AIS_AUTHN_TOKEN"} <= set(flag(remote, "-e"))
    s3 = dry("docker2", env={**env, "DATA": "s3://b/p", "AWS_ENDPOINT_URL": "http://s3:9000", "AWS_REGION": "eu-1"})[-1]
    assert flag(s3, "--data") == ["s3://b/p"] and {"AWS_ENDPOINT_URL", "AWS_REGION"} <= set(flag(s3, "-e"))
    shell = dry("shell", env=env)[-1]
    assert "-it" in shell and f"{ROOT}:/workspace/imagenet-ais" in flag(shell, "-v") and shell[-1] == "bash"


def test_singlenode_and_ais_submit_real_ngc_flags() -> None:
    env = {
        "NGC_DATA": "/mount/imagenet",
        "NGC_SECRETS": "gcs-sa ais-token:AIS_AUTHN_TOKEN",
        "NGC_ORG": "o",
        "UPLOAD": "gs://ckpt/run",
        "NGC_MOUNTS": "--datasetid 123:/mount/imagenet",
    }
    single = dry("singlenode", env=env)[-1]
    assert single[:4] == ["ngc", "base-command", "job", "run"]
    assert flag(single, "--preempt") == ["RESUMABLE"] and flag(single, "--label") == ["imagenet_ais"]
    assert flag(single, "--secret") == ["gcs-sa", "ais-token:AIS_AUTHN_TOKEN"]
    assert flag(single, "--datasetid") == ["123:/mount/imagenet"] and flag(single, "--org") == ["o"]
    assert "--replicas" not in single
    job = shlex.split(flag(single, "--commandline")[0].split("&&", 1)[1])
    # ImageNet's recipe (resnet50, ...) is train.py's default: ./run passes only what differs
    assert job[:2] == ["bash", "tools/ngc_node.sh"] and flag(job, "--arch") == []
    assert flag(job, "--upload") == ["gs://ckpt/run"] and "auto" in flag(job, "--resume")
    assert flag(job, "--data") == ["/mount/imagenet"]
    mixed = dry("singlenode", "--data", "/mount/imagenet", "--data", "/mount/own:2", env=env)[-1]
    job = shlex.split(flag(mixed, "--commandline")[0].split("&&", 1)[1])
    assert flag(job, "--data") == ["/mount/imagenet", "/mount/own:2"], "the caller's --data instead of NGC_DATA"

    multi = dry("ais", env={**env, "AIS_BUCKET": "imagenet", "AIS_ENDPOINT": "http://ais:51080", "NGC_REPLICAS": "4"})[
        -1
    ]
    assert flag(multi, "--replicas") == ["4"] and flag(multi, "--array-type") == ["PYTORCH"]
    assert flag(multi, "--total-runtime") == ["8H"]
    assert set(flag(multi, "--env-var")) == {"AIS_ENDPOINT:http://ais:51080", "DATA:ais://imagenet"}


def test_ngc_dry_runs_show_what_is_missing_as_placeholders_and_warn_of_an_image_ngc_cannot_pull(
    fake_ngc: dict,
) -> None:
    # ./run -n singlenode / -n ais without settings printed only an error; nvcr.io/local/... went by without a word
    bare = {**fake_ngc, "NGC_ORG": "", "NGC_CLI_ORG": "", "IMAGE": "", "NGC_DATA": "", "DATA": "", "AIS_BUCKET": ""}
    bare["AIS_ENDPOINT"] = ""
    for verb, shown in (("singlenode", "DATA:<NGC_DATA>"), ("ais", "DATA:ais://<AIS_BUCKET>")):
        proc = run_cli(ROOT / "run", "-n", verb, env=bare)
        submit = shlex.split(proc.stdout.splitlines()[-1])
        assert submit[:4] == ["ngc", "base-command", "job", "run"] and shown in flag(submit, "--env-var"), verb
        assert flag(submit, "--image") == ["nvcr.io/local/imagenet-ais:latest"]
        assert "not set, shown as <NAME>" in proc.stderr and "which no NGC job can pull: set NGC_ORG" in proc.stderr
        real = run_cli(ROOT / "run", verb, env=bare, check=False)
        assert real.returncode == 1 and real.stderr.startswith("Error: ") and len(real.stderr.splitlines()) == 1
        assert not Path(fake_ngc["FAKE_NGC_STATE"]).exists(), "nothing submitted"
    named = run_cli(ROOT / "run", "-n", "singlenode", env={**bare, "NGC_ORG": "o", "NGC_DATA": "/mount/imagenet"})
    assert "warning" not in named.stderr and "not set" not in named.stderr


def test_missing_tools_get_one_line_each(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("bash", "dirname", "cat", "sha256sum", "cut", "id", "nproc"):
        os.symlink(shutil.which(tool), bare / tool)
    proc = run_cli(ROOT / "run", "build", env={"PATH": str(bare)}, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("run: no container engine: install Docker Engine")
    assert "or buildah" in proc.stderr, "building needs neither docker nor podman"
    proc = run_cli(ROOT / "run", "docker2", env={"PATH": str(bare)}, check=False)
    assert proc.returncode == 1 and "or buildah" not in proc.stderr, "running the image does"
    for job in (["7"], []):  # without a job id it said "give a job id" first, and "ngc not found" after one
        proc = run_cli(ROOT / "run", "tail", *job, env={"PATH": str(bare)}, check=False)
        assert proc.returncode == 1 and "ngc not found: install the NGC CLI" in proc.stderr, proc.stderr


@pytest.fixture
def fake_ngc(tmp_path: Path) -> dict:
    state = tmp_path / "ngc.json"
    return {"PATH": f"{ROOT / 'tests' / 'standins'}:{os.environ['PATH']}", "FAKE_NGC_STATE": str(state)}


def test_submit_tail_and_killall_against_the_ngc_stand_in(fake_ngc: dict, tmp_path: Path) -> None:
    env = {**fake_ngc, "AIS_BUCKET": "imagenet", "AIS_ENDPOINT": "http://ais:51080", "NGC_SECRETS": "ais-token"}
    last_job = ROOT / ".cache" / "last-job"
    saved = last_job.read_text() if last_job.exists() else None
    try:
        out = run_cli(ROOT / "run", "ais", env=env).stdout
        assert "submitted NGC job 1000" in out and last_job.read_text().strip() == "1000"
        followed = run_cli(ROOT / "tools" / "ngc.py", "tail", "--poll", "0", env=env)
        lines = followed.stdout.splitlines()
        assert lines[:9] == [f"log line {i}" for i in range(1, 10)], "each log line once, in order"
        assert not [line for line in lines if line.startswith("progress")], "a line still growing is held back"
        assert lines[-1] == "job 1000 ended: FINISHED_SUCCESS" and "is QUEUED; waiting" in followed.stderr
    finally:
        if saved is None:
            last_job.unlink(missing_ok=True)
        else:
            last_job.write_text(saved)

    state = json.loads(Path(env["FAKE_NGC_STATE"]).read_text())
    for job_id, labels in (("2001", ["imagenet_ais"]), ("2002", ["imagenet_ais"]), ("2003", ["someone_else"])):
        state["jobs"][job_id] = {
            "id": int(job_id),
            "labels": labels,
            "status": "RUNNING",
            "infos": 0,
            "logs": 0,
            "name": job_id,
        }
    Path(env["FAKE_NGC_STATE"]).write_text(json.dumps(state))
    refused = run_cli(ROOT / "run", "killall", env=env, check=False)  # no tty: the question gets no yes
    assert refused.returncode == 1
    killed = run_cli(ROOT / "run", "killall", "--yes", env=env).stdout
    assert "killed 2001" in killed and "killed 2002" in killed and "2003" not in killed
    state = json.loads(Path(env["FAKE_NGC_STATE"]).read_text())
    assert {k: j["status"] for k, j in state["jobs"].items()} == {
        "1000": "FINISHED_SUCCESS",
        "2001": "KILLED_BY_USER",
        "2002": "KILLED_BY_USER",
        "2003": "RUNNING",
    }
    assert all(SECRET not in " ".join(call) for call in state["calls"])


def test_node_entry_script_for_two_nodes_dry_run() -> None:
    env = {
        "NGC_ARRAY_SIZE": "2",
        "NGC_ARRAY_INDEX": "1",
        "NGC_MASTER_ADDR": "10.0.0.7",
        "NGC_GPUS_PER_NODE": "8",
        "DRY_RUN": "1",
    }
    cmd = shlex.split(run_cli("bash", ROOT / "tools" / "ngc_node.sh", "--data", "ais://b", env=env).stdout)
    assert cmd[1:] == [
        "-m",
        "imagenet_ais.cli.torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.7",
        "--master-port",
        "29500",
        "train.py",
        "--resume",
        "auto",
        "--data",
        "ais://b",
    ]


def test_node_entry_script_really_trains_one_node_two_processes(tmp_path: Path) -> None:
    data, output = tmp_path / "shards", tmp_path / "results"
    write_shards(data, {"train": [9, 7, 16], "val": [4]})
    env = {
        "NGC_ARRAY_SIZE": "1",
        "NGC_ARRAY_INDEX": "0",
        "NGC_MASTER_ADDR": "127.0.0.1",
        "NGC_GPUS_PER_NODE": "2",
        "TRAIN_PYTHON": str(Path(os.sys.executable)),
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
        "OMP_NUM_THREADS": "1",
    }
    run_cli(
        "bash",
        ROOT / "tools" / "ngc_node.sh",
        "--data",
        data,
        "--output",
        output,
        "--arch",
        TINY_ARCH,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--workers",
        "1",
        env=env,
    )
    state = torch.load(output / "last.pt", weights_only=True)
    assert state["step"] == 4 and len(state["rng"]) == 2  # 32 samples / (2 ranks × 4)


def training(verb: list[str], tmp_path: Path) -> tuple[subprocess.Popen, set[int]]:
    """./run VERB training on tiny shards into tmp_path/run, once it has logged step 3; with the
    processes it started (the trainer, or torchrun and its ranks)."""
    data, output = tmp_path / "shards", tmp_path / "run"
    write_shards(data, {"train": [40, 40], "val": [4]})
    env = {**os.environ, **tiny_run_env(data, output), "EPOCHS": "1000", "RDZV_PORT": str(free_port())}
    if verb[0] == "nodes":
        env |= {"NPROC": "1", "EPOCH_MODE": "exact"}  # two agents of one rank each
    if verb[0] == "local2":  # as a user runs it, OMP_NUM_THREADS unset: torchrun printed a banner of the one it set
        del env["OMP_NUM_THREADS"]
    proc = subprocess.Popen(
        [str(ROOT / "run"), *verb, "--log-every", "1", "--log-keys"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = output / "metrics.jsonl"
    wait_until(
        proc,
        lambda: log.exists() and any(json.loads(r)["step"] >= 3 for r in log.read_text().split("\n")[:-1]),
        "step 3",
    )
    return proc, descendants(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("verb", [["local1"], ["local2"], ["nodes", "localhost,localhost"]], ids=lambda v: v[0])
def test_sigterm_to_run_saves_exits_75_and_leaves_no_process(verb: list[str], tmp_path: Path) -> None:
    # as a supervisor, timeout or a batch script stops the PID it started: ./run's own
    proc, started = training(verb, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    # the one line that says so; torchrun added its SignalException's traceback and its agent's warnings
    said = [line for line in out.splitlines() if line.startswith("stopped by a signal (SIGTERM) at step ")]
    assert len(said) == 1 and said[0].endswith(", checkpoint saved; continue with --resume auto"), out[-3000:]
    assert "Traceback" not in err and "signal" not in err.lower() and "OMP_NUM_THREADS" not in err, err[-3000:]
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert state["step"] >= 3 and len(state["rng"]) == (1 if verb == ["local1"] else 2), "every rank trained"
    if verb[0] == "nodes":  # two torchrun agents met on loopback: one run of two ranks, each its own samples
        epochs = [
            [f.read_text().split() for f in sorted((tmp_path / "run" / "keys").glob(f"*-rank{r}.txt"))] for r in (0, 1)
        ]
        assert [sum(map(len, rank)) for rank in epochs] == [state["step"] * 4] * 2
        assert not any(set(mine) & set(theirs) for mine, theirs in zip(*epochs, strict=True))
    assert not outliving(started, 10), "no process of the run left behind"


# In a PID namespace of its own, where the next PID can be set: a stand-in ssh whose agent on host
# a ends at once; a stranger then takes its PID, and ./run gets SIGTERM.
STALE_PID = r"""
cd "$ROOT"
SSH="$T/ssh" OUTPUT="$T/run" ./run nodes b,a --data "$T/none" &  # (waiting for b, a ends)
run=$!
until [ -s "$T/a.pid" ] && [ -s "$T/b.pid" ]; do sleep 0.02; done
a=$(cat "$T/a.pid")
while [ -e "/proc/$a" ]; do sleep 0.02; done  # ended, and reaped by ./run
echo $((a - 1)) >/proc/sys/kernel/ns_last_pid
(trap ': >"$T/stranger.got"' TERM; echo "$BASHPID" >"$T/stranger.pid"; sleep 30 & wait; sleep 30 & wait) &
until [ -s "$T/stranger.pid" ]; do sleep 0.02; done
kill -USR1 "$run"  # (to the agents' children: host b's has none)
sleep 0.5
kill -0 "$run" || echo "./run ended on SIGUSR1"
kill -TERM "$run"
for _ in $(seq 100); do kill -0 "$run" 2>/dev/null || break; sleep 0.1; done
kill -0 "$run" 2>/dev/null && echo "./run still waiting 10 s after b ended" && kill -KILL "$run"
wait "$run"
echo "run: $?, the stranger: $(cat "$T/stranger.pid"), host a's agent: $a"
sleep 1  # (for a signal on its way to the stranger)
"""
AGENT = """#!/bin/bash
echo $$ >"$T/$1.pid"
[ "$1" = a ] && exit 0
trap ': >"$T/b.got"; exit 143' TERM
mkfifo "$T/b.fifo"
while :; do read -rt 1 <>"$T/b.fifo" || :; done  # (no child process)
"""


def test_a_signal_to_run_never_reaches_a_process_that_took_the_pid_of_an_agent_that_ended(tmp_path: Path) -> None:
    # ./run passed SIGTERM on to every agent it had started, one that had ended too (as a node's
    # agent does that an elastic job lost): bash had reaped it, and its PID was anyone's by then.
    # And a signal that found no process (SIGUSR1 for agents without ranks) ended ./run itself;
    # and ./run waited for the stranger as if it were that agent
    if os.geteuid() != 0 or not shutil.which("unshare"):
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("root and unshare needed: a PID namespace")
    (tmp_path / "ssh").write_text(AGENT)
    (tmp_path / "ssh").chmod(0o755)
    env = {**os.environ, "ROOT": str(ROOT), "T": str(tmp_path)}
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", STALE_PID]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "./run ended on SIGUSR1" not in out and "./run still waiting" not in out, out
    said = re.fullmatch(r"run: (\d+), the stranger: (\d+), host a's agent: (\d+)\n", out)
    assert said and said[2] == said[3], f"the stranger did not take the ended agent's PID: {out}"
    assert said[1] == "143" and (tmp_path / "b.got").exists(), "the agent still running was stopped"
    assert not (tmp_path / "stranger.got").exists(), "./run signalled a process it never started"


@pytest.mark.slow
@pytest.mark.parametrize("verb", [["local2"], ["nodes", "localhost,localhost"]], ids=lambda v: v[0])
def test_sigkill_of_run_stops_torchrun_and_its_ranks_as_sigterm_does(verb: list[str], tmp_path: Path) -> None:
    # ./run waits for torchrun (to exit 75 for a stopped run): killed outright, it left torchrun
    # and its ranks training
    proc, started = training(verb, tmp_path)
    proc.kill()
    alive = outliving(started, 60)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)  # (to the end of what torchrun and its ranks print)
    assert not alive, "torchrun and its ranks end with ./run"
    assert "checkpoint saved" in out, err[-3000:]


@pytest.mark.parametrize(
    ("sig", "status", "by"), [(signal.SIGTERM, 75, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")], ids=["TERM", "INT"]
)
def test_a_stop_while_train_py_imports_says_so_and_exits_as_stopped(
    sig: signal.Signals, status: int, by: str, tmp_path: Path
) -> None:
    # in its first seconds (importing torch) SIGTERM killed it: 143, with nothing said; Ctrl-C
    # printed KeyboardInterrupt's traceback there, and click's "Aborted!" (status 1) a moment later
    proc = subprocess.Popen(
        [sys.executable, ROOT / "train.py", "--data", tmp_path / "shards", "--output", tmp_path / "run"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    wait_until(proc, lambda: "libtorch" in maps.read_text(), "torch's libraries loading", poll=0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert err == f"train.py: stopped by {by} where no training was under way: nothing to save\n"
    assert not (tmp_path / "run").exists()


def test_nodes_reaches_other_hosts_over_ssh_dry_run() -> None:
    env = {"SSH": "ssh -p 2222", "REMOTE_DIR": "/srv/my checkout", "NPROC": "8", "DATA": "ais://imagenet/train"}
    env["AIS_ENDPOINT"] = "http://ais-proxy:51080"
    lines = run_cli(ROOT / "run", "-n", "nodes", "gpu1,gpu2", "--epochs", "1", env=env).stdout.splitlines()
    agents = sorted(shlex.split(line) for line in lines if line.startswith("ssh "))  # started in parallel
    assert [a[:4] for a in agents] == [["ssh", "-p", "2222", "gpu1"], ["ssh", "-p", "2222", "gpu2"]]
    remote = shlex.split(agents[1][4])
    assert remote[:5] == ["cd", "/srv/my checkout", "&&", "AIS_ENDPOINT=http://ais-proxy:51080", ".venv/bin/python"]
    flags = " ".join(remote)
    assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu1:29400" in flags
    assert "train.py --data ais://imagenet/train" in flags and flags.endswith("--epochs 1")
    proc = run_cli(ROOT / "run", "nodes", check=False)
    assert proc.returncode == 1 and "nodes needs HOST[,HOST...]" in proc.stderr


def test_dockerfile_is_hadolint_clean_and_context_has_no_secrets() -> None:
    proc = run_cli(Path(os.sys.executable).parent / "hadolint", ROOT / "Dockerfile", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".git", ".venv", "config.local.sh", "**/*credentials*", "**/*.key"):
        assert pattern in ignored


def test_podman_and_buildah_stand_in_for_docker_with_their_own_syntax(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", {"train": [8]})
    env = {"DATA": str(tmp_path / "shards"), "DOCKER_GPUS": "0,1"}
    podman = dry("docker2", env={**env, "ENGINE": "podman"})[-1]
    assert podman[:3] == ["podman", "run", "--rm"] and "--gpus" not in podman
    assert flag(podman, "--device") == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"], "CDI devices, not --gpus"
    assert dry("build", env={"ENGINE": "buildah"})[-1][:2] == ["buildah", "bud"]
    assert dry("push", env={"ENGINE": "podman"})[-1][:2] == ["podman", "push"]
    refused = run_cli(ROOT / "run", "-n", "shell", env={"ENGINE": "buildah"}, check=False)
    assert refused.returncode == 1 and "buildah builds and pushes only" in refused.stderr
