#!/usr/bin/env python3
"""Where each rank's GPU time goes: a kernel trace of a few training steps, summed up per rank.

Run under torchrun, with train.py's options after ``--``::

    torchrun --nproc-per-node 4 bench/rank_trace.py --at 300 --steps 20 --keep 0,1 --out DIR -- \\
        --data SHARDS --epoch-size 1281167 --max-steps 340 --log-every 10

It trains as train.py does and, from the first metrics record at or past step ``--at``, traces
``--steps`` steps with torch.profiler (kernels and copies on every stream of the GPU). Each rank
writes DIR/rank-R.json: per step, the time its GPU spent in the step's own kernels (the stream
with the most kernel time), in NCCL's (the gradients' all-reduce, waiting for the slowest rank
included), in the feed's (decode, crop: every other stream), how much of the feed's time ran
beside the step's, the time it did neither step nor all-reduce, and the step stream's idle time
split by what it waited for: the host's launch of the next kernel (the CPU behind), or work on
another stream (the all-reduce, the feed's event).
The ranks in ``--keep`` also keep their trace (DIR/trace-rank-R.json.gz: Perfetto, chrome://tracing).
Rank 0 prints a table of every rank's figures.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import torch
from torch.profiler import ProfilerActivity, profile

from imagenet_ais.cli import train as train_cli
from imagenet_ais.train import loop

Intervals = list[tuple[float, float]]


def merged(spans: Intervals) -> Intervals:
    """The union of ``spans`` as sorted, disjoint intervals."""
    out: Intervals = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(spans: Intervals) -> float:
    return sum(end - start for start, end in spans)


def overlap(a: Intervals, b: Intervals) -> float:
    """Time covered by both of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per-step milliseconds of a chrome trace's GPU activity, by what it was for."""
    events = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    nccl = [e for e in events if re.search("nccl", e["name"], re.I)]
    others = [e for e in events if e not in nccl]
    by_stream: Counter[int] = Counter()
    for e in others:
        if e["cat"] == "kernel":
            by_stream[e["args"]["stream"]] += e["dur"]
    step_stream = by_stream.most_common(1)[0][0]
    step = [e for e in others if e["args"].get("stream") == step_stream]
    feed = [e for e in others if e["args"].get("stream") != step_stream]
    spans = {name: merged([(e["ts"], e["ts"] + e["dur"]) for e in group]) for name, group in
             (("step", step), ("nccl", nccl), ("feed", feed))}  # fmt: skip
    window = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    feed_kernels: Counter[str] = Counter()
    for e in feed:
        feed_kernels[e["name"][:60]] += e["dur"]
    host, dependency = waits(step, trace)
    per_step = 1000 * steps  # µs → ms per step
    return {
        "window_ms": window / per_step,
        "step_ms": length(spans["step"]) / per_step,
        "nccl_ms": length(spans["nccl"]) / per_step,
        "feed_ms": length(spans["feed"]) / per_step,
        "feed_beside_step_ms": overlap(spans["step"], spans["feed"]) / per_step,
        "idle_ms": (window - length(merged(spans["step"] + spans["nccl"]))) / per_step,
        "wait_host_ms": host / per_step,
        "wait_dependency_ms": dependency / per_step,
        "feed_kernels_ms": {k: v / per_step for k, v in feed_kernels.most_common(8)},
    }


def waits(step: list[dict], trace: dict[str, Any]) -> tuple[float, float]:
    """The step stream's gaps (over 20 µs), split by what its next kernel waited for: its launch
    (the host had not yet asked for it: the CPU is behind), or something already asked for on
    another stream (the all-reduce, an event)."""
    launched = {  # correlation id → when the launching runtime call returned
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in trace["traceEvents"]
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    host = dependency = 0.0
    ordered = sorted(step, key=lambda e: e["ts"])
    for before, after in itertools.pairwise(ordered):
        idle_from, idle_to = before["ts"] + before["dur"], after["ts"]
        if idle_to - idle_from < 20:
            continue
        launch = launched.get(after["args"].get("correlation"), idle_from)
        late = max(0.0, min(idle_to, launch) - idle_from)
        host += late
        dependency += idle_to - idle_from - late
    return host, dependency


class Tracer:
    """Starts the profiler at the first record at or past step ``at`` and stops it ``steps`` later."""

    def __init__(self, at: int, steps: int, rank: int, keep: set[int], out: Path) -> None:
        self.at, self.steps, self.rank, self.keep, self.out = at, steps, rank, keep, out
        self.prof: profile | None = None
        self.first = 0

    def on_record(self, record: dict) -> None:
        if record["kind"] != "train":
            return
        if self.prof is None and record["step"] >= self.at:
            # the GPU's activity and the runtime calls that asked for it; tracing the CPU's
            # operators too slowed the steps from 50 ms to 75 (4 × H100)
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.start()
            self.first = record["step"]
        elif self.prof and self.first and record["step"] >= self.first + self.steps:
            self.prof.stop()
            self.save(record["step"] - self.first)
            self.first = 0

    def save(self, steps: int) -> None:
        raw = self.out / f".trace-rank-{self.rank}.json"
        self.prof.export_chrome_trace(str(raw))
        summary = {"rank": self.rank, "steps": steps, **summarise(json.loads(raw.read_text()), steps)}
        if self.rank in self.keep:
            with raw.open("rb") as src, gzip.open(self.out / f"trace-rank-{self.rank}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        raw.unlink()
        (self.out / f"rank-{self.rank}.json").write_text(json.dumps(summary, indent=2))


def table(out: Path, world: int) -> str:
    rows = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    fields = ("window_ms", "step_ms", "nccl_ms", "feed_ms", "feed_beside_step_ms", "wait_host_ms", "wait_dependency_ms")
    lines = ["rank  " + "  ".join(f"{f[:-3]:>18}" for f in fields) + "   (ms per step)"]
    lines += [f"{r['rank']:4}  " + "  ".join(f"{r[f]:18.2f}" for f in fields) for r in rows]
    for r in rows:
        kernels = ", ".join(f"{k} {v:.2f}" for k, v in r["feed_kernels_ms"].items())
        lines.append(f"rank {r['rank']} feed kernels (ms per step): {kernels}")
    return "\n".join(lines)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--at", default=300, show_default=True, help="trace from the first record at or past this step")
@click.option("--steps", default=20, show_default=True, help="steps to trace (a multiple of --log-every)")
@click.option("--keep", default="0,1", show_default=True, help="ranks whose whole trace is kept")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def main(at: int, steps: int, keep: str, out: Path, train_args: tuple[str, ...]) -> None:
    if not torch.cuda.is_available():
        raise click.UsageError("rank_trace.py traces GPU kernels: run it where CUDA is")
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    tracer = Tracer(at, steps, rank, {int(r) for r in keep.split(",") if r}, out)
    loop.train(train_cli.parse(list(train_args)), report=tracer.on_record)
    if rank == 0:
        deadline = time.monotonic() + 120  # every rank wrote its summary before its next collective
        while not all((out / f"rank-{r}.json").exists() for r in range(world)) and time.monotonic() < deadline:
            time.sleep(1)
        click.echo(table(out, world))


if __name__ == "__main__":
    sys.exit(main())
