#!/usr/bin/env python3
"""Training rate through the real input pipeline against the ceiling, in one run.

(a) ceiling: train.py --synthetic (random batches already on the device);
(b) end to end: train.py on shards at DATA, same model, batch, image size and steps.
Prints img/s of both, the fraction of step time spent waiting for data, and (b)/(a).
Without --data it generates demo-like shards (synthetic ImageNet pictures) first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], output: Path) -> dict[str, float]:
    subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "--output", str(output)], check=True, stdout=subprocess.DEVNULL
    )
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["kind"] == "train"][1:]  # the first window includes start-up
    return {
        "img_per_s": sum(r["img_per_s"] for r in steady) / len(steady),
        "data_wait": sum(r["data_wait"] for r in steady) / len(steady),
    }


@click.command()
@click.option("--data", help="shard location (default: generate synthetic shards)")
@click.option("--arch", default="resnet50")
@click.option("--batch-size", default=256)
@click.option("--image-size", default=224)
@click.option("--steps", default=200, help="steps per measurement")
@click.option("--workers", default=8)
@click.option("--extra", default="", help="more train.py options for both runs, e.g. '--compile'")
def main(data: str | None, arch: str, batch_size: int, image_size: int, steps: int, workers: int, extra: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not data:
            tree, data = work / "tree", str(work / "shards")
            per_class = max(2, steps * batch_size // 10 // 10)
            for cmd in (
                ["synth", str(tree), "--classes", "10", "--train-per-class", str(per_class), "--val-per-class", "1"],
                ["convert", str(tree), data, "--splits", "train"],
            ):
                subprocess.run(
                    [sys.executable, str(ROOT / "imagenet_shards.py"), *cmd],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        common = [
            "--arch",
            arch,
            "--batch-size",
            str(batch_size),
            "--image-size",
            str(image_size),
            "--max-steps",
            str(steps),
            "--epochs",
            "1000",
            "--log-every",
            "10",
            *extra.split(),
        ]
        ceiling = run([*common, "--synthetic"], work / "ceiling")
        e2e = run([*common, "--data", data, "--workers", str(workers)], work / "e2e")
    click.echo(f"{'':12} {'img/s':>8} {'data wait':>10}")
    click.echo(f"{'ceiling':12} {ceiling['img_per_s']:8.1f} {ceiling['data_wait']:10.3f}")
    click.echo(f"{'end-to-end':12} {e2e['img_per_s']:8.1f} {e2e['data_wait']:10.3f}")
    click.echo(f"ratio end-to-end / ceiling: {e2e['img_per_s'] / ceiling['img_per_s']:.3f}")


if __name__ == "__main__":
    main()
