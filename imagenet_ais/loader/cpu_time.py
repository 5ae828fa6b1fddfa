"""The CPU time of this machine's cores, or of the job's own (its affinity), from Linux's /proc/stat:
what tells ``--cpu-share auto`` how busy the cores are."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def cpu_jiffies(cpus: Collection[int] | None = None) -> tuple[int, int] | None:
    """(busy, all) time since boot, in jiffies, of ``cpus`` (numbers, as ``os.sched_getaffinity``
    gives them) or of every core together (Linux's /proc/stat); None elsewhere."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        # (a container whose /proc/stat numbers its own cores from 0 has none of ``cpus``: all of them, then)
        rows = _rows(lines, cpus) or _rows(lines, None)
    except (OSError, ValueError, IndexError):
        return None
    if not rows:
        return None
    busy = sum(sum(r) - r[3] - r[4] for r in rows)  # less idle and iowait
    return busy, sum(map(sum, rows))


def _rows(lines: list[str], cpus: Collection[int] | None) -> list[list[int]]:
    """The time columns of ``cpus``' lines of /proc/stat, or of its every-core line (None)."""
    # user … steal: the guest columns after them are counted in user and nice already
    return [[int(v) for v in line.split()[1:9]] for line in lines if _counted(line.partition(" ")[0], cpus)]


def _counted(name: str, cpus: Collection[int] | None) -> bool:
    if cpus is None:
        return name == "cpu"
    return name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus


def own_cpu_jiffies() -> tuple[int, int] | None:
    """``cpu_jiffies`` of the CPUs this process may run on (its affinity: taskset's, Slurm's
    binding): a job bound to 8 of 16 cores has them full while the host's are half idle."""
    return cpu_jiffies(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)
