"""The parts of torchvision's training recipe beyond the plain loop: batch mixing and weight EMA.

- Mixup/CutMix (``--mixup-alpha``, ``--cutmix-alpha``): on the device batch after decode, one of
  them per batch (torchvision.transforms.v2), so the labels become mixed class probabilities;
  the cross entropy takes those as they are (label smoothing applies on top).
- Model EMA (``--model-ema``): an exponential moving average of the weights and buffers,
  updated every ``--model-ema-steps`` steps. The decay is adjusted to the global batch, the
  steps between updates and the epochs as torchvision's references do, so that the same flags
  give the same averaging horizon on any number of GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2

Mixer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def batch_mixer(mixup_alpha: float, cutmix_alpha: float, classes: int) -> Mixer | None:
    """(images, labels) → (mixed images, class probabilities N × classes); None if both are off."""
    choices: list[nn.Module] = []
    if mixup_alpha > 0:
        choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=classes))
    if cutmix_alpha > 0:
        choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=classes))
    if not choices:
        return None
    return choices[0] if len(choices) == 1 else v2.RandomChoice(choices)


class ModelEma(AveragedModel):
    """The averaged copy of ``model`` (weights and buffers, BatchNorm statistics included)."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def ema_decay(decay: float, every: int, global_batch: int, epochs: int) -> float:
    """The decay per update for ``--model-ema-decay`` ``decay``: torchvision's adjustment, which
    keeps the horizon in images (not updates) whatever the global batch and update interval."""
    alpha = min(1.0, (1.0 - decay) * global_batch * every / epochs)
    return 1.0 - alpha
