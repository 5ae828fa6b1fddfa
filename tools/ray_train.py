#!/usr/bin/env python3
"""Train on a Ray cluster through Ray Train's TorchTrainer: ``./run ray`` calls this.

    tools/ray_train.py [--address auto|HOST:PORT] [--num-workers N] [--gpu] -- TRAIN.PY OPTIONS

Each Ray worker runs the same training as train.py (data pipeline, checkpoints, uploads), one
worker per GPU with --gpu, else N CPU workers over gloo; every metrics record is also
reported to Ray. Without --address (or RAY_ADDRESS) it starts a private local cluster and
stops it at the end; a cluster it connects to is left running. The workers get the
``imagenet_ais`` package shipped by Ray; its dependencies (requirements.txt) must be installed
on the cluster's nodes, and --data and --output must be reachable from all of them.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train as train_cli  # noqa: E402


def worker(config: dict) -> None:
    import ray.train

    from imagenet_ais.training import TrainConfig, train

    cfg = TrainConfig(**config)
    outcome = train(cfg, report=ray.train.report)
    if outcome["exit_code"]:
        raise RuntimeError(f"training ended with status {outcome['exit_code']} (see {cfg.output}/train.log)")


@click.command(context_settings={"show_default": True})
@click.option("--address", envvar="RAY_ADDRESS", help="Ray cluster to use; none: a private local one")
@click.option("--num-workers", default=2, type=click.IntRange(min=1), help="training processes (GPUs with --gpu)")
@click.option("--gpu/--cpu", default=False, help="one GPU per worker (NCCL), or CPU workers (gloo)")
@click.option("--cpus-per-worker", default=1.0, type=click.FloatRange(min=0), help="CPUs Ray reserves per worker")
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def main(address: str | None, num_workers: int, gpu: bool, cpus_per_worker: float, train_args: tuple[str, ...]) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = train_cli.parse(list(train_args))
    # the workers' current directory is Ray's, not this one
    cfg.output = str(Path(cfg.output).resolve())
    if cfg.data and "://" not in cfg.data:
        cfg.data = str(Path(cfg.data).resolve())
    ray.init(address=address or "local", runtime_env={"py_modules": [str(ROOT / "imagenet_ais")]})
    try:
        trainer = TorchTrainer(
            worker,
            train_loop_config=asdict(cfg),
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=gpu, resources_per_worker={"CPU": cpus_per_worker}
            ),
            run_config=RunConfig(name="ray", storage_path=str(Path(cfg.output, "ray"))),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()  # a private cluster stops here; a connected one is only left
    if result.error:
        raise click.ClickException(f"Ray training failed: {result.error}")
    click.echo(f"done: metrics in {Path(cfg.output, 'metrics.jsonl')}, checkpoints in {cfg.output}")


if __name__ == "__main__":
    main()
