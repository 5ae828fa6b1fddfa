"""Model EMA (``--model-ema``): an exponential moving average of the weights and buffers,
updated every ``--model-ema-steps`` steps, as in torchvision's training recipe. The decay is
adjusted to the global batch, the steps between updates and the epochs as torchvision's
references do, so that the same flags give the same averaging horizon on any number of GPUs.
"""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class ModelEma(AveragedModel):
    """The averaged copy of ``model`` (weights and buffers, BatchNorm statistics included)."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def ema_decay(decay: float, every: int, global_batch: int, epochs: int) -> float:
    """The decay per update for ``--model-ema-decay`` ``decay``: torchvision's adjustment, which
    keeps the horizon in images (not updates) whatever the global batch and update interval."""
    alpha = min(1.0, (1.0 - decay) * global_batch * every / epochs)
    return 1.0 - alpha
