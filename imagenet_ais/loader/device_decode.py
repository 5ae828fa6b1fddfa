"""What the device does with a batch of JPEGs (decode "gpu"): nvJPEG decodes it whole, then the
device crops, resizes, flips, augments and normalises every sample at once, with the boxes and
plans the workers drew (transforms.py: the same geometry as on the CPU). The samples the workers
cropped themselves (cpu_share.py) join the batch after the crop. A sample nvJPEG cannot decode
is replaced by another of its batch and reported."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.ops import roi_align

from imagenet_ais.loader.augment import NO_AUGMENT, Augment
from imagenet_ais.loader.transforms import mean_std, memory_format
from imagenet_ais.loader.wire import NO_PIXELS, Encoded

PAD_LIMIT = 1024  # device decode: pictures up to this many pixels a side are resized as one batch


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
    mean, std = mean_std(device)
    out = augment.erase_boxes((out - mean) / std, decoded.plans, 0.0)
    return out.contiguous(memory_format=memory_format(channels_last))


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
    shapes = [img.shape for img in images]  # read once: this thread shares the GIL with the training loop
    small = [i for i, (_, h, w) in enumerate(shapes) if max(h, w) <= PAD_LIMIT]
    if small:
        height, width = max(shapes[i][1] for i in small), max(shapes[i][2] for i in small)
        padded = torch.zeros(len(small), 3, height, width, dtype=dtype, device=device)
        first, *strides = padded.stride()
        # one C++ loop over the copies instead of a launch per image, into views made in one call each
        torch._foreach_copy_(
            [padded.as_strided(shapes[i], strides, j * first) for j, i in enumerate(small)], [images[i] for i in small]
        )
        b = boxes[small].to(torch.float32)
        # Stop half a pixel inside the right and bottom edges: bilinear samples there would
        # otherwise blend in the zero padding (the left and top are clamped by roi_align).
        wh = torch.tensor([(shapes[i][2], shapes[i][1]) for i in small], dtype=torch.float32) - 0.5
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
