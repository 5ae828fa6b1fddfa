#!/usr/bin/env python3
"""What slowed a run traced by bench/stall_trace.py: its windows of 10 batches handed to the loop
that took longer than the median window, each with what overlapped it (full collections in any
process, the feed's host thread waiting over 50 ms for a worker's batch, decodes over 35 ms, the
host's busy and stolen CPU shares); then the collections, the Collector's freeze, a stop of the
feed, the decodes and the workers' batches over the whole run.

The loop runs ahead of the GPU and waits for it at each log window (a metrics sync), so single
steps are not a measure: a window of 10 handed batches is, at ``--log-every 10``.

    python3 bench/stall_report.py TRACE_DIR [--from-step 100]
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path

import click

WINDOW = 10  # batches handed over per window
SLOW = 1.08  # a window this much over the median is named


def load(folder: Path) -> tuple[int, dict[int, list[dict]]]:
    """The training process's pid, and every process's events by pid."""
    events: dict[int, list[dict]] = {}
    main = -1
    for path in sorted(folder.glob("trace-*.jsonl")):
        pid = int(path.stem.split("-")[1])
        events[pid] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any(e["ev"] == "start" for e in events[pid]):
            main = pid
    return main, events


def span(e: dict) -> tuple[float, float]:
    return e.get("t0", e.get("t", 0.0)), e.get("t1", e.get("t", 0.0))


def inside(pid: int, main: int, e: dict) -> str | None:
    """How an event that overlapped a slow window is named, if it is one that can slow it."""
    t0, t1 = span(e)
    ms = (t1 - t0) * 1000
    if e["ev"] == "gc" and e["gen"] == 2:
        return f"gc {'main' if pid == main else 'worker'} {ms:.0f} ms"
    if e["ev"] == "recv" and ms > 50:
        return f"host waited {ms:.0f} ms for worker {e['worker']}"
    if e["ev"] == "decode" and ms / e.get("batches", 1) > 35:  # (a call may decode two batches)
        return f"decode {ms:.0f} ms (cpu {e['cpu'] * 1000:.0f}, {e['jpegs']} jpegs, {e.get('batches', 1)} batches)"
    return None


def windows(main: int, events: dict[int, list[dict]], first: int) -> None:
    handed = [e["t"] for e in events[main] if e["ev"] == "step"]
    rows = [(s, handed[s + WINDOW] - handed[s], handed[s]) for s in range(first, len(handed) - WINDOW, WINDOW)]
    median = statistics.median(dt for _, dt, _ in rows)
    slow = [row for row in rows if row[1] > SLOW * median]
    total, lost = sum(dt for _, dt, _ in rows), sum(dt - median for _, dt, _ in slow)
    click.echo(
        f"batches {first}-{rows[-1][0] + WINDOW}: {total:.1f} s, median window of {WINDOW} {median * 1000:.0f} ms; "
        f"{len(slow)} windows over {SLOW:g}× it lost {lost:.2f} s ({lost / total:.1%})"
    )
    cpus = [e for e in events[main] if e["ev"] == "cpu"]
    for start, dt, t0 in slow:
        t1 = t0 + dt
        named = {
            what
            for pid, evs in events.items()
            for e in evs
            if span(e)[1] >= t0 and span(e)[0] <= t1 and (what := inside(pid, main, e))
        }
        samples = [c for c in cpus if t0 <= c["t"] <= t1]
        host = (
            f"host cpus {statistics.fmean(c['busy'] for c in samples):.2f}, "
            f"stolen {statistics.fmean(c.get('steal', 0.0) for c in samples):.2f}"
            if samples
            else ""
        )
        click.echo(f"  {start}: {dt * 1000:.0f} ms (+{(dt - median) * 1000:.0f}) {host}; {'; '.join(sorted(named))}")


def collections(main: int, events: dict[int, list[dict]]) -> None:
    for role, pids in (("main", [main]), ("workers", [p for p in events if p != main])):
        by_gen: dict[int, list[float]] = defaultdict(list)
        for pid in pids:
            for e in (e for e in events[pid] if e["ev"] == "gc"):
                by_gen[e["gen"]].append(e["t1"] - e["t0"])
        for gen, times in sorted(by_gen.items()):
            longest = max(times) * 1000
            click.echo(f"gc {role} gen {gen}: {len(times)} over 2 ms, {sum(times):.2f} s, max {longest:.0f} ms")


def freezing(main: int, events: dict[int, list[dict]]) -> None:
    """What the run's Collector found and did, and the step of each full collection after."""
    steps = [e["t"] for e in events[main] if e["ev"] == "step"]
    for e in events[main]:
        if e["ev"] == "collector":
            click.echo(f"collector made: freeze count {e['freeze_count']}, collector {'on' if e['enabled'] else 'off'}")
        elif e["ev"] == "settle":
            click.echo(
                f"settle at step {bisect.bisect(steps, e['t0'])}: {'idle' if e['idle'] else 'froze'} in "
                f"{(e['t1'] - e['t0']) * 1000:.0f} ms, freeze count {e['freeze_count']}"
            )
        elif e["ev"] == "stopped":
            stopped_at = bisect.bisect(steps, e["since"])
            click.echo(f"no batch came after step {stopped_at} for {e['t'] - e['since']:.0f} s: see stacks-PID.txt")
    full = [e for e in events[main] if e["ev"] == "gc" and e["gen"] == 2]
    click.echo("gc main gen 2 at steps: " + ", ".join(f"{bisect.bisect(steps, e['t0'])}" for e in full))


def quantiles(values: list[float]) -> str:
    """p50, p90 and max of ``values`` in ms."""
    values = sorted(values)
    return " ".join(f"{q} {values[min(len(values) - 1, int(f * len(values)))] * 1000:.1f}" for q, f in (
        ("p50", 0.5), ("p90", 0.9), ("max", 1.0)
    ))  # fmt: skip


def stages(main: int, events: dict[int, list[dict]]) -> None:
    calls = [e for e in events[main] if e["ev"] == "decode"]
    if calls:
        cpu = statistics.median(e["cpu"] for e in calls) * 1000
        jpegs = statistics.median(e["jpegs"] for e in calls)
        walls = quantiles([e["t1"] - e["t0"] for e in calls])
        merged = sum(e.get("batches", 1) > 1 for e in calls) / len(calls)
        click.echo(
            f"decode ms a call: {walls}; cpu p50 {cpu:.1f}, jpegs p50 {jpegs:.0f}, calls of 2+ batches {merged:.2f}"
        )
    made = [e for evs in events.values() for e in evs if e["ev"] == "fetch"]
    if made:
        click.echo(f"workers' batches ms: {quantiles([e['t1'] - e['t0'] for e in made])}")


@click.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--from-step", "first", default=100, show_default=True)
def main(folder: Path, first: int) -> None:
    """The report of one traced run."""
    pid, events = load(folder)
    if sum(e["ev"] == "step" for e in events[pid]) <= first + WINDOW:
        click.echo(f"{folder}: too few batches handed over")
        return
    windows(pid, events, first)
    collections(pid, events)
    freezing(pid, events)
    stages(pid, events)


if __name__ == "__main__":
    main()
