"""Distributed setup: one process, or torchrun's RANK/WORLD_SIZE/LOCAL_RANK (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from imagenet_ais.errors import ConfigError


@dataclass(frozen=True)
class Process:
    """This process's place in the job: its rank of ``world``, its rank on the node, its device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


# Hardware work queues from this process to the GPU (CUDA's default is 8). With 8, streams
# share queues, and nvJPEG's stream waited behind the training stream's queued kernels: a
# batch decoded in 67 ms beside training instead of 14 ms alone; with 32, in 23 ms
# (bench/RESULTS.md, run L). Read when CUDA initialises, so it is set before any CUDA call.
WORK_QUEUES = "32"


@contextlib.contextmanager
def joined(timeout: float | None = None) -> Iterator[Process]:
    """This process set up for a run (rank, device, CPU threads, process group), and set back
    as it was once the run is over: the package may be used from another program. ``timeout``:
    seconds the group's collectives may wait (None: the backend's default)."""
    threads, queues = torch.get_num_threads(), os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", WORK_QUEUES)  # a user's own value stands
    ours = not dist.is_initialized()  # (a caller's own group is left to its caller)
    try:
        yield _setup(timeout)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        if queues is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def _setup(timeout: float | None) -> Process:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                "start at most one process per GPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
        # This process's own CPU work is batching and copying; the cores are the DataLoader
        # workers' (idle intra-op threads spinning next to them slow them down).
        torch.set_num_threads(2)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Processes sharing the CPU split its cores instead of each taking all of them, unless
        # OMP_NUM_THREADS says how many (torch took it at its start)
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(local_cpus())
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend,
            device_id=device if backend == "nccl" else None,
            timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
        )
    return Process(rank, world, local_rank, device)


def local_cpus() -> int:
    """CPUs this process may use, shared by the node's ranks: the CPU affinity (Slurm's and
    taskset's binding) within a cgroup CPU quota (docker --cpus, Kubernetes limits), divided
    by LOCAL_WORLD_SIZE."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota: the affinity is the bound
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def auto_workers(device: torch.device) -> int:
    """DataLoader workers for ``--workers auto``: this rank's CPUs, less two on a GPU for the
    training process's own threads (kernel launches, the feed's batching and decode)."""
    return max(1, local_cpus() - (2 if device.type == "cuda" else 0))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks (float64, exact for counts)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def gather_floats(values: list[float], process: Process) -> list[list[float]]:
    """Every rank's ``values`` (as many on each), in rank order; float64."""
    t = torch.tensor(values, dtype=torch.float64, device=process.device)
    if not dist.is_initialized():
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(process.world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (so all ranks stop at the same step)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list when not distributed)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) into every rank's ``module``."""
    if dist.is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)
