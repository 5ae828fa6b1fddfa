#!/usr/bin/env python3
"""How soon a fed train.py run settles (bench/settle.sh): from its metrics.jsonl and its
ceiling's, the rate from step FROM to step TO (the first 500) and from FROM to the end, each
against the ceiling's steady rate; every BLOCK steps the rate, data wait, the share of the images
the workers cropped (cpu_share.py) and the feed's busy threads; and each run's GPU over its
windows from FROM on (SM clock, temperature, throttle reasons: a throttled GPU marks it INVALID).

    python3 bench/settle.py --row resnet18-256 --ceiling C.jsonl NAME=RUN.jsonl ... [--json-out F]
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import click
from records import invalid_because, rank_figures, steady_windows

BATCH = {"resnet18-256": 512, "resnet50-160": 256}


def windows(path: Path) -> list[tuple[dict, dict]]:
    """(previous, this) record of each training window of one epoch, in order."""
    train = [json.loads(line) for line in path.read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    return [(p, r) for p, r in itertools.pairwise(train) if p["epoch"] == r["epoch"]]


def rate(pairs: list[tuple[dict, dict]], batch: int) -> float:
    """Images a second over these windows."""
    images = sum((r["step"] - p["step"]) * batch for p, r in pairs)
    return images / sum((r["step"] - p["step"]) * batch / r["img_per_s"] for p, r in pairs)


def between(pairs: list[tuple[dict, dict]], first: int, last: int | None) -> list[tuple[dict, dict]]:
    return [(p, r) for p, r in pairs if p["step"] >= first and (last is None or r["step"] <= last)]


def blocks(pairs: list[tuple[dict, dict]], batch: int, block: int) -> list[dict[str, Any]]:
    """Every ``block`` steps: the rate, mean data wait, the share of images cropped in the
    workers, the feed's threads' busy shares and rank 0's SM clock."""
    out = []
    for start in range(0, pairs[-1][1]["step"], block):
        part = between(pairs, start, start + block)
        if not part:
            continue
        images = sum((r["step"] - p["step"]) * batch for p, r in part)
        row = {
            "steps": f"{part[0][0]['step']}-{part[-1][1]['step']}",
            "img_per_s": rate(part, batch),
            "data_wait": sum(r["data_wait"] for _, r in part) / len(part),
            "cropped": (part[-1][1].get("cropped", 0) - part[0][0].get("cropped", 0)) / images,
        }
        for key in ("busy_host", "busy_decode", "busy_crop", "gpu_sm_mhz"):
            values = [r[key] for _, r in part if key in r]
            if values:
                row[key] = sum(values) / len(values)
        out.append(row)
    return out


def measure(path: Path, batch: int, ceiling: float, first: int, last: int, block: int) -> dict[str, Any]:
    pairs = windows(path)
    early, whole = between(pairs, first, last), between(pairs, first, None)
    ranks = rank_figures([(r["step"] - p["step"], r) for p, r in whole])
    return {
        "first": rate(early, batch),
        "first_steps": f"{early[0][0]['step']}-{early[-1][1]['step']}",
        "whole": rate(whole, batch),
        "whole_steps": f"{whole[0][0]['step']}-{whole[-1][1]['step']}",
        "ratio_first": rate(early, batch) / ceiling,
        "ratio_whole": rate(whole, batch) / ceiling,
        "ranks": ranks,
        "invalid": invalid_because(ranks),
        "blocks": blocks(pairs, batch, block),
    }


def gpu_line(ranks: list[dict[str, Any]]) -> str:
    r = ranks[0]
    if "sm_mhz_median" not in r:
        return "GPU: not read"
    return (
        f"SM {r['sm_mhz_min']:.0f}-{r['sm_mhz_median']:.0f} MHz (min-median), at most {r['temp_c_max']:.0f} °C, "
        f"throttle: {','.join(r['throttle']) or 'none'}"
    )


@click.command()
@click.option("--row", type=click.Choice(list(BATCH)), required=True)
@click.option("--ceiling", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--from", "first", default=100, show_default=True, help="the first step counted")
@click.option("--to", "last", default=500, show_default=True, help="the last step of the early figure")
@click.option("--block", default=50, show_default=True, help="steps in each line of the trace")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("runs", nargs=-1, required=True)
def main(
    row: str, ceiling: Path, first: int, last: int, block: int, json_out: Path | None, runs: tuple[str, ...]
) -> None:
    """NAME=METRICS.jsonl of each fed run: its rates and ratios, then its trace."""
    batch = BATCH[row]
    top = steady_windows([json.loads(line) for line in ceiling.read_text().splitlines()])
    ceiling_rate = sum(n for n, _ in top) * batch / sum(n * batch / r["img_per_s"] for n, r in top)
    ceiling_ranks = rank_figures(top)
    steps = f"{top[0][1]['step'] - top[0][0]}-{top[-1][1]['step']}"
    click.echo(f"{row}: ceiling {ceiling_rate:,.0f} img/s over steps {steps}")
    bad = invalid_because(ceiling_ranks)
    click.echo(f"  {gpu_line(ceiling_ranks)}" + (f"  INVALID ({bad})" if bad else ""))
    results: dict[str, Any] = {"row": row, "ceiling": ceiling_rate, "ceiling_ranks": ceiling_ranks, "runs": {}}
    for run in runs:
        name, _, path = run.partition("=")
        if not Path(path).exists():
            click.echo(f"{name}: no records")
            continue
        m = results["runs"][name] = measure(Path(path), batch, ceiling_rate, first, last, block)
        click.echo(
            f"{name}: steps {m['first_steps']} {m['first']:,.0f} img/s, ratio {m['ratio_first']:.3f}; "
            f"steps {m['whole_steps']} {m['whole']:,.0f} img/s, ratio {m['ratio_whole']:.3f}"
            + (f"  INVALID ({m['invalid']})" if m["invalid"] else "")
        )
        click.echo(f"  {gpu_line(m['ranks'])}")
        for b in m["blocks"]:
            busy = " ".join(f"{k[5:]} {b[k]:.2f}" for k in ("busy_host", "busy_decode", "busy_crop") if k in b)
            click.echo(
                f"  {b['steps']:>10} {b['img_per_s']:8,.0f} img/s  wait {b['data_wait']:.3f}  "
                f"cropped {b['cropped']:.3f}  busy {busy}  SM {b.get('gpu_sm_mhz', 0):.0f}"
            )
    if json_out:
        json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
