"""Mixup/CutMix (``--mixup-alpha``, ``--cutmix-alpha``), as in torchvision's training recipe: on
the device batch after decode, one of them per batch (torchvision.transforms.v2), so the labels
become mixed class probabilities; the cross entropy takes those as they are (label smoothing
applies on top)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
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
