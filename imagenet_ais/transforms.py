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
  normalises. The odd non-RGB or non-JPEG sample is re-encoded as an RGB JPEG in the worker.
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
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.ops import roi_align

from imagenet_ais.augment import NO_AUGMENT, Augment

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
VAL_CROP = 0.875  # validation: the centre square's side, of the short side (224 of 256)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
PAD_LIMIT = 1024  # device decode: pictures up to this many pixels a side are resized as one batch


class Box(NamedTuple):
    """A crop in original pixels, and whether to mirror it."""

    left: int
    top: int
    width: int
    height: int
    flip: bool = False


NO_PIXELS = torch.empty(0, 0, 0, 3, dtype=torch.uint8)


class Encoded(NamedTuple):
    """A batch still in JPEG form: bytes on the host, crops and augmentations to apply once decoded.

    Its first ``len(sizes)`` samples are JPEGs; the K after them (``pixels``) were cropped and
    resized in the worker already (cpu_share.py). ``boxes`` and ``plans`` have a row for each sample.
    """

    blob: torch.Tensor  # uint8: the batch's JPEGs end to end
    sizes: list[int]  # bytes of each JPEG in ``blob``
    boxes: torch.Tensor  # int64 N × 5: left, top, width, height, flip
    plans: torch.Tensor  # float32 N × Augment.width (N × 0 without augmentation)
    pixels: torch.Tensor = NO_PIXELS  # uint8 K × size × size × 3, neither flipped nor augmented yet


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
    return torch.frombuffer(bytearray(out.tobytes()), dtype=torch.uint8).view(size, size, 3)


def augment_on_cpu(pixels: torch.Tensor, augment: Augment, plan: list[float]) -> torch.Tensor:
    """``decode_on_cpu``'s image with ``augment``'s ops of ``plan``, its erased box filled with the
    mean colour (what the device's normalisation turns into 0, as the device path erases)."""
    plans = torch.tensor([plan], dtype=torch.float32)
    x = augment.apply(pixels.permute(2, 0, 1)[None].float(), plans)
    x = augment.erase_boxes(x, plans, _mean_std(pixels.device)[0])
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
    mean, std = _mean_std(device)
    x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    return mean, std


# --- decode "gpu": header and crop in the workers, pixels on the device -----------------------


def encode_for_device(data: bytes, augment: random.Random | None, val_crop: float = VAL_CROP) -> tuple[bytes, Box]:
    """What a worker hands over for device decoding: RGB JPEG bytes and the crop to take (as
    ``decode_on_cpu`` chooses it)."""
    img = Image.open(io.BytesIO(data))
    box = train_box(img, augment) if augment else val_box(img, val_crop)
    if img.format != "JPEG" or img.mode != "RGB":
        # nvJPEG gets plain RGB JPEGs only: CMYK, grayscale and PNG are rare enough in
        # ImageNet (well under 2%) to re-encode here rather than branch on the GPU.
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="JPEG", quality=95)
        data = buf.getvalue()
    return data, box


def crop_on_cpu(raw: bytes, box: Box, size: int) -> np.ndarray:
    """``encode_for_device``'s JPEG cropped to ``box`` and resized, as decode "cpu" does: uint8
    size × size × 3, not flipped (the device flips it with the batch)."""
    return np.asarray(_crop_resize(Image.open(io.BytesIO(raw)), box, size))


Raw = bytes | np.ndarray  # a worker's sample: JPEG bytes, or its crop decoded already (crop_on_cpu)


def encode_batch(samples: list[tuple[Raw, Box]], plans: list[list[float]] | None = None) -> Encoded:
    """A worker's batch, JPEGs first and those decoded already last (``ordered``): sizes, boxes,
    each sample's augmentation plan (augment.py), if any, and the bytes in one block."""
    raws = [raw for raw, _ in samples]
    jpegs = [isinstance(raw, bytes) for raw in raws]
    if jpegs != sorted(jpegs, reverse=True):
        raise ValueError("encode_batch: the samples decoded already must come after the JPEGs")
    return split_block(join_block(raws), *batch_crops(samples, plans), pixel_side(raws))


def join_block(raws: list[Raw]) -> torch.Tensor:
    """``raws`` end to end in one uint8 tensor (one shared-memory block to hand over)."""
    return torch.frombuffer(bytearray().join(map(as_bytes, raws)), dtype=torch.uint8)


def as_bytes(raw: Raw) -> memoryview:
    """``raw``'s bytes, without a copy."""
    return (memoryview(raw) if isinstance(raw, bytes) else raw.data).cast("B")


def pixel_side(raws: list[Raw]) -> int:
    """The side of the crops decoded already, last among ``raws`` (0: none)."""
    return 0 if isinstance(raws[-1], bytes) else len(raws[-1])


def ordered(samples: list[tuple]) -> list[tuple]:
    """A worker's samples (image first) with those decoded already last, as a batch has them."""
    return sorted(samples, key=lambda sample: not isinstance(sample[0][0], bytes))


def batch_crops(
    samples: list[tuple[Raw, Box]], plans: list[list[float]] | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """An encoded batch's all but its bytes: each JPEG's size, each sample's box and augmentation plan."""
    boxes = torch.tensor([tuple(box) for _, box in samples], dtype=torch.int64).view(-1, 5)
    width = len(plans[0]) if plans else 0
    drawn = torch.tensor(plans, dtype=torch.float32) if width else torch.zeros(len(samples), 0)
    return [len(raw) for raw, _ in samples if isinstance(raw, bytes)], boxes, drawn


def split_block(block: torch.Tensor, sizes: list[int], boxes: torch.Tensor, plans: torch.Tensor, side: int) -> Encoded:
    """The batch whose JPEGs (``sizes``) and then pixels (the other rows, ``side`` a side) begin ``block``."""
    jpeg = sum(sizes)
    count = len(boxes) - len(sizes)
    pixels = block[jpeg : jpeg + count * side * side * 3].view(count, side, side, 3) if count else NO_PIXELS
    return Encoded(block[:jpeg], sizes, boxes, plans, pixels)


def concat_encoded(batches: list[Encoded]) -> tuple[Encoded, list[int]]:
    """``batches`` as one, its JPEGs first; and which row of their concatenation each row is."""
    order: list[int] = []
    decoded: list[int] = []
    start = 0
    for b in batches:
        order += range(start, start + len(b.sizes))
        decoded += range(start + len(b.sizes), start + len(b.boxes))
        start += len(b.boxes)
    order += decoded
    pixels = [b.pixels for b in batches if len(b.pixels)]
    encoded = Encoded(
        torch.cat([b.blob for b in batches]),
        [n for b in batches for n in b.sizes],
        torch.cat([b.boxes for b in batches])[order],
        torch.cat([b.plans for b in batches])[order],
        torch.cat(pixels) if pixels else NO_PIXELS,
    )
    return encoded, order


def take_encoded(batch: Encoded, rows: list[int]) -> tuple[Encoded, list[int]]:
    """The samples ``rows`` of ``batch`` (repeats allowed) packed again, JPEGs first; and the
    rows in the order taken."""
    jpegs = batch.blob.split(batch.sizes)
    first = [r for r in rows if r < len(jpegs)]
    decoded = [r for r in rows if r >= len(jpegs)]
    picked = torch.cat([jpegs[r] for r in first]) if first else batch.blob[:0]
    pixels = batch.pixels[[r - len(jpegs) for r in decoded]] if decoded else NO_PIXELS
    order = first + decoded
    return Encoded(picked, [batch.sizes[r] for r in first], batch.boxes[order], batch.plans[order], pixels), order


def pin_encoded(batch: Encoded) -> Encoded:
    """``batch`` with its bytes (and pixels) copied into pinned memory.

    The copy reads the worker's shared memory here, in the thread that forms batches, so the
    first-touch page faults on it are not paid inside nvJPEG's call; a pinned buffer comes
    from torch's caching host allocator, i.e. is reused without faulting again.
    """
    return batch._replace(blob=pinned_copy(batch.blob), pixels=pinned_copy(batch.pixels))


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into pinned (page-locked) host memory, for asynchronous copies to the GPU."""
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)


class Decoded(NamedTuple):
    """A batch decoded on the device, not yet cropped."""

    images: list[torch.Tensor] | torch.Tensor  # uint8 3×H×W each, or N×3×size×size already cropped (DALI)
    boxes: torch.Tensor  # the crop of each sample (its flip only, once cropped)
    plans: torch.Tensor  # its augmentation (augment.py)
    rows: list[int] | None  # None, or which sample each row is (failures replaced by others)
    pixels: torch.Tensor = NO_PIXELS  # the samples after ``images``: cropped in the workers, still on the host


def decode_on_device(
    batch: Encoded, size: int, device: torch.device, channels_last: bool, augment: Augment = NO_AUGMENT
) -> tuple[torch.Tensor, list[int] | None]:
    """Decode (nvJPEG on CUDA, libjpeg on CPU), crop, resize, flip, augment and normalise a batch.

    Returns float N×3×size×size on ``device``, and None, or, when some samples failed to
    decode, which sample each row holds instead (failures replaced by others of the batch).
    """
    decoded = decode_encoded(batch, device)
    return crop_decoded(decoded, size, device, channels_last, augment), decoded.rows


def decode_encoded(batch: Encoded, device: torch.device) -> Decoded:
    images, rows = _decode(list(batch.blob.split(batch.sizes)), device) if batch.sizes else ([], None)
    if rows:
        rows += range(len(images), len(batch.boxes))  # (the pixels' rows stay theirs)
        return Decoded(images, batch.boxes[rows], batch.plans[rows], rows, batch.pixels)
    return Decoded(images, batch.boxes, batch.plans, None, batch.pixels)


def crop_decoded(
    decoded: Decoded, size: int, device: torch.device, channels_last: bool, augment: Augment = NO_AUGMENT
) -> torch.Tensor:
    """Crop, resize, flip, augment (``augment``'s ops, normalisation, erasing): float N×3×size×size on ``device``."""
    boxes, images = decoded.boxes, decoded.images
    out = images if isinstance(images, torch.Tensor) else _resize_crops(images, boxes[: len(images)], size, device)
    if len(decoded.pixels):
        pixels = decoded.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
        out = torch.cat([out, pixels.to(out.dtype)])
    flip = boxes[:, 4].bool().to(device, non_blocking=True).view(-1, 1, 1, 1)
    out = augment.apply(torch.where(flip, out.flip(-1), out).float(), decoded.plans)
    mean, std = _mean_std(device)
    out = augment.erase_boxes((out - mean) / std, decoded.plans, 0.0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return out.contiguous(memory_format=fmt)


def _resize_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """Each image's box resized to size × size, as 0-255 floats (N×3×size×size).

    The images are copied into one zero-padded batch and resampled by a single roi_align,
    which averages ceil(box / size)² bilinear samples per output pixel: a box filter that
    antialiases like PIL's bilinear does when shrinking. A few launches per batch, not per
    image. Images over PAD_LIMIT a side (rare) are resized one by one instead, so that one
    huge picture cannot blow up the padded batch.
    """
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    out = torch.empty(len(images), 3, size, size, dtype=dtype, device=device)
    small = [i for i, img in enumerate(images) if max(img.shape[1:]) <= PAD_LIMIT]
    if small:
        height = max(images[i].shape[1] for i in small)
        width = max(images[i].shape[2] for i in small)
        padded = torch.zeros(len(small), 3, height, width, dtype=dtype, device=device)
        # one C++ loop over the copies instead of a Python-level launch per image
        torch._foreach_copy_(
            [padded[j, :, : images[i].shape[1], : images[i].shape[2]] for j, i in enumerate(small)],
            [images[i] for i in small],
        )
        b = boxes[small].to(torch.float32)
        # Stop half a pixel inside the right and bottom edges: bilinear samples there would
        # otherwise blend in the zero padding (the left and top are clamped by roi_align).
        wh = torch.tensor([[images[i].shape[2], images[i].shape[1]] for i in small], dtype=torch.float32) - 0.5
        right, bottom = torch.minimum(b[:, 0] + b[:, 2], wh[:, 0]), torch.minimum(b[:, 1] + b[:, 3], wh[:, 1])
        rois = torch.stack([torch.arange(len(small)), b[:, 0], b[:, 1], right, bottom], 1)
        resized = roi_align(padded, rois.to(device, dtype), (size, size), sampling_ratio=-1, aligned=True)
        if len(small) == len(images):
            return resized
        out[small] = resized
    for i, img in enumerate(images):
        if i not in small:
            left, top, width, height, _ = boxes[i].tolist()
            crop = img[None, :, top : top + height, left : left + width].to(dtype)
            out[i] = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)[0]
    return out


def _decode(data: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], list[int] | None]:
    """Batched decode; if the batch fails, one by one, with failures replaced by good ones."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device), None
    except RuntimeError:
        pass
    images: dict[int, torch.Tensor] = {}
    for i, one in enumerate(data):
        try:
            images[i] = decode_jpeg(one, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            continue
    if not images:
        raise RuntimeError(f"none of the {len(data)} JPEGs of a batch could be decoded on {device}")
    good = list(images)
    rows = [i if i in images else good[i % len(good)] for i in range(len(data))]
    return [images[r] for r in rows], rows
