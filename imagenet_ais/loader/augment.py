"""Per-sample augmentation after the crop: auto-augment policies and random erasing.

``--auto-augment`` takes torchvision's policies (``imagenet``: AutoAugment's ImageNet policy;
``ra``: RandAugment, 2 ops at magnitude 9 of 31; ``ta_wide``: TrivialAugmentWide; ``augmix``:
AugMix, severity 3, 3 chains of 1-3 ops) and ``--random-erase P`` torchvision's RandomErasing
(area 0.02-0.33 of the image, aspect 0.3-3.3, filled with the mean colour, i.e. 0 after
normalisation).

What each sample gets is drawn in the DataLoader worker, from the sample's own generator right
after its crop (transforms.augment_rng), as a plan: a row of numbers. So a sample is augmented
the same way on either decode path, by any rank or worker. The plan is carried out by one
implementation of the ops on float tensors (0-255, N × 3 × H × W), batched with a magnitude
per sample: in the worker on one image (decode "cpu"), on the device on the whole batch
after its crop (decode "gpu"), a few kernels per op present in the batch rather than per image.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from imagenet_ais.errors import ConfigError

POLICIES = ("imagenet", "ra", "ta_wide", "augmix")
ERASE_SCALE = (0.02, 0.33)
ERASE_RATIO = (0.3, 3.3)

# op ids as they appear in a plan (0: nothing)
OPS = (
    "none", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
    "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert", "Identity",
)  # fmt: skip
OP = {name: i for i, name in enumerate(OPS)}
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
SIGNED = (*GEOMETRIC, "Brightness", "Color", "Contrast", "Sharpness")

# AutoAugment's ImageNet policy (Cubuk et al. 2019): 25 sub-policies of two (op, probability, magnitude bin of 10)
IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 0)),
    (("Equalize", 0.8, 0), ("Equalize", 0.6, 0)), (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, 0), ("Solarize", 0.2, 4)), (("Equalize", 0.4, 0), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, 0)), (("Posterize", 0.8, 5), ("Equalize", 1.0, 0)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)), (("Equalize", 0.6, 0), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)), (("Rotate", 0.4, 9), ("Equalize", 0.6, 0)),
    (("Equalize", 0.0, 0), ("Equalize", 0.8, 0)), (("Invert", 0.6, 0), ("Equalize", 1.0, 0)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)), (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)), (("Sharpness", 0.4, 7), ("Invert", 0.6, 0)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, 0)), (("Color", 0.4, 0), ("Equalize", 0.6, 0)),
    (("Equalize", 0.4, 0), ("Solarize", 0.2, 4)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 0)),
    (("Invert", 0.6, 0), ("Equalize", 1.0, 0)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, 0), ("Equalize", 0.6, 0)),
)  # fmt: skip
RA_OPS = ("Identity", *GEOMETRIC, "Brightness", "Color", "Contrast", "Sharpness", "Posterize", "Solarize",
          "AutoContrast", "Equalize")  # fmt: skip
AUGMIX_OPS = ("AutoContrast", "Equalize", "Posterize", "Rotate", "Solarize", *GEOMETRIC[:4], "Brightness", "Color",
              "Contrast", "Sharpness")  # fmt: skip
AUGMIX_CHAINS, AUGMIX_DEPTH, AUGMIX_SEVERITY = 3, 3, 3


def magnitude(policy: str, op: str, level: int, size: int) -> float:
    """The strength of ``op`` at bin ``level`` under ``policy``'s scale (torchvision's augmentation
    spaces: 10 bins for AutoAugment and AugMix, 31 for RandAugment and TrivialAugmentWide)."""
    wide, bins = policy == "ta_wide", 10 if policy in ("imagenet", "augmix") else 31
    top = {
        "ShearX": 0.99 if wide else 0.3,
        "ShearY": 0.99 if wide else 0.3,
        "TranslateX": 32.0 if wide else size / 3 if policy == "augmix" else 150 / 331 * size,
        "TranslateY": 32.0 if wide else size / 3 if policy == "augmix" else 150 / 331 * size,
        "Rotate": 135.0 if wide else 30.0,
        "Brightness": 0.99 if wide else 0.9,
        "Color": 0.99 if wide else 0.9,
        "Contrast": 0.99 if wide else 0.9,
        "Sharpness": 0.99 if wide else 0.9,
    }
    fraction = level / (bins - 1)
    if op in top:
        return top[op] * fraction
    if op == "Posterize":  # bits kept
        most, spread = (4, 4) if policy == "augmix" else (8, 6 if wide else 4)
        return float(most - round(fraction * spread))
    if op == "Solarize":  # threshold
        return 255.0 * (1 - fraction)
    return 0.0


@dataclass(frozen=True)
class Augment:
    """``--auto-augment`` and ``--random-erase``: what to draw per sample and how to apply it."""

    policy: str | None = None
    erase: float = 0.0  # probability of an erased box

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ConfigError(f"--auto-augment {self.policy!r}: one of {', '.join(POLICIES)}")
        if not 0 <= self.erase <= 1:
            raise ConfigError(f"--random-erase {self.erase}: give a probability from 0 to 1")

    def __bool__(self) -> bool:
        return self.policy is not None or self.erase > 0

    def __str__(self) -> str:
        parts = [self.policy] if self.policy else []
        return ", ".join(parts + ([f"erase {self.erase}"] if self.erase else [])) or "none"

    @property
    def steps(self) -> int:
        """(op, magnitude) pairs in a plan."""
        return {None: 0, "imagenet": 2, "ra": 2, "ta_wide": 1, "augmix": AUGMIX_CHAINS * AUGMIX_DEPTH}[self.policy]

    @property
    def width(self) -> int:
        """Numbers in a plan: the steps, AugMix's mixing weights, the erased box (top, left, h, w)."""
        return 2 * self.steps + (AUGMIX_CHAINS + 1 if self.policy == "augmix" else 0) + 4

    def draw(self, rng: random.Random, size: int) -> list[float]:
        """One sample's plan for a size × size image."""
        steps: list[tuple[str, int]] = []  # (op, magnitude bin)
        mixing: list[float] = []
        if self.policy == "imagenet":
            for op, p, level in rng.choice(IMAGENET_POLICY):
                steps.append((op, level) if rng.random() < p else ("none", 0))
        elif self.policy == "ra":
            steps = [(rng.choice(RA_OPS), 9) for _ in range(2)]
        elif self.policy == "ta_wide":
            steps = [(rng.choice(RA_OPS), rng.randrange(31))]
        elif self.policy == "augmix":
            for _ in range(AUGMIX_CHAINS):
                depth = rng.randint(1, AUGMIX_DEPTH)
                chain = [(rng.choice(AUGMIX_OPS), rng.randrange(AUGMIX_SEVERITY)) for _ in range(depth)]
                steps += chain + [("none", 0)] * (AUGMIX_DEPTH - depth)
            weights = [rng.gammavariate(1.0, 1.0) for _ in range(AUGMIX_CHAINS)]
            mixing = [w / sum(weights) for w in weights] + [rng.betavariate(1.0, 1.0)]
        plan: list[float] = []
        for op, level in steps:
            amount = magnitude(self.policy or "", op, level, size)
            plan += [OP[op], -amount if op in SIGNED and rng.random() < 0.5 else amount]
        return plan + mixing + list(self._erase_box(rng, size))

    def _erase_box(self, rng: random.Random, size: int) -> tuple[int, int, int, int]:
        if not self.erase or rng.random() >= self.erase:
            return 0, 0, 0, 0
        log_ratio = (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
        for _ in range(10):
            area = size * size * rng.uniform(*ERASE_SCALE)
            ratio = math.exp(rng.uniform(*log_ratio))
            h, w = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if h < size and w < size:
                return rng.randint(0, size - h), rng.randint(0, size - w), h, w
        return 0, 0, 0, 0

    def apply(self, x: torch.Tensor, plans: torch.Tensor) -> torch.Tensor:
        """The policy's ops of ``plans`` (N × width, on the host) on float pixels ``x`` (0-255,
        N × 3 × H × W, any device); erasing is left to ``erase_boxes``, after normalisation."""
        if self.policy is None:
            return x
        x = x.round()
        steps = plans[:, : 2 * self.steps].view(len(x), self.steps, 2)
        if self.policy != "augmix":
            for k in range(self.steps):
                x = apply_step(x, steps[:, k])
            return x
        mixing = plans[:, 2 * self.steps : 2 * self.steps + AUGMIX_CHAINS + 1].to(x.device, x.dtype, non_blocking=True)
        mixed = torch.zeros_like(x)
        for c in range(AUGMIX_CHAINS):
            y = x
            for k in range(c * AUGMIX_DEPTH, (c + 1) * AUGMIX_DEPTH):
                y = apply_step(y, steps[:, k])
            mixed += mixing[:, c].view(-1, 1, 1, 1) * y
        keep = mixing[:, AUGMIX_CHAINS].view(-1, 1, 1, 1)
        return (keep * x + (1 - keep) * mixed).clamp(0, 255)

    def erase_boxes(self, x: torch.Tensor, plans: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
        """``x`` (N × C × H × W) with each plan's box set to ``fill``."""
        if not self.erase:
            return x
        top, left, h, w = plans[:, -4:].to(x.device, non_blocking=True).view(-1, 4, 1, 1).unbind(1)
        rows = torch.arange(x.shape[-2], device=x.device).view(1, -1, 1)
        cols = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        return torch.where(inside[:, None], torch.as_tensor(fill, dtype=x.dtype, device=x.device), x)


NO_AUGMENT = Augment()


def apply_step(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One op per sample: ``step`` is N × (op id, magnitude) on the host. Each op present in the
    batch runs once, on its samples, with their magnitudes."""
    ops = step[:, 0].long()
    geometric = torch.isin(ops, torch.tensor([OP[g] for g in GEOMETRIC]))
    if geometric.any():
        rows = geometric.nonzero()[:, 0]
        on_device = rows.to(x.device, non_blocking=True)
        x = x.index_copy(0, on_device, _affine(x[on_device], step[rows]))
    for op in ops.unique().tolist():
        fn = _COLOR_OPS.get(OPS[op])
        if fn is None:
            continue
        rows = (ops == op).nonzero()[:, 0]
        on_device = rows.to(x.device, non_blocking=True)
        amount = step[rows, 1].to(x.device, x.dtype, non_blocking=True).view(-1, 1, 1, 1)
        x = x.index_copy(0, on_device, fn(x[on_device], amount).clamp(0, 255))
    return x


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (0.2989 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).floor()


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return factor * x + (1 - factor) * other


def _sharpness(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # PIL's smoothing kernel inside the picture; the border pixels stay as they are
    kernel = torch.ones(3, 1, 3, 3, dtype=x.dtype, device=x.device)
    kernel[:, :, 1, 1] = 5
    smooth = x.clone()
    smooth[:, :, 1:-1, 1:-1] = F.conv2d(x, kernel / 13, groups=3).round()
    return _blend(x, smooth, 1 + m)


def _autocontrast(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    low, high = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    flat = high <= low
    scale = torch.where(flat, 1.0, 255 / (high - low).clamp(min=1e-6))
    return torch.where(flat, x, (x - low) * scale)


def _equalize(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """Each channel's histogram equalised, PIL's way (the top value's count left out of the step)."""
    n, c, h, w = x.shape
    values = x.clamp(0, 255).long().view(n * c, h * w)
    hist = torch.zeros(n * c, 256, dtype=torch.long, device=x.device).scatter_add_(1, values, torch.ones_like(values))
    top = 255 - (hist > 0).flip(1).long().argmax(1, keepdim=True)  # the highest value present
    step = (h * w - hist.gather(1, top)) // 255
    lut = ((hist.cumsum(1) - hist + step // 2) // step.clamp(min=1)).clamp(0, 255)
    out = lut.gather(1, values).to(x.dtype)
    return torch.where(step > 0, out, values.to(x.dtype)).view(n, c, h, w)


_COLOR_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Brightness": lambda x, m: x * (1 + m),
    "Color": lambda x, m: _blend(x, _gray(x), 1 + m),
    "Contrast": lambda x, m: _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), 1 + m),
    "Sharpness": _sharpness,
    "Posterize": lambda x, m: (x / 2 ** (8 - m)).floor() * 2 ** (8 - m),
    "Solarize": lambda x, m: torch.where(x >= m, 255 - x, x),
    "AutoContrast": _autocontrast,
    "Equalize": _equalize,
    "Invert": lambda x, _: 255 - x,
}


def _affine(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Shear, translate or rotate each image by its magnitude (nearest pixel, black outside)."""
    n, _, h, w = x.shape
    op, m = step[:, 0].long(), step[:, 1].double()
    # where each output pixel (column, row, 1) samples the input, in pixels: inverse maps
    inverse = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    # shears about the top-left corner of the picture (torchvision's center=[0, 0])
    shear_x, shear_y = op == OP["ShearX"], op == OP["ShearY"]
    inverse[shear_x, 0, 1], inverse[shear_x, 0, 2] = m[shear_x], m[shear_x] / 2
    inverse[shear_y, 1, 0], inverse[shear_y, 1, 2] = m[shear_y], m[shear_y] / 2
    inverse[op == OP["TranslateX"], 0, 2] = -m[op == OP["TranslateX"]].trunc()
    inverse[op == OP["TranslateY"], 1, 2] = -m[op == OP["TranslateY"]].trunc()
    rotate = op == OP["Rotate"]
    if rotate.any():
        angle = torch.deg2rad(m[rotate])
        cos, sin = angle.cos(), angle.sin()
        cx, cy = (w - 1) / 2, (h - 1) / 2
        inverse[rotate, 0, 0], inverse[rotate, 0, 1] = cos, -sin
        inverse[rotate, 1, 0], inverse[rotate, 1, 1] = sin, cos
        inverse[rotate, 0, 2] = cx - cos * cx + sin * cy
        inverse[rotate, 1, 2] = cy - sin * cx - cos * cy
    # to grid_sample's coordinates (-1..1 across pixel edges): scale, map, scale back
    to_pixels = torch.tensor([[w / 2, 0, (w - 1) / 2], [0, h / 2, (h - 1) / 2], [0, 0, 1]], dtype=torch.float64)
    theta = (torch.linalg.inv(to_pixels) @ inverse @ to_pixels)[:, :2].to(x.device, torch.float32, non_blocking=True)
    grid = F.affine_grid(theta, [n, 3, h, w], align_corners=False)
    return F.grid_sample(x.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False).to(x.dtype)
