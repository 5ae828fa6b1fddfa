"""The model and what steps it: building it, the optimizer and LR schedule, mixed precision, and
wrapping it for several processes (DDP or --dp decent) and torch.compile."""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imagenet_ais import distributed
from imagenet_ais.errors import ConfigError, DataError, first_line, needs_extra
from imagenet_ais.train import checkpoint, decentralized
from imagenet_ais.train.config import TIMM_OPTIMIZERS, TrainConfig

TIMM = "timm/"  # --arch timm/NAME: one of timm's models (as its own Hugging Face names begin)


def timm_module(wanted: str) -> Any:
    """timm, or a one-line ConfigError naming what ``wanted`` it (timm is the ``timm`` extra)."""
    with needs_extra("timm", wanted):
        import timm
        import timm.optim
    return timm


def check_arch(arch: str) -> None:
    """torchvision's classifiers (a detection model would fetch its backbone's weights from the
    network) or timm's models."""
    if arch.startswith(TIMM):
        if not timm_module(f"--arch {arch}").is_model(name := arch.removeprefix(TIMM)):
            raise ConfigError(f"--arch {arch!r}: timm has no model {name!r} (timm.list_models() names them)")
        return
    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        raise ConfigError(
            f"--arch {arch!r} is not a torchvision classification model (nor timm/NAME, one of timm's); one of: "
            f"{', '.join(known)}"
        )


def build_model(arch: str, num_classes: int) -> nn.Module:
    check_arch(arch)
    if arch.startswith(TIMM):
        timm = timm_module(f"--arch {arch}")
        return cast(nn.Module, timm.create_model(arch.removeprefix(TIMM), pretrained=False, num_classes=num_classes))
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)


def load_weights(model: nn.Module, path: str, arch: str = "") -> None:
    """Start ``model`` (``arch``) from the weights in ``path``: a train.py checkpoint (its digest
    checked), a plain state dict such as torchvision's released weights, the name of those (e.g.
    ResNet50_Weights.IMAGENET1K_V2), or a timm model's pretrained tag (timm/NAME.TAG) that the
    Hugging Face cache holds; one line if they do not fit."""
    if not Path(path).exists() and re.fullmatch(r"\w+_Weights\.\w+", path):
        state = released_weights(path)
    elif not Path(path).exists() and path.startswith(TIMM) and "." in path:
        state = timm_pretrained(path, arch, model)
    else:
        state = _read_state(path)
    state = {k.removeprefix("module."): v for k, v in state.items()}  # saved from inside DDP
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise DataError(f"--weights {path}: does not fit this model ({mismatches(e)})") from None


def timm_pretrained(tag: str, arch: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """timm's pretrained weights ``tag`` (timm/NAME.TAG) for ``model`` (``arch``, timm/NAME), from
    the Hugging Face cache only (no download: a run does not wait on a hub), its classifier left
    as ``model``'s where the classes differ (timm's own rule)."""
    name = tag.removeprefix(TIMM)
    if arch != TIMM + name.partition(".")[0]:
        raise ConfigError(f"--weights {tag}: weights of timm's {name.partition('.')[0]}, not of --arch {arch}")
    timm = timm_module(f"--weights {tag}")
    from huggingface_hub import try_to_load_from_cache

    try:
        pretrained = timm.models.get_pretrained_cfg(name)
    except RuntimeError:
        pretrained = None
    if pretrained is None or not pretrained.hf_hub_id:
        raise DataError(f"--weights {tag}: timm has no such pretrained tag (timm.list_pretrained() names them)")
    file = pretrained.hf_hub_filename or "model.safetensors"
    cached = try_to_load_from_cache(pretrained.hf_hub_id, file)
    if not isinstance(cached, str):
        raise DataError(
            f"--weights {tag}: not in the Hugging Face cache (HF_HOME): fetch it once with a network, "
            f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\", or give a file"
        )
    return _released_state(timm, tag, cached, pretrained, model)


def _released_state(timm: Any, tag: str, cached: str, pretrained: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights in ``cached`` (timm's pretrained ``tag``, of config ``pretrained``) as ``model``
    takes them: every key loaded and checked by timm into the model as released (its own head:
    for another head timm loads whatever fits, a partial file too), then ``model``'s own head
    where the classes differ (timm's rule)."""
    name = tag.removeprefix(TIMM)
    try:
        released = timm.create_model(
            name, pretrained=True, num_classes=pretrained.num_classes, pretrained_cfg_overlay={"file": cached}
        )
    except Exception as e:  # damaged, cut short, or another model's (its checks and torch's say which)
        loading = isinstance(e, RuntimeError) and str(e).startswith("Error(s) in loading state_dict")
        why = mismatches(e) if isinstance(e, RuntimeError) and loading else f"{type(e).__name__}: {first_line(e)[:120]}"
        raise DataError(
            f"--weights {tag}: the Hugging Face cache's {os.path.realpath(cached)} is damaged or not timm's "
            f"{name.partition('.')[0]} ({why}): delete that file "
            f"and fetch it again, python -c \"import timm; timm.create_model('{name}', pretrained=True)\""
        ) from None
    state = cast(dict[str, torch.Tensor], released.state_dict())
    if model.get_classifier().out_features != pretrained.num_classes:  # type: ignore[operator]  # (timm's)
        heads = {pretrained.classifier} if isinstance(pretrained.classifier, str) else set(pretrained.classifier or ())
        state = {k: v for k, v in state.items() if k.rpartition(".")[0] not in heads}
        state |= {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] in heads}
    return state


def released_weights(name: str) -> dict[str, torch.Tensor]:
    """torchvision's weights by enum name, from torch hub's cache (TORCH_HOME), downloaded there
    (and their hash checked) the first time."""
    try:
        weights = torchvision.models.get_weight(name)
    except (ValueError, KeyError):
        example = "e.g. ResNet50_Weights.IMAGENET1K_V2"
        raise DataError(f"--weights {name}: torchvision has no such weights ({example})") from None
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except (OSError, RuntimeError) as e:  # no network (URLError is an OSError), or a damaged download
        raise DataError(
            f"--weights {name}: could not fetch {weights.url} ({first_line(e)[:120]}); without a network, put "
            f"that file at {cached} (torch hub's cache, under TORCH_HOME)"
        ) from None


def _read_state(path: str) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise DataError(f"--weights {path}: {'a folder' if Path(path).is_dir() else 'no such file'}, not a state dict")
    with warnings.catch_warnings():  # torch's notes on foreign pickles: the error below says it all
        warnings.simplefilter("ignore")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # damaged, or a pickle of more than tensors (never run its code)
            raise DataError(f"--weights {path}: not a state dict or checkpoint ({type(e).__name__})") from None
    if isinstance(state, dict) and "model" in state:  # a train.py checkpoint: read once, checked here
        state = checkpoint.verified(state, Path(path))["model"]
    if not isinstance(state, dict):
        raise DataError(f"--weights {path}: holds no state dict")
    return state


def mismatches(e: RuntimeError, shown: int = 3) -> str:
    """torch's ``load_state_dict`` error (a line per kind of mismatch, its keys all listed: thousands
    of characters) in one short line: each kind with its count and first keys."""
    parts = []
    for line in filter(None, (line.strip() for line in str(e).splitlines()[1:])):
        head, _, rest = line.partition(": ")
        if keys := re.findall(r'"([^"]+)"', rest) if head.endswith("key(s) in state_dict") else []:
            more = ", …" if len(keys) > shown else ""
            parts.append(f"{head}: {len(keys)} ({', '.join(keys[:shown])}{more})")
        else:
            parts.append(line if len(line) <= 200 else f"{line[:200]}…")
    parts = parts or [type(e).__name__]
    return "; ".join(parts[:shown]) + (f"; and {len(parts) - shown} more" if len(parts) > shown else "")


def sync_batchnorm(model: nn.Module, cfg: TrainConfig, process: distributed.Process) -> nn.Module:
    """``model`` with BatchNorm over all ranks (--sync-bn): torch's SyncBatchNorm runs on GPUs only."""
    if not cfg.sync_bn or process.world == 1:
        return model
    if process.device.type != "cuda":
        raise ConfigError("--sync-bn: SyncBatchNorm runs on GPUs only; leave it out on CPU")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def param_groups(params: list[torch.Tensor], weight_decay: float, norm_weight_decay: float) -> list[dict[str, Any]]:
    """BatchNorm/LayerNorm parameters and biases (every 1-d parameter) decay by ``norm_weight_decay``
    (0 by default: torchvision's recipes), the rest by ``weight_decay``."""
    decay = [p for p in params if p.requires_grad and p.ndim > 1]
    norms = [p for p in params if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": norms, "weight_decay": norm_weight_decay}]


LR_BATCH = 256  # --lr is per this many images: the optimizer's is scaled to the global batch (Goyal et al.)


def peak_lr(cfg: TrainConfig, global_batch: int) -> float:
    """The learning rate the optimizer steps with after the warm-up."""
    return cfg.lr * global_batch / LR_BATCH


def make_optimizer(
    params: list[torch.Tensor], cfg: TrainConfig, global_batch: int, fused: bool
) -> torch.optim.Optimizer:
    """--opt's optimizer; ``fused``: one kernel for the whole update instead of a few per tensor (GPU)."""
    groups, lr = param_groups(params, cfg.weight_decay, cfg.norm_weight_decay), peak_lr(cfg, global_batch)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    if cfg.opt == "rmsprop":  # torchvision's reference settings for it
        return torch.optim.RMSprop(groups, lr=lr, momentum=cfg.momentum, eps=0.0316, alpha=0.9)
    if cfg.opt in TIMM_OPTIMIZERS:  # layer-wise trust ratios for large global batches; torch has none
        optim = timm_module(f"--opt {cfg.opt}").optim
        if cfg.opt == "lamb":
            return cast(torch.optim.Optimizer, optim.Lamb(groups, lr=lr))
        return cast(torch.optim.Optimizer, optim.Lars(groups, lr=lr, momentum=cfg.momentum))
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=fused)


def lr_lambda(cfg: TrainConfig, warmup: int, total: int, per_epoch: int, start: int = 0) -> Callable[[int], float]:
    """The LR's factor of the peak at each step, counting from ``start`` (a resume): a linear warmup,
    then --lr-scheduler's curve (config.SCHEDULES); onecycle rises over the warmup on a cosine."""
    drop_every = cfg.lr_step_size * per_epoch

    def factor(step: int) -> float:
        step += start
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.lr_scheduler == "onecycle":
            low, floor = 1 / 25, 1 / 25 / 1e4  # torch's OneCycleLR: div_factor, final_div_factor
            if step < warmup:
                return low + (1 - low) * (1 - math.cos(math.pi * (step + 1) / warmup)) / 2
            return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_scheduler == "step":
            return cfg.lr_gamma ** (step // drop_every)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def autocast(cfg: TrainConfig, device: torch.device) -> AbstractContextManager:
    amp = cfg.amp if cfg.amp != "auto" else ("bf16" if device.type == "cuda" else "off")
    if amp == "off":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def compile_mode(cfg: TrainConfig, cuda: bool) -> str:
    """CUDA graphs on a GPU: one launch per graph instead of one per kernel, so the step no longer
    waits on a Python thread that shares the GIL with the feed (bench/RESULTS.md, run P: 0.77 →
    0.92 of the ceiling on 2 H100s). On the CPU there is nothing to graph."""
    return cfg.compile_mode or ("reduce-overhead" if cuda else "default")


def _compiles(device: torch.device, echo: Callable[..., None]) -> bool:
    """Whether torch.compile can work here by default: Inductor's Triton kernels need a GPU of
    compute capability 7.0+ and a C compiler at run time."""
    if torch.cuda.get_device_capability(device) < (7, 0):
        echo("note: this GPU is older than compute capability 7.0: training eager (torch.compile needs 7.0+)")
        return False
    if not any(shutil.which(cc) for cc in (os.environ.get("CC", "cc"), "gcc", "clang")):
        echo("note: no C compiler here (torch.compile needs one, e.g. apt-get install gcc): training eager")
        return False
    return True


def parallelism(cfg: TrainConfig, process: distributed.Process, echo: Callable[..., None]) -> tuple[bool, bool]:
    """Whether the model trains decentralized (--dp decent over several processes), and whether
    it is compiled."""
    cuda = process.device.type == "cuda"
    decent = cfg.dp == "decent" and process.world > 1
    if cfg.dp == "decent" and not decent:
        echo("note: --dp decent with one process trains as plain data parallel would", err=True)
    if decent and cfg.compile:
        raise ConfigError("--dp decent does not work with --compile (its hooks re-point the parameters): drop one")
    compiled = cfg.compile if cfg.compile is not None else cuda and not decent and _compiles(process.device, echo)
    return decent, compiled


def wrap(
    raw_model: nn.Module,
    cfg: TrainConfig,
    process: distributed.Process,
    decent: bool,
    compiled: bool,
    new_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    schedule: Callable[[int], float],
    scaler: torch.amp.GradScaler,
) -> nn.Module:
    """What steps: ``raw_model`` wrapped for several processes (DDP, or --dp decent, which takes
    an optimizer per bucket) and maybe compiled."""
    model = raw_model
    cuda = process.device.type == "cuda"
    if decent:
        model = decentralized.wrap(raw_model, new_optimizer, schedule, cfg.topology, scaler)
    elif process.world > 1:
        # Gradients as views into DDP's buckets: no copy into and out of them each step. Buffers
        # (BatchNorm's statistics) are not broadcast from rank 0 before every forward: that was a
        # collective at the start of each step, so every rank's step waited for the latest rank's
        # host, and rank 0's own statistics are the same without it (each rank updates its own from
        # its own batches). Validation takes rank 0's first (loop.validate_epoch), as the checkpoint does.
        model = DistributedDataParallel(
            raw_model,
            device_ids=[process.local_rank] if cuda else None,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
        )
    if compiled:  # (loop.train compiles DDP as one graph: optimize_ddp off while it runs)
        # static shapes: a new --progressive size gets its own graph, as fast as the first; by
        # default the second size turns on dynamic shapes, and ResNet-50 at 224 px then ran at
        # 3,800 img/s instead of 5,330 on an H100 (bench/RESULTS.md run T)
        model = cast(nn.Module, torch.compile(model, mode=compile_mode(cfg, cuda), dynamic=False))
    return model
