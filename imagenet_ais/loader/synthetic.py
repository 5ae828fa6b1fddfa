"""--synthetic: random batches already on the device, the rate with no input pipeline at all."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from imagenet_ais.loader.transforms import memory_format

SYNTHETIC_CLASSES = 1000
SYNTHETIC_STEPS = 100  # steps per "epoch" of --synthetic


class SyntheticLoader:
    """Random images already on the device: the rate with no input pipeline at all."""

    restored = None  # no data position to continue from: every synthetic step is alike

    def __init__(self, batch: int, size: int, device: torch.device, channels_last: bool, steps: int = SYNTHETIC_STEPS):
        self.fmt = memory_format(channels_last)
        self.x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=self.fmt)
        self.y = torch.randint(0, SYNTHETIC_CLASSES, (batch,), device=device)
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int, image_size: int | None = None) -> None:
        if image_size and image_size != self.x.shape[-1]:
            self.x = torch.randn(*self.x.shape[:2], image_size, image_size, device=self.x.device)
            self.x = self.x.contiguous(memory_format=self.fmt)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        for _ in range(self.steps):
            yield self.x, self.y, []

    def busy(self) -> dict[str, float]:
        return {}  # no feed threads

    def counters(self) -> dict[str, int]:
        return {"skipped": 0, "read_errors": 0, "unread": 0, "drawn": 0, "padded": 0}

    def in_reading(self) -> list[tuple[str, float]]:
        return []  # nothing read

    def reads(self) -> dict[str, dict[str, int]]:
        return {}  # nothing read

    def plan(self) -> None:
        return None  # nothing a resumed epoch must match

    def identity(self) -> None:
        return None  # no data a checkpoint could have been trained on instead
