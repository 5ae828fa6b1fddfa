"""Decentralized data parallel (``--dp decent``) through the decent-dp package.

Each rank keeps its own model and, bucket by bucket during the backward pass, takes its
optimizer step and mixes its parameters with those of its peers in the topology of the
step: no global all-reduce on the critical path. The ranks' models drift apart between
global averages; training calls ``consensus`` before each validation and checkpoint, so
what is validated and saved is the one model every rank then continues from.

What a checkpoint cannot hold here: the optimizers' momentum (one per rank and bucket,
inside the wrapper). A resumed run starts it afresh; the learning-rate schedule and the
model continue where they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from imagenet_ais.errors import ConfigError

TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")

logger.disable("decent_dp")  # its debug lines would go to every rank's stderr


def wrap(
    model: nn.Module,
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    schedule: Callable[[int], float],
    topology: str,
    scaler: torch.amp.GradScaler,
) -> nn.Module:
    """``model`` wrapped so that ``loss.backward()`` also updates and gossips it.

    ``make_optimizer`` builds one bucket's optimizer from its parameters; ``schedule`` is the
    learning-rate factor by step (as for LambdaLR). Rank 0's weights are broadcast to all.
    """
    from decent_dp.ddp import DecentralizedDataParallel

    if topology not in TOPOLOGIES:
        raise ConfigError(f"--topology {topology!r}: one of {', '.join(TOPOLOGIES)}")
    try:
        return DecentralizedDataParallel(
            model,
            optim_fn=lambda named: make_optimizer([p for _, p in named]),
            lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            topology=topology,
            scaler=scaler if scaler.is_enabled() else None,
            sync_buffer_in_global_avg=True,  # BatchNorm statistics are averaged too
        )
    except ValueError as e:  # decent-dp raises it bare, with the reason in its (silenced) log
        raise ConfigError(
            f"--topology {topology} cannot connect {dist.get_world_size()} processes: ring needs an even "
            "number, one-peer-exp a power of two, alternating-exp-ring a power of two of nodes (2 or more)"
        ) from e


def lr(model: nn.Module) -> float:
    """The learning rate ``model`` (decent-dp's wrapper) steps with now."""
    return cast(Any, model).get_lr()


@torch.no_grad()
def consensus(model: nn.Module) -> dict[str, float]:
    """Replace every rank's model by the global average; returns how far apart they were.

    ``distance`` is this rank's L2 distance to the average before it (mean over ranks);
    ``spread`` is the largest difference of any parameter from rank 0's after it (0 when
    the ranks agree, as they must).
    """
    distance = cast(Any, model).global_avg(will_revert=False, return_d2c=True)  # (decent-dp's wrapper)
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    total = torch.tensor([distance], dtype=torch.float64, device=flat.device)
    spread = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(total)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return {"distance": total.item() / dist.get_world_size(), "spread": spread.item()}
