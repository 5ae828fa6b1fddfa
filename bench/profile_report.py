#!/usr/bin/env python3
"""What the feed's decode thread does on the GPU, from a torch.profiler trace of a fed run (#65, goal 4).

Reads the trace that ``bench/stall_trace.py --x-profile=FIRST:LAST`` writes (OUT/profile.json.gz)
and prints:

- each thread's CUDA runtime calls (count, total ms): the decode thread is the one that copies
  and launches on nvJPEG's streams;
- for the kernels and copies the decode thread launched, the time from the launch call to the
  start on the GPU (percentiles), and its event synchronisations;
- for launches that waited over 1 ms, which kernel of the training stream was running when the
  launch came: what the decode waits behind.

    python3 bench/profile_report.py OUT/trace-ROW-NAME/profile.json.gz
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys
from typing import Any

LONG_WAIT_US = 1000.0


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    at = {p: ordered[min(len(ordered) - 1, len(ordered) * p // 100)] for p in (10, 50, 90, 99)}
    return ", ".join(f"p{p} {v:,.1f}" for p, v in at.items()) + f", max {ordered[-1]:,.1f} µs (n {len(ordered):,})"


def main(path: str) -> None:
    with gzip.open(path) as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    calls = collections.Counter((e["tid"], e["name"]) for e in runtime)
    spent = collections.Counter()
    for e in runtime:
        spent[e["tid"], e["name"]] += e["dur"]
    decode_thread = max({tid for tid, _ in calls}, key=lambda tid: calls[tid, "cudaEventSynchronize"])
    print("CUDA runtime calls by thread (count, ms):")
    for (tid, name), n in calls.most_common(16):
        mark = " (the decode thread)" if tid == decode_thread else ""
        print(f"  {tid}{mark} {name}: {n:,}, {spent[tid, name] / 1e3:,.1f} ms")
    mine = [e for e in runtime if e["tid"] == decode_thread]
    launched = {e["args"]["correlation"]: e for e in mine if "correlation" in e["args"]}
    gpu_work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    on_gpu = [e for e in gpu_work if e["args"].get("correlation") in launched]
    streams = collections.Counter(e["args"]["stream"] for e in on_gpu)
    print(f"the decode thread's GPU work: {len(on_gpu):,} kernels and copies on {len(streams)} streams")
    for cat in ("kernel", "gpu_memcpy"):
        waits = [e["ts"] - launched[e["args"]["correlation"]]["ts"] for e in on_gpu if e["cat"] == cat]
        if waits:
            print(f"  {cat}, launch to start: {percentiles(waits)}")
    syncs = [e["dur"] for e in mine if e["name"] == "cudaEventSynchronize"]
    print(f"  its cudaEventSynchronize: {percentiles(syncs)}, {sum(syncs) / 1e3:,.1f} ms in all")
    kernels = [e for e in gpu_work if e["cat"] == "kernel"]
    busiest = collections.Counter(e["args"]["stream"] for e in kernels).most_common(1)[0][0]  # the training step's
    step = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels if e["args"]["stream"] == busiest)
    starts = [s for s, _, _ in step]
    behind = collections.Counter()
    for e in on_gpu:
        launch = launched[e["args"]["correlation"]]["ts"]
        if e["cat"] == "kernel" and e["ts"] - launch > LONG_WAIT_US:
            i = bisect.bisect_right(starts, launch) - 1
            running = step[i] if i >= 0 and step[i][1] > launch else None
            behind[running[2][:80] if running else "(no training kernel running)"] += 1
    print(f"kernels that waited over {LONG_WAIT_US / 1e3:g} ms, by the training stream's kernel running at launch:")
    for name, n in behind.most_common(6):
        print(f"  {n:,}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
