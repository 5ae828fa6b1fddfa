#!/usr/bin/env python3
"""NGC Base Command jobs for ./run: submit (singlenode, ais), tail, killall.

Settings come from the environment (./run exports config.sh's). Every `ngc` call goes through
`call`, which with --dry-run prints the fully quoted command instead. Credentials travel only
as NGC secret names (--secret), never as values on a command line.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent.parent
LAST_JOB = ROOT / ".cache" / "last-job"
WAITING = {"CREATED", "QUEUED", "STARTING", "PENDING_TERMINATION", "PREEMPTED", "PENDING_STORAGE_CREATION"}
RUNNING = {"RUNNING"}
ACTIVE = ("CREATED", "QUEUED", "STARTING", "RUNNING", "PREEMPTED")
IN_IMAGE = "/workspace/imagenet-ais"  # the Dockerfile's WORKDIR
JOB_ENV = ("AIS_ENDPOINT",)  # plain settings a job gets via --env-var (besides DATA)


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def call(args: list[str], dry_run: bool, capture: bool = True) -> subprocess.CompletedProcess:
    if dry_run:
        click.echo(shlex.join(args))
        return subprocess.CompletedProcess(args, 0, "", "")
    need_ngc()
    return subprocess.run(args, capture_output=capture, text=True, check=False)


def need_ngc() -> None:
    """A one-line error where the NGC CLI is not installed: before anything else is asked for."""
    if not shutil.which("ngc"):
        raise click.ClickException(
            "ngc not found: install the NGC CLI (https://org.ngc.nvidia.com/setup/installers/cli) "
            "and run `ngc config set`"
        )


def ngc(*args: str) -> list[str]:
    scope = [(f"--{k}", env(f"NGC_{k.upper()}")) for k in ("org", "team", "ace")]
    return ["ngc", "base-command", "job", *args, *[a for pair in scope if pair[1] for a in pair]]


def job_command(train_args: list[str], data: str) -> str:
    """What every node of the job runs: the entry script, then train.py with --resume auto; the
    caller's own --data (train.py mixes every --data it is given) stands instead of ``data``."""
    own = any(a == "--data" or a.startswith("--data=") for a in train_args)
    node = [
        "bash",
        "tools/ngc_node.sh",
        *([] if own else ["--data", data]),
        "--output",
        f"{env('NGC_RESULT_DIR', '/results')}/train",
        *train_args,
    ]
    return f"cd {IN_IMAGE} && {shlex.join(node)}"


def job_settings(multinode: bool, dry_run: bool) -> dict[str, str]:
    """The settings a job cannot go without; a dry run shows <NAME> for those unset, and says so."""
    if multinode:
        settings = {name: env(name) for name in ("AIS_BUCKET", "AIS_ENDPOINT")}
        need = "./run ais needs AIS_ENDPOINT and AIS_BUCKET (the cluster the nodes read from)"
    else:
        settings = {"NGC_DATA": env("NGC_DATA") or env("DATA")}
        need = "no data for the job: set NGC_DATA (the dataset's path inside the job)"
    if missing := [name for name, value in settings.items() if not value]:
        if not dry_run:
            raise click.ClickException(f"{need} in config.local.sh or the environment")
        click.echo(f"dry run: {', '.join(missing)} not set, shown as <NAME>: {need}", err=True)
        settings.update({name: f"<{name}>" for name in missing})
    image = env("IMAGE")
    if image.startswith("nvcr.io/local/"):
        click.echo(
            f"warning: IMAGE {image} is under nvcr.io/local/, which no NGC job can pull: set NGC_ORG "
            "(the image goes to nvcr.io/ORG/...), then ./run push",
            err=True,
        )
    return settings


def submit_args(multinode: bool, train_args: list[str], dry_run: bool = False) -> list[str]:
    settings = job_settings(multinode, dry_run)
    data = f"ais://{settings['AIS_BUCKET']}" if multinode else settings["NGC_DATA"]
    job_env = {**{k: settings.get(k) or env(k) for k in JOB_ENV if settings.get(k) or env(k)}, "DATA": data}
    args = ngc(
        "run",
        "--name", env("NGC_JOB_NAME", "imagenet-ais"),
        "--image", env("IMAGE"),
        "--instance", env("NGC_INSTANCE"),
        "--result", env("NGC_RESULT_DIR", "/results"),
        "--label", env("NGC_LABEL", "imagenet_ais"),
        "--preempt", env("NGC_PREEMPT", "RESUMABLE"),
        "--commandline", job_command(train_args, data),
        "--format_type", "json",
    )  # fmt: skip
    for key, value in job_env.items():
        args += ["--env-var", f"{key}:{value}"]
    for spec in env("NGC_SECRETS").split():
        args += ["--secret", spec]
    args += shlex.split(env("NGC_MOUNTS"))
    if multinode:
        args += [
            "--replicas",
            env("NGC_REPLICAS", "2"),
            "--array-type",
            "PYTORCH",
            "--total-runtime",
            env("NGC_TOTAL_RUNTIME", "8H"),
        ]
    return args


def parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise click.ClickException(f"unexpected answer from `ngc {what}`: {text.strip()[:200]}") from None


def status_of(job: dict) -> str:
    status = job.get("jobStatus", {})
    return status.get("status", "UNKNOWN") if isinstance(status, dict) else str(status)


@click.group()
@click.option("--dry-run", is_flag=True, help="print the ngc commands instead of running them")
@click.pass_context
def cli(ctx: click.Context, dry_run: bool) -> None:
    """NGC jobs of this project."""
    ctx.obj = dry_run


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--multinode", is_flag=True, help="PyTorch array job over NGC_REPLICAS nodes, data from AIStore")
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def submit(dry_run: bool, multinode: bool, train_args: tuple[str, ...]) -> None:
    """Submit a training job; remember its id for tail."""
    proc = call(submit_args(multinode, list(train_args), dry_run), dry_run)
    if dry_run:
        return
    if proc.returncode != 0:
        raise click.ClickException(f"ngc job run failed: {(proc.stderr or proc.stdout).strip()}")
    job_id = str(parse_json(proc.stdout, "job run")["job"]["id"])
    LAST_JOB.parent.mkdir(parents=True, exist_ok=True)
    LAST_JOB.write_text(job_id + "\n")
    click.echo(f"submitted NGC job {job_id}; follow it with ./run tail")


@cli.command()
@click.argument("job_id", required=False)
@click.option("--poll", default=15.0, show_default=True, help="seconds between polls")
@click.option("--lines", default=200, show_default=True)
@click.pass_obj
def tail(dry_run: bool, job_id: str | None, poll: float, lines: int) -> None:
    """Follow a job's log (default: the last submitted) until it ends; print its final status."""
    if not dry_run:
        need_ngc()  # (it said "give a job id" first, and "ngc not found" only after one)
    if not job_id:
        if LAST_JOB.exists():
            job_id = LAST_JOB.read_text().strip()
        elif dry_run:
            job_id = "JOB_ID"  # nothing was submitted: show the commands all the same
        else:
            raise click.ClickException("no job submitted from here yet: give a job id")
    info = ngc("info", job_id, "--format_type", "json")
    log = ngc("log", job_id, "--tail", "--lines", str(lines))
    if dry_run:
        call(info, True)
        call(log, True)
        return
    shown: list[str] = []
    said = ""
    while True:
        proc = call(info, False)
        if proc.returncode != 0:
            raise click.ClickException(f"ngc job info {job_id} failed: {(proc.stderr or proc.stdout).strip()}")
        status = status_of(parse_json(proc.stdout, "job info"))
        if status in WAITING:
            if status != said:
                click.echo(f"job {job_id} is {status}; waiting", err=True)
                said = status
        else:
            ended = status not in RUNNING
            out = call(log, False)
            if out.returncode == 0:
                shown = print_new(shown, out.stdout.splitlines(), ended)
            if ended:
                click.echo(f"job {job_id} ended: {status}")
                sys.exit(0 if status == "FINISHED_SUCCESS" else 1)
        time.sleep(poll)


def print_new(shown: list[str], window: list[str], ended: bool) -> list[str]:
    """Print the lines of the latest log window not printed before (windows overlap).

    While the job runs, its last line may still be growing (a line half-written, a progress
    bar): it waits for a later window, or it would be printed again each time it grew."""
    complete = window if ended else window[:-1]
    overlap = next((k for k in range(min(len(shown), len(complete)), 0, -1) if shown[-k:] == complete[:k]), 0)
    for line in complete[overlap:]:
        click.echo(line)
    return complete


@cli.command()
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_obj
def killall(dry_run: bool, yes: bool) -> None:
    """Kill this project's queued and running jobs (those with its label), nobody else's."""
    label = env("NGC_LABEL", "imagenet_ais")
    listing = ngc("list", "--label", label, *[a for s in ACTIVE for a in ("--status", s)], "--format_type", "json")
    if dry_run:
        call(listing, True)
        call(ngc("kill", "JOB_ID"), True)
        return
    proc = call(listing, False)
    if proc.returncode != 0:
        raise click.ClickException(f"ngc job list failed: {(proc.stderr or proc.stdout).strip()}")
    jobs = [j for j in parse_json(proc.stdout, "job list") if label in j.get("labels", []) and status_of(j) in ACTIVE]
    if not jobs:
        click.echo(f"no queued or running jobs labelled {label}")
        return
    for job in jobs:
        click.echo(f"{job['id']}  {status_of(job)}  {job.get('jobDefinition', {}).get('name', job.get('name', ''))}")
    if not yes:
        click.confirm(f"kill these {len(jobs)} jobs?", abort=True)
    for job in jobs:
        proc = call(ngc("kill", str(job["id"])), False)
        click.echo(
            f"killed {job['id']}" if proc.returncode == 0 else f"could not kill {job['id']}: {proc.stderr.strip()}"
        )


if __name__ == "__main__":
    cli()
