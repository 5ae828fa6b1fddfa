"""The ./run front door and the project's lint gates."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, shards_here, write_shards
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

VENV_BIN = Path(sys.executable).parent


def test_help_lists_the_verbs() -> None:
    out = run_cli(ROOT / "run", "help").stdout
    for verb in ("venv", "test", "shards", "local1", "local2"):
        assert f"\n  {verb} " in out


def test_an_unknown_verb_is_one_line_and_exits_2() -> None:
    proc = run_cli(ROOT / "run", "frobnicate", check=False)  # (the whole help came first)
    assert proc.returncode == 2
    assert proc.stderr == "run: unknown verb 'frobnicate': ./run help lists them\n"


def test_dry_run_prints_the_commands_with_settings_from_the_environment(tmp_path: Path) -> None:
    env = {"DATA": str(tmp_path / "my shards"), "ARCH": "resnet34", "NPROC": "3", "WORKERS": "2", "VENV": ".venv"}
    out = run_cli(ROOT / "run", "-n", "local2", "--epochs", "1", env=env).stdout.splitlines()
    cmd = shlex.split(out[-1])
    threads = max(1, (os.cpu_count() or 1) // 3)  # each rank's share of the cores (torchrun's banner set 1)
    assert cmd[:2] == ["env", f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS') or threads}"]
    assert cmd[2:8] == [".venv/bin/python", "-m", "imagenet_ais.cli.torchrun", "--standalone", "--nproc-per-node", "3"]
    assert cmd[cmd.index("--data") + 1] == str(tmp_path / "my shards")
    assert cmd[cmd.index("--arch") + 1] == "resnet34"
    assert cmd[cmd.index("--output") + 1] == "runs/local2"
    assert cmd[-4:] == ["--resume", "auto", "--epochs", "1"]
    assert not (tmp_path / "my shards").exists()


def test_a_dry_runs_plan_is_whole_on_stdout(tmp_path: Path) -> None:
    # `./run -n local1 > plan.sh` lost the demo's synth and convert steps: they went to stderr
    env = {"DEMO_DIR": str(tmp_path / "demo"), "VENV": str(tmp_path / "venv")}  # neither made yet
    planned = run_cli(ROOT / "run", "-n", "local1", env=env)
    steps = [line.split()[1:3] for line in planned.stdout.splitlines() if "imagenet_shards.py" in line]
    assert steps == [["imagenet_shards.py", "synth"], ["imagenet_shards.py", "convert"]], planned.stdout
    assert "-m venv" in planned.stdout and "train.py" in planned.stdout.splitlines()[-1]
    assert planned.stderr == "", "nothing of the plan elsewhere"


def test_relative_paths_are_the_callers(tmp_path: Path) -> None:
    # from another directory, `CHECKOUT/run shards summary mytree/shards` said there was no manifest:
    # ./run works in the checkout, and the relative path was taken from there
    write_shards(tmp_path / "mine" / "shards", {"train": [3], "val": [2]})
    env = {**os.environ, "VENV": str(VENV_BIN.parent)}

    def run_here(*args: str, **settings: str) -> subprocess.CompletedProcess:
        cmd = [ROOT / "run", *args]
        return subprocess.run(cmd, cwd=tmp_path, env={**env, **settings}, capture_output=True, text=True)

    summary = run_here("shards", "summary", "mine/shards")
    assert summary.returncode == 0 and "samples=3" in summary.stdout, summary.stderr
    planned = run_here("-n", "local1", "--output", "out", "--resume", "auto", DATA="mine/shards", UPLOAD="up")
    cmd = shlex.split(planned.stdout.splitlines()[-1])
    assert cmd[cmd.index("--data") + 1] == str(tmp_path / "mine" / "shards")
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--output") + 1] == str(tmp_path / "out"), "the caller's --output"
    assert cmd[cmd.index("--upload") + 1] == str(tmp_path / "up") and cmd[cmd.index("--resume") + 1] == "auto"
    # the caller's --data (here two, mixed) stands instead of DATA, not beside it (train.py would mix all three)
    mix = ["--data", "own:2", "--data=ais://b/x", "--val-data", "v", "--weights", "timm/convnext_tiny.fb_in1k"]
    mixed = shlex.split(run_here("-n", "local1", *mix, DATA="mine/shards").stdout.splitlines()[-1])
    data = [a for i, a in enumerate(mixed) if mixed[i - 1] == "--data" or a.startswith("--data=")]
    assert data == [f"{tmp_path}/own:2", "--data=ais://b/x"]
    assert mixed[mixed.index("--val-data") + 1] == f"{tmp_path}/v"
    assert mixed[mixed.index("--weights") + 1] == "timm/convnext_tiny.fb_in1k", "timm's name, not a path"
    plotted = run_here("-n", "plot", "runs/x", "--out=p.png")
    assert shlex.split(plotted.stdout.splitlines()[-1])[-2:] == [str(tmp_path / "runs/x"), f"--out={tmp_path}/p.png"]


def test_the_launchers_demo_settings_give_way_to_the_users_options() -> None:
    # `./run -n local1 --epochs 2` printed --epochs 8 ... --epochs 2; DATA=./data/demo/shards got ResNet-50 at 224 px
    out = run_cli(ROOT / "run", "-n", "local1", "--epochs", "2", env={"DATA": "./data/demo/shards", "VENV": ".venv"})
    cmd = shlex.split(out.stdout.splitlines()[-1])
    assert cmd.count("--epochs") == 1 and cmd[-2:] == ["--epochs", "2"]
    assert cmd[cmd.index("--arch") + 1] == "resnet18", "the demo, however its path is written"
    # named, so that a --recipe sets them (train.py's test_recipe checks the precedence)
    assert cmd[cmd.index("--launcher-defaults") + 1] == "arch,batch-size,image-size,lr,warmup-epochs"
    # torchvision's names for them are the user's too (--model was beaten by the launcher's --arch as "its default")
    env = {"DATA": "./data/demo/shards", "VENV": ".venv"}
    cmd = shlex.split(
        run_cli(ROOT / "run", "-n", "local1", "--model", "resnet34", "-b", "16", env=env).stdout.splitlines()[-1]
    )
    assert "--arch" not in cmd and "--batch-size" not in cmd and cmd[-4:] == ["--model", "resnet34", "-b", "16"]
    assert cmd[cmd.index("--launcher-defaults") + 1] == "epochs,image-size,lr,warmup-epochs"


def test_the_demo_is_known_by_its_manifest_wherever_its_shards_are(tmp_path: Path) -> None:
    # run knew the demo by its folder's path: a copy elsewhere got ResNet-50 at 224 px for 90 epochs
    for name, size in (("demo", []), ("photos", ["--size", "64", "48"])):  # synth's pictures: random sizes, or fixed
        tree = tmp_path / f"{name}-tree"
        shards_here("synth", tree, "--classes", "3", "--train-per-class", "4", "--val-per-class", "1", *size)
        shards_here("convert", tree, tmp_path / name, "--workers", "1")
    for name, arch in (("demo", "resnet18"), ("photos", None)):
        out = run_cli(ROOT / "run", "-n", "local1", env={"DATA": str(tmp_path / name), "VENV": ".venv"}).stdout
        cmd = shlex.split(out.splitlines()[-1])
        assert (cmd[cmd.index("--arch") + 1] if "--arch" in cmd else None) == arch, name


def test_config_local_overrides_defaults_and_the_environment_overrides_it(tmp_path: Path) -> None:
    # in a copy of the front door: a config.local.sh in the checkout would reach the other tests' ./run meanwhile
    door = tmp_path / "checkout"
    (door / "tools").mkdir(parents=True)
    for name in ("run", "config.sh", "tools/serve.sh"):
        shutil.copy2(ROOT / name, door / name)
    (door / "config.local.sh").write_text("ARCH=vgg11\nEPOCHS=7\n")
    env = {"DATA": str(tmp_path), "EPOCHS": "3", "VENV": str(ROOT / ".venv")}
    cmd = shlex.split(run_cli(door / "run", "-n", "local1", env=env).stdout.splitlines()[-1])
    assert cmd[cmd.index("--arch") + 1] == "vgg11"
    assert cmd[cmd.index("--epochs") + 1] == "3"


def test_python_is_ruff_clean() -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([VENV_BIN / "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_types_check() -> None:
    # mypy over the package, tools/ and the top-level scripts (pyproject.toml's [tool.mypy])
    proc = subprocess.run([VENV_BIN / "python", "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shell_is_shellcheck_clean() -> None:
    scripts = ["run", "config.sh", ".ci/run", *(p.name for p in ROOT.glob("*.sh"))]
    scripts += [f"tools/{p.name}" for p in (ROOT / "tools").glob("*.sh")]
    proc = subprocess.run(
        [VENV_BIN / "shellcheck", "-x", *sorted(set(scripts))], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fresh_checkout(dest: Path) -> Path:
    """This checkout's files (committed or not, never ignored ones) as a fresh clone would have them."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_dry_run_of_every_verb_on_a_fresh_checkout_exits_0_and_writes_nothing(tmp_path: Path) -> None:
    clone = _fresh_checkout(tmp_path / "clone")
    verbs = re.findall(r"^  ([a-z][a-z0-9-]*)\b", run_cli(clone / "run", "help").stdout, re.M)
    assert {"venv", "lock", "local1", "docker2", "serve", "ais", "tail", "killall"} <= set(verbs)
    needs = {"nodes": ["localhost,gpu2"], "plot": ["runs/x"]}  # the arguments help names as required
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}  # none of this shell's settings
    before = _tree(clone)
    for verb in verbs:
        proc = subprocess.run(
            [str(clone / "run"), "-n", verb, *needs.get(verb, [])], cwd=clone, capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, f"./run -n {verb}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert proc.stdout.strip() or verb == "help", f"./run -n {verb} printed no command"
        assert _tree(clone) == before, f"./run -n {verb} wrote {sorted(_tree(clone) - before)}"
    serve = subprocess.run([str(clone / "run"), "-n", "serve"], cwd=clone, capture_output=True, text=True, env=env)
    assert "nginx.conf <<'CONF'" in serve.stdout and "root " + str(clone / "data/demo/shards") in serve.stdout


def test_the_test_verb_installs_system_packages_only_when_asked(tmp_path: Path) -> None:
    # ./run test apt-installed Slurm, munge, nginx, buildah and debootstrap on a user's machine unasked
    if os.getuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("installs need root and apt-get")
    bin_dir, gone = tmp_path / "bin", {"sbatch", "slurmctld", "slurmd", "munged"}
    bin_dir.mkdir()
    for folder in dict.fromkeys(os.environ["PATH"].split(os.pathsep)):  # this PATH without Slurm's commands
        for program in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if program.name not in gone and not (bin_dir / program.name).exists():
                (bin_dir / program.name).symlink_to(program)
    env = {"PATH": str(bin_dir), "VENV": ".venv"}
    asked = run_cli(ROOT / "run", "-n", "test", "--install-deps", "-k", "none", env=env)
    assert "apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge" in asked.stdout
    unasked = run_cli(ROOT / "run", "-n", "test", "-k", "none", env=env)
    assert "apt-get" not in unasked.stdout
    assert (
        "run: slurmctld slurmd slurm-client munge not installed (./run test --install-deps installs them as root on "
        "Debian, or: apt-get install slurmctld slurmd slurm-client munge); the Slurm test is skipped"
    ) in unasked.stderr


def _pins(lock: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(version, marker)] of a lock written by ./run lock."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith(("#", " ")):
            spec, _, marker = line.split("#")[0].partition(";")
            name, version = spec.strip().split("==")
            pins.setdefault(canonicalize_name(name), []).append((version, marker.strip()))
    return pins


def _ranges(reqs: Path) -> list[Requirement]:
    out = []
    for line in reqs.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            out += _ranges(reqs.parent / line[2:].strip())
        elif line:
            out.append(Requirement(line))
    return out


def test_each_lock_pins_its_ranges_and_agrees_with_the_dev_lock() -> None:
    dev = _pins(ROOT / "requirements-dev.lock")
    for name in ("requirements.txt", "requirements-ray.txt", "requirements-dev.txt"):
        pins = _pins(ROOT / name.replace(".txt", ".lock"))
        for req in _ranges(ROOT / name):
            versions = [v for v, _ in pins.get(canonicalize_name(req.name), [])]
            assert versions, f"{req.name} is in {name} but not in its lock: ./run lock"
            assert all(req.specifier.contains(v, prereleases=True) for v in versions), (
                f"{name} asks {req}, the lock has {versions}: ./run lock"
            )
        # the same versions (the dev lock's markers may be wider: its extra packages need some on more platforms)
        same = all([v for v, _ in dev[n]] == [v for v, _ in p] for n, p in pins.items())
        assert same, f"{name}'s lock differs from the dev lock: ./run lock"
    uv_version = re.search(r"^UV_VERSION=(\S+)", (ROOT / "run").read_text(), re.M).group(1)
    assert dev["uv"] == [(uv_version, "")], "the uv the dev lock pins is the one ./run installs (UV_VERSION)"


def test_venv_adds_the_extras_at_the_versions_the_tests_use() -> None:
    # timm's hint said `pip install .[timm]` (which pip?), ./run's venv had no way to add an extra, Lightning
    # was none, and MLflow "with the lock as a constraint" resolved mlflow 1.27.0, which failed to import
    venv = {"VENV": str(VENV_BIN.parent)}
    plan = run_cli(ROOT / "run", "-n", "venv", "--extra", "timm,lightning", "--extra", "mlflow", env=venv).stdout
    (add,) = [shlex.split(line) for line in plan.splitlines() if ".[" in line]
    assert add[:3] == [str(VENV_BIN / "uv"), "pip", "install"]
    assert add[add.index("--editable") + 1] == ".[timm,lightning,mlflow]"
    assert [add[i + 1] for i, a in enumerate(add) if a == "-c"] == ["requirements.lock", "requirements-dev.lock"]
    # so the dev lock, which the tests ran with, pins each extra's packages: each range is requirements-dev.txt's
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"dali", "timm", "mlflow", "wandb", "lightning"} <= set(extras)
    dev = {canonicalize_name(r.name): r.specifier for r in _ranges(ROOT / "requirements-dev.txt")}
    for name, reqs in extras.items():
        for req in map(Requirement, reqs):
            assert dev.get(canonicalize_name(req.name)) == req.specifier, f"the {name} extra's {req}: not the tests'"
    unknown = run_cli(ROOT / "run", "-n", "venv", "--extra", "timm,torchaudio", env=venv, check=False)
    assert unknown.returncode == 1 and ".[" not in unknown.stdout
    assert unknown.stderr == f"run: unknown extra 'torchaudio': one of {', '.join(sorted(extras))} (pyproject.toml)\n"


def test_the_venvs_set_up_says_each_step_and_takes_torchs_cpu_build_where_asked(tmp_path: Path) -> None:
    # the first set-up was silent for minutes, installing 5.5 GB of CUDA torch on a machine without a GPU
    env = {"VENV": str(tmp_path / "venv")}  # none yet: the whole set-up is planned
    plan = run_cli(ROOT / "run", "-n", "venv", env=env).stdout.splitlines()
    said = [i for i, line in enumerate(plan) if line.startswith("# ")]
    assert len(said) == 5 and all(not plan[i + 1].startswith("#") for i in said), "each step, then its command"
    assert "TORCH_BACKEND=cpu" in plan[said[2]] and "-r requirements.lock" in plan[said[2] + 1]
    cpu = run_cli(ROOT / "run", "-n", "venv", env={**env, "TORCH_BACKEND": "cpu"}).stdout.splitlines()
    (install,) = [shlex.split(line) for line in cpu if "--torch-backend" in line]
    # the ranges at the lock's versions: a constraint adds no package (the lock's CUDA libraries stay out)
    assert install[3:9] == ["-r", "requirements.txt", "-c", "requirements.lock", "--torch-backend", "cpu"]
    assert "-r requirements.lock" not in "\n".join(cpu)


def test_the_scripts_run_by_a_python_without_the_dependencies_say_how_to_get_them(tmp_path: Path) -> None:
    # `./train.py --help` outside the venv was ModuleNotFoundError's traceback
    for script, verb in (("train.py", "local1"), ("imagenet_shards.py", "shards")):
        # -S: no site-packages, as a system Python without torch or click
        proc = subprocess.run([sys.executable, "-S", ROOT / script, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"{script}: {sys.executable} has no module ")
        assert proc.stderr.endswith(f": ./run venv, then .venv/bin/python {script} --help (or ./run {verb} ...)\n")


# The tests that build this checkout run one build at a time: setuptools writes into the source
# tree (build/, *.egg-info). The pip resolve failed once in a clean clone's CI (2026-12-02) while
# its two pips prepared the tree at once; its cause was not kept (pip's stderr was dropped then).
SOURCE_TREE = pytest.mark.xdist_group("source-tree")


@pytest.mark.slow
@SOURCE_TREE
def test_pip_resolves_the_locked_torch_pair_with_and_without_the_lock(tmp_path: Path) -> None:
    # open-ended, `pip install .` backtracked through six torch releases to an older pair than the lock's
    pins = _pins(ROOT / "requirements.lock")
    locked = {name: pins[name][0][0] for name in ("torch", "torchvision")}

    for args in [(), ("-c", str(ROOT / "requirements.lock"))]:
        report = tmp_path / f"report{len(args)}.json"
        pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        done = subprocess.run([*pip, "--report", report, *args, ROOT], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"pip {' '.join(args)}: {done.stderr[-2000:]}"
        picked = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
        assert {name: picked.get(name) for name in locked} == locked, args


def test_the_venv_holds_exactly_the_locked_versions() -> None:
    wanted = {
        name: version
        for name, pins in _pins(ROOT / "requirements-dev.lock").items()
        for version, marker in pins
        if not marker or Marker(marker).evaluate()
    }
    # and this checkout, installed as the package over them
    wanted["imagenet-ais"] = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    assert installed == wanted


def test_the_venv_is_installed_compiled_so_no_process_compiles_torch_again() -> None:
    """Where PYTHONDONTWRITEBYTECODE is set (CI machines, our image), Python never caches what it
    compiles: the install must. A module no test imports shows it was compiled at install."""
    never_imported = importlib.util.find_spec("sympy.physics.mechanics")
    assert never_imported and never_imported.origin
    assert Path(importlib.util.cache_from_source(never_imported.origin)).is_file()


def test_ais_install_says_which_aisnode_is_there() -> None:
    # `./run -n ais-install` printed nothing where aisnode was built, and its version was never checked
    if not (ROOT / ".cache" / "bin" / "aisnode").exists():
        pytest.skip("no aisnode built here (./run test builds it)")
    said = run_cli(ROOT / "run", "-n", "ais-install").stderr
    assert said == "run: .cache/bin/aisnode is there, built from AIStore v1.5.0 (pinned: v1.5.0)\n"


@pytest.mark.slow
@SOURCE_TREE
def test_the_wheel_installs_into_a_fresh_venv_and_trains(tmp_path: Path) -> None:
    # `pip install .` was undocumented and untested; `python -m imagenet_ais` failed
    uv = VENV_BIN / "uv"
    run_cli(uv, "build", "--wheel", "--out-dir", tmp_path / "dist", "--no-build-isolation", "--quiet", ROOT)
    (wheel,) = (tmp_path / "dist").glob("imagenet_ais-*.whl")
    fresh = tmp_path / "venv"
    run_cli(uv, "venv", "--quiet", "--python", sys.executable, fresh)
    # the lock's versions, from uv's cache where ./run test just installed them
    run_cli(
        uv, "pip", "install", "--quiet", "--python", fresh / "bin" / "python", wheel, "-c", ROOT / "requirements.lock"
    )
    assert "--epoch-size N" in run_cli(fresh / "bin" / "imagenet-train", "--help").stdout
    assert "convert" in run_cli(fresh / "bin" / "imagenet-shards", "--help").stdout
    # away from the checkout (python -m puts the working directory first on sys.path) and its PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = [str(fresh / "bin" / "python")]
    where = subprocess.run([*python, "-c", "import imagenet_ais; print(imagenet_ais.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert where.startswith(str(fresh)), "the wheel's package, not this checkout's"
    step = shlex.split("--synthetic --arch shufflenet_v2_x0_5 --batch-size 2 --image-size 32 --max-steps 1")
    proc = subprocess.run([*python, "-m", "imagenet_ais", "train", *step, "--output", "run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0 and "stopped at step 1" in proc.stdout, proc.stderr
    assert (tmp_path / "run" / "last.pt").exists()
