"""What a benchmark reads out of a run's metrics.jsonl: the steady rate, each rank's step times,
each GPU's clock, temperature and throttle reasons (a throttled GPU makes the figure invalid), and
how busy the host's CPUs were meanwhile."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

from imagenet_ais.loader.cpu_time import cpu_jiffies
from imagenet_ais.train.metrics import SLOWDOWNS, throttle_names

WARMUP_STEPS = 50  # compile, CUDA graph capture, cuDNN's autotuning and the allocator's growth


def steady_windows(records: list[dict], warmup_steps: int = WARMUP_STEPS) -> list[tuple[int, dict]]:
    """(steps, record) of the training windows that count: past the warm-up (from the second
    epoch on, when the first is short), none that starts an epoch (the loader's restart is timed
    apart, see ``epoch_starts``)."""
    train = [r for r in records if r["kind"] == "train"]
    first_epoch = train[0]["epoch"]
    pairs = list(itertools.pairwise(train))
    later = [(p, r) for p, r in pairs if p["epoch"] > first_epoch]
    if not later or sum(r["step"] - p["step"] for p, r in later) < warmup_steps:
        later = [(p, r) for p, r in pairs if p["step"] >= warmup_steps] or pairs[2:]
    return [(r["step"] - p["step"], r) for p, r in later if r["epoch"] == p["epoch"]]


def epoch_starts(records: list[dict], rate: float, batch: int) -> list[float]:
    """Seconds each window that starts an epoch took beyond what its images take at ``rate``."""
    train = [r for r in records if r["kind"] == "train"]
    return [
        (r["step"] - p["step"]) * batch * (1 / r["img_per_s"] - 1 / rate)
        for p, r in itertools.pairwise(train)
        if r["epoch"] != p["epoch"]
    ]


def rank_figures(windows: list[tuple[int, dict]]) -> list[dict[str, Any]]:
    """Per rank over the steady windows: the median of the windows' step-time medians and p90s
    (ms), the mean data wait, the lowest and median SM clock (MHz), the hottest temperature (°C)
    and every throttle reason seen."""
    per_rank: list[list[dict]] = [list(ranks) for ranks in zip(*(r.get("ranks", []) for _, r in windows), strict=True)]
    out = []
    for rank, samples in enumerate(per_rank):
        clocks = [s["gpu_sm_mhz"] for s in samples if "gpu_sm_mhz" in s]
        temps = [s["gpu_temp_c"] for s in samples if "gpu_temp_c" in s]
        bits = 0
        for s in samples:
            bits |= int(s.get("gpu_throttle", 0))
        figures: dict[str, Any] = {
            "rank": rank,
            "step_ms_p50": statistics.median(s["step_ms_p50"] for s in samples),
            "step_ms_p90": statistics.median(s["step_ms_p90"] for s in samples),
            "data_wait": statistics.fmean(s["data_wait"] for s in samples),
            **{k: statistics.fmean(s[k] for s in samples) for k in samples[0] if k.startswith("busy_")},
        }
        if clocks:
            figures |= {"sm_mhz_min": min(clocks), "sm_mhz_median": statistics.median(clocks)}
        if temps:
            figures |= {"temp_c_max": max(temps), "throttle": throttle_names(bits), "throttled": bool(bits & SLOWDOWNS)}
        out.append(figures)
    return out


def invalid_because(ranks: list[dict[str, Any]]) -> str | None:
    """Why a figure is not the cards' own (a GPU slowed by heat or power), or None."""
    hot = [
        f"rank {r['rank']}: {', '.join(r['throttle'])} at {r['temp_c_max']:.0f} °C, SM {r['sm_mhz_min']:.0f} MHz"
        for r in ranks
        if r.get("throttled")
    ]
    return "; ".join(hot) or None


def describe_ranks(ranks: list[dict[str, Any]]) -> str:
    """One line per rank: step-time spread, data wait, feed threads, GPU."""
    lines = []
    for r in ranks:
        busy = " ".join(f"{k[5:]} {v:.2f}" for k, v in r.items() if k.startswith("busy_"))
        gpu = ""
        if "sm_mhz_median" in r:
            gpu = f"  SM {r['sm_mhz_min']:.0f}-{r['sm_mhz_median']:.0f} MHz, {r['temp_c_max']:.0f} °C"
            gpu += f", throttle: {','.join(r['throttle']) or 'none'}"
        lines.append(
            f"    rank {r['rank']}: step p50 {r['step_ms_p50']:.1f} ms p90 {r['step_ms_p90']:.1f} ms, "
            f"data wait {r['data_wait']:.3f}" + (f", busy {busy}" if busy else "") + gpu
        )
    return "\n".join(lines)


class HostCpu:
    """Samples the host's CPU use (/proc/stat) every ``every`` seconds while running, so that the
    share of all cores busy between two wall-clock times can be read afterwards."""

    def __init__(self, every: float = 1.0) -> None:
        self.every, self.samples = every, [self._sample()]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HostCpu:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.wait(self.every):
            self.samples.append(self._sample())

    @staticmethod
    def _sample() -> tuple[float, int, int]:
        """(wall time, busy jiffies, all jiffies) of every core together."""
        busy, total = cpu_jiffies() or (0, 0)
        return time.time(), busy, total

    def busy(self, start: float, end: float) -> float:
        """The share of all cores' time spent busy between ``start`` and ``end`` (wall-clock
        seconds), from the samples nearest inside them; NaN with fewer than two there."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (_, busy0, all0), (_, busy1, all1) = inside[0], inside[-1]
        return (busy1 - busy0) / max(1, all1 - all0)
