"""``python -m imagenet_ais.cli.plot RUN_DIR``: one PNG of a run's metrics against the step.

Loss, validation top-1/top-5 (top-5 from 6 classes on), learning rate, img/s, data wait, and GPU
utilisation and memory where they were sampled. Reads ``metrics.jsonl``; a resumed run's repeated
steps count once (the later record wins). Validation records, and a series of one record (a run
of one log interval), are drawn as points: a line needs two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from matplotlib.figure import Figure  # no pyplot: no display backend, no global state

from imagenet_ais.cli.one_line import one_line
from imagenet_ais.errors import DataError, NotFound
from imagenet_ais.train.metrics import METRICS

# panel title → (record kind, field, legend label)
PANELS: dict[str, list[tuple[str, str, str]]] = {
    "training loss": [("train", "loss", "loss")],
    "validation accuracy (%)": [("val", "top1", "top-1"), ("val", "top5", "top-5")],
    "learning rate": [("train", "lr", "lr")],
    "throughput (img/s)": [("train", "img_per_s", "img/s")],
    "data wait (fraction of step time)": [("train", "data_wait", "data wait")],
    "GPU": [("train", "gpu_util", "utilisation (%)"), ("train", "gpu_mem_gib", "peak memory (GiB)")],
}


def load(run_dir: Path) -> dict[str, dict[int, dict]]:
    """Records by kind, then step (later records replace earlier ones of the same step)."""
    path = run_dir / METRICS
    if not path.is_file():
        raise NotFound(f"no {METRICS} in {run_dir}: point at a train.py --output directory")
    by_kind: dict[str, dict[int, dict]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n} is not a JSON record ({e.msg}): was the file edited or cut?") from e
        by_kind.setdefault(record.get("kind", "?"), {})[record["step"]] = record
    return by_kind


def plot(run_dir: Path, out: Path) -> Path:
    by_kind = load(run_dir)
    panels = {
        title: series
        for title, series in PANELS.items()
        if any(field in r for kind, field, _ in series for r in by_kind.get(kind, {}).values())
    }
    if not panels:
        raise DataError(f"{run_dir / METRICS} has no training or validation records yet")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5 * cols, 3.4 * rows), layout="tight")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items(), strict=False):
        for kind, field, label in series:
            points = sorted((step, r[field]) for step, r in by_kind.get(kind, {}).items() if field in r)
            if points:
                steps, values = zip(*points, strict=True)
                point = kind == "val" or len(points) == 1
                ax.plot(steps, values, marker="o" if point else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(str(run_dir))
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)  # never a half-written PNG under the final name
    return out


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="[default: RUN_DIR/metrics.png]")
def main(run_dir: Path, out: Path | None) -> None:
    """Plot a training run's metrics (RUN_DIR: a train.py --output directory) into a PNG."""
    with one_line():
        path = plot(run_dir, out or run_dir / "metrics.png")
    click.echo(path)


if __name__ == "__main__":
    main()
