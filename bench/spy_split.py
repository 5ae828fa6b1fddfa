#!/usr/bin/env python3
"""Where each thread's samples went, from py-spy's raw (collapsed) output: one table per file.

Reads what ``py-spy record --threads --native --idle --format raw`` writes (bench/own_loop.py's
``--profile``: its fed steady state and its ceiling, side by side) and puts each sample of each
thread into the first of these that its stack shows, innermost frame first:

- ``gil``: waiting for the GIL (``take_gil``, or a condition wait straight from a Python frame);
- ``driver lock``: inside the CUDA driver (libcuda), in a mutex, rwlock, futex or yield;
- ``driver``: elsewhere inside the CUDA driver;
- ``allocator``: inside PyTorch's CUDA caching allocator;
- ``waits``: blocked in a wait of its own (a condition, a futex, a sleep, a poll, a queue);
- ``runs``: anything else (the interpreter, PyTorch's C++, a library's own work).

    python3 bench/spy_split.py OUT/spy.txt OUT/spy-ceiling.txt [--thread MainThread]
    python3 bench/spy_split.py OUT/spy.txt --calls feed-decode    # that thread's driver samples by entry point

``--calls THREAD`` lists instead where that thread's samples inside the driver entered it (the
outermost named CUDA driver or runtime frame, e.g. ``cuLaunchKernel``), and which lock it waited
in there, if any (a read or write lock, a mutex): the evidence of bench/RESULTS.md run AV.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import click

LOCKS = re.compile(r"mutex|rwlock|futex|sched_yield|lll_lock")
WAITS = re.compile(r"pthread_cond|futex|nanosleep|epoll|poll|select|sem_|acquire_lock|accept|recv|wait")
PYTHON = re.compile(r"\(.*:\d+\)$")  # a Python frame: "function (file.py:line)"
CATEGORIES = ("gil", "driver lock", "driver", "allocator", "waits", "runs")


def category(frames: list[str]) -> str:
    """The first category (innermost frame first) a stack shows: see the module's docstring. A
    libc frame without a symbol is passed over; a condition wait called straight from a Python
    frame is the interpreter taking the GIL back (py-spy drops the interpreter's own frames)."""
    named = [(i, f) for i, f in enumerate(frames) if not f.startswith("0x")]
    if any("take_gil" in f for _, f in named):
        return "gil"
    for i, frame in reversed(named):
        if "libcuda" in frame:
            return "driver lock" if any(LOCKS.search(f) for f in frames[i + 1 :]) else "driver"
        if "CUDACachingAllocator" in frame:
            return "allocator"
    if not named:
        return "runs"
    i, inner = named[-1]
    if inner.startswith("pthread_cond") and i > 0 and PYTHON.search(frames[i - 1]):
        return "gil"
    native = not PYTHON.search(inner)
    return "waits" if native and WAITS.search(inner.partition(" (")[0]) else "runs"


def stacks(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """Each line of py-spy's raw output: the thread's name, its frames (outermost first), the samples."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, *frames = stack.split(";")
        yield head.partition(": ")[2] or head, frames, int(count)


def split(path: Path) -> dict[str, Counter[str]]:
    """Samples per category of each thread (by its name, over all threads of that name)."""
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    for name, frames, count in stacks(path):
        threads[name][category(frames)] += count
    return threads


def driver_calls(path: Path, thread: str) -> Counter[tuple[str, str]]:
    """``thread``'s samples inside the CUDA driver, by (entry point, lock waited in or "-")."""
    calls: Counter[tuple[str, str]] = Counter()
    for name, frames, count in stacks(path):
        if name != thread or category(frames) not in ("driver lock", "driver"):
            continue
        inside = next(i for i, f in enumerate(frames) if "libcuda" in f)
        named = [f for f in frames[: inside + 1] if re.match(r"cu[A-Z]|cuda[A-Z]", f)]
        entry = named[0].partition(" (")[0] if named else frames[inside].partition(" (")[0]
        lock = next(
            (kind for kind in ("rwlock_wrlock", "rwlock_rdlock", "mutex") if any(kind in f for f in frames)), "-"
        )
        calls[entry, lock] += count
    return calls


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--thread", "only", multiple=True, help="only threads of these names (default: all)")
@click.option("--calls", metavar="THREAD", help="that thread's driver samples by entry point and lock instead")
def main(files: tuple[Path, ...], only: tuple[str, ...], calls: str | None) -> None:
    if calls:
        for path in files:
            click.echo(f"{path}: {calls}'s samples inside the CUDA driver")
            for (entry, lock), count in driver_calls(path, calls).most_common():
                click.echo(f"  {count:>6}  {entry}  {lock}")
        return
    for path in files:
        click.echo(f"{path}:")
        click.echo(f"  {'thread':<22}{'samples':>8}" + "".join(f"{c:>13}" for c in CATEGORIES))
        for name, counts in sorted(split(path).items()):
            if only and name not in only:
                continue
            total = sum(counts.values())
            shares = "".join(f"{counts[c] / total:>13.1%}" for c in CATEGORIES)
            click.echo(f"  {name[:21]:<22}{total:>8}{shares}")


if __name__ == "__main__":
    main()
