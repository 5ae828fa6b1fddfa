"""The ./run front door and the project's lint gates."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_cli

VENV_BIN = Path(sys.executable).parent


def test_help_lists_the_verbs() -> None:
    out = run_cli(ROOT / "run", "help").stdout
    for verb in ("venv", "test", "shards", "local1", "local2"):
        assert f"\n  {verb} " in out


def test_unknown_verb_prints_usage_and_exits_2() -> None:
    proc = run_cli(ROOT / "run", "frobnicate", check=False)
    assert proc.returncode == 2
    assert "unknown verb 'frobnicate'" in proc.stderr and "usage:" in proc.stderr


def test_dry_run_prints_the_commands_with_settings_from_the_environment(tmp_path: Path) -> None:
    env = {"DATA": str(tmp_path / "my shards"), "ARCH": "resnet34", "NPROC": "3", "WORKERS": "2", "VENV": ".venv"}
    out = run_cli(ROOT / "run", "-n", "local2", "--epochs", "1", env=env).stdout.splitlines()
    cmd = shlex.split(out[-1])
    assert cmd[:4] == [".venv/bin/torchrun", "--standalone", "--nproc-per-node", "3"]
    assert cmd[cmd.index("--data") + 1] == str(tmp_path / "my shards")
    assert cmd[cmd.index("--arch") + 1] == "resnet34"
    assert cmd[cmd.index("--output") + 1] == "runs/local2"
    assert cmd[-4:] == ["--resume", "auto", "--epochs", "1"]
    assert not (tmp_path / "my shards").exists()


def test_config_local_overrides_defaults_and_the_environment_overrides_it(tmp_path: Path) -> None:
    local = ROOT / "config.local.sh"
    assert not local.exists(), "tests must not clobber a developer's config.local.sh"
    local.write_text("ARCH=vgg11\nEPOCHS=7\n")
    try:
        out = run_cli(ROOT / "run", "-n", "local1", env={"DATA": str(tmp_path), "EPOCHS": "3"}).stdout
    finally:
        local.unlink()
    cmd = shlex.split(out.splitlines()[-1])
    assert cmd[cmd.index("--arch") + 1] == "vgg11"
    assert cmd[cmd.index("--epochs") + 1] == "3"


def test_python_is_ruff_clean() -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([VENV_BIN / "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shell_is_shellcheck_clean() -> None:
    scripts = ["run", "config.sh", ".ci/run", *(p.name for p in ROOT.glob("*.sh")), "tools/ngc_node.sh"]
    proc = subprocess.run(
        [VENV_BIN / "shellcheck", "-x", *sorted(set(scripts))], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
