"""What a training or validation image becomes, on the CPU or on the GPU, with one geometry.

Train: torchvision's RandomResizedCrop parameters (scale 0.08-1, ratio 3/4-4/3), a
horizontal flip half the time, bilinear resize to size × size; drawn from ``augment_rng(seed,
epoch, key)``, so a sample gets the same crop and flip whichever rank, worker or decode path
trains it. Val: the centre square of side
0.875 × the short side, resized to size × size (the usual 256 → 224). Then ImageNet mean/std.

- decode "cpu": DataLoader workers decode with PIL (JPEG draft mode when the crop is much
  larger than the output) and hand over uint8 HWC pixels; the device only normalises.
- decode "gpu": workers only read the JPEG header to pick the crop, and hand over the encoded
  bytes; nvJPEG decodes the whole batch on the GPU, which then crops, resizes, flips and
  normalises. The odd sample nvJPEG does not take (not RGB, not JPEG, or a JPEG coded other than
  with Huffman tables) is re-encoded as an RGB baseline JPEG in the worker.
  Workers with time to spare crop some samples themselves (cpu_share.py): those cross as
  pixels, after the batch's JPEGs, and the device flips, augments and normalises them with the rest.
"""

from __future__ import annotations

import functools
import io
import math
import random
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from imagenet_ais.loader.augment import Augment

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
VAL_CROP = 0.875  # validation: the centre square's side, of the short side (224 of 256)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MEAN_255, STD_255 = tuple(m * 255 for m in MEAN), tuple(s * 255 for s in STD)  # of 0-255 pixels


class Box(NamedTuple):
    """A crop in original pixels, and whether to mirror it."""

    left: int
    top: int
    width: int
    height: int
    flip: bool = False


def augment_rng(seed: int, epoch: int, key: str) -> random.Random:
    """A training sample's draws for its crop and flip: a function of the run's seed, the epoch
    and the sample's key only (not of the world size, the worker or the decode path)."""
    return random.Random(f"augment:{seed}:{epoch}:{key}")


def train_box(img: Image.Image, rng: random.Random) -> Box:
    """A RandomResizedCrop box for ``img`` (only its size is read) and a coin flip.

    torchvision's rule: up to 10 tries of a random area (SCALE of the picture's) and log-uniform
    aspect ratio (RATIO) that fits, else the centre crop of the whole picture, its ratio clamped.
    """
    w, h = img.size
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        area = w * h * rng.uniform(*SCALE)
        ratio = math.exp(rng.uniform(*log_ratio))
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return Box(rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch, rng.random() < 0.5)
    cw, ch = w, h
    if w / h < RATIO[0]:
        ch = round(w / RATIO[0])
    elif w / h > RATIO[1]:
        cw = round(h * RATIO[1])
    return Box((w - cw) // 2, (h - ch) // 2, cw, ch, rng.random() < 0.5)


def val_box(img: Image.Image, crop: float = VAL_CROP) -> Box:
    """The centre square of side ``crop`` × the short side (the resize-then-centre-crop rule)."""
    w, h = img.size
    side = round(min(w, h) * crop)
    return Box((w - side) // 2, (h - side) // 2, side, side)


# --- decode "cpu": PIL in the workers --------------------------------------------------------


def decode_on_cpu(data: bytes, size: int, augment: random.Random | None, val_crop: float = VAL_CROP) -> torch.Tensor:
    """JPEG/PNG bytes → the cropped, resized (and maybe flipped) uint8 size × size × 3 image:
    a training crop drawn from ``augment``, or with None validation's centre crop."""
    img = Image.open(io.BytesIO(data))
    box = train_box(img, augment) if augment else val_box(img, val_crop)
    out = _crop_resize(img, box, size)
    if box.flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return pixels_of(out)


def pixels_of(img: Image.Image) -> torch.Tensor:
    """An RGB image's pixels, uint8 H × W × 3: how a sample decoded on the CPU crosses."""
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


def augment_on_cpu(pixels: torch.Tensor, augment: Augment, plan: list[float]) -> torch.Tensor:
    """``decode_on_cpu``'s image with ``augment``'s ops of ``plan``, its erased box filled with the
    mean colour (what the device's normalisation turns into 0, as the device path erases)."""
    plans = torch.tensor([plan], dtype=torch.float32)
    x = augment.apply(pixels.permute(2, 0, 1)[None].float(), plans)
    x = augment.erase_boxes(x, plans, mean_std(pixels.device)[0])
    return x.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).contiguous()


def _crop_resize(img: Image.Image, box: Box, size: int) -> Image.Image:
    """Resize ``box`` of ``img`` to size × size RGB.

    JPEGs are decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still leaves the box at
    least ``size`` pixels on each side: most of the decode time saved, same output resolution.
    """
    full_w, full_h = img.size
    if img.format == "JPEG":
        shrink = min(box.width, box.height) / size
        if shrink >= 2:
            img.draft("RGB", (math.ceil(full_w / shrink), math.ceil(full_h / shrink)))
    sx, sy = full_w / img.size[0], full_h / img.size[1]
    scaled = (box.left / sx, box.top / sy, (box.left + box.width) / sx, (box.top + box.height) / sy)
    out = img.resize((size, size), Image.Resampling.BILINEAR, box=scaled)
    return out if out.mode == "RGB" else out.convert("RGB")


def normalize(images: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """uint8 N×H×W×3 on the host → normalised float N×3×H×W on ``device``."""
    x = images.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
    mean, std = mean_std(device)
    x = (x - mean) / std
    return x.contiguous(memory_format=memory_format(channels_last))


def memory_format(channels_last: bool) -> torch.memory_format:
    """The layout batches are handed out in."""
    return torch.channels_last if channels_last else torch.contiguous_format


@functools.cache
def mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(MEAN_255, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD_255, device=device).view(1, 3, 1, 1)
    return mean, std


# --- decode "gpu": header and crop in the workers, pixels on the device -----------------------


def encode_for_device(data: bytes, augment: random.Random | None, val_crop: float = VAL_CROP) -> tuple[bytes, Box]:
    """What a worker hands over for device decoding: RGB JPEG bytes and the crop to take (as
    ``decode_on_cpu`` chooses it)."""
    img = Image.open(io.BytesIO(data))
    box = train_box(img, augment) if augment else val_box(img, val_crop)
    if img.format != "JPEG" or img.mode != "RGB" or _frame(data) not in NVJPEG_FRAMES:
        # nvJPEG gets plain RGB JPEGs only: CMYK, grayscale and PNG are rare enough in ImageNet
        # (well under 2%), arithmetic coding in shards made elsewhere rarer still, to re-encode
        # here rather than branch on the GPU.
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="JPEG", quality=95)
        data = buf.getvalue()
    return data, box


# The start-of-frame markers of the JPEGs nvJPEG decodes: Huffman-coded baseline, extended
# sequential and progressive. Arithmetic-coded (0xC9-0xCB), lossless and hierarchical ones it does not.
NVJPEG_FRAMES = frozenset((0xC0, 0xC1, 0xC2))
_NOT_FRAMES = frozenset((0xC4, 0xC8, 0xCC))  # DHT, JPG and DAC, numbered among the frames


def _frame(data: bytes) -> int | None:
    """The JPEG's start-of-frame marker (0xC0-0xCF), or None where the scan or the end comes first."""
    at = 2  # past the start of image
    while at >= 0 and at + 4 <= len(data):
        if data[at] != 0xFF:  # stray bytes between segments, which libjpeg skips too
            at = data.find(b"\xff", at)
            continue
        marker = data[at + 1]
        if 0xC0 <= marker <= 0xCF and marker not in _NOT_FRAMES:
            return marker
        if marker == 0xDA:  # start of scan
            return None
        # a fill byte, or past the segment (its length counts its own two bytes)
        at += 1 if marker == 0xFF else 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def crop_on_cpu(raw: bytes, box: Box, size: int) -> np.ndarray:
    """``encode_for_device``'s JPEG cropped to ``box`` and resized, as decode "cpu" does: uint8
    size × size × 3, not flipped (the device flips it with the batch)."""
    return np.asarray(_crop_resize(Image.open(io.BytesIO(raw)), box, size))
