"""What the device does with a batch of JPEGs (decode "gpu"): nvJPEG decodes it whole, then the
device crops, resizes, flips, augments and normalises every sample at once, with the boxes and
plans the workers drew (transforms.py: the same geometry as on the CPU). The samples the workers
cropped themselves (cpu_share.py) join the batch after the crop. A sample nvJPEG cannot decode
is decoded by libjpeg on the CPU; one neither can is replaced by another of its batch and reported."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.ops import roi_align

from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.augment import NO_AUGMENT, Augment
from imagenet_ais.loader.transforms import MEAN_255, STD_255, mean_std, memory_format
from imagenet_ais.loader.wire import NO_PIXELS, Encoded


class Decoded(NamedTuple):
    """A batch decoded on the device, not yet cropped."""

    images: list[torch.Tensor] | torch.Tensor  # uint8 3×H×W each, or N×3×size×size already cropped (DALI)
    boxes: torch.Tensor  # the crop of each sample (its flip only, once cropped)
    plans: torch.Tensor  # its augmentation (augment.py)
    rows: list[int] | None  # None, or which sample each row is (failures replaced by others)
    pixels: torch.Tensor = NO_PIXELS  # the samples after ``images``: cropped in the workers, still on the host
    # the first sample the device's decoder failed and libjpeg decoded (copied over), and the error
    rescued: tuple[int, str] | None = None


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
    images, rows, rescued = _decode(_jpegs(batch), device) if batch.sizes else ([], None, None)
    if rows:
        rows += range(len(images), len(batch.boxes))  # (the pixels' rows stay theirs)
        return Decoded(images, batch.boxes[rows], batch.plans[rows], rows, batch.pixels, rescued)
    return Decoded(images, batch.boxes, batch.plans, None, batch.pixels, rescued)


def decode_together(batches: Sequence[Encoded], device: torch.device) -> list[Decoded]:
    """Several batches' JPEGs in one decoder call, then a Decoded each. nvJPEG's call returns only
    once its conversions, queued behind the training step's kernels, are done (bench/RESULTS.md
    runs BH-BI): two batches a call wait once. Where that call fails, each batch on its own
    (``decode_encoded``: its failures replaced by others of the same batch)."""
    if len(batches) == 1:
        return [decode_encoded(batches[0], device)]
    data = [one for batch in batches for one in _jpegs(batch)]
    try:
        images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device) if data else []
    except RuntimeError:
        return [decode_encoded(batch, device) for batch in batches]
    ends = list(itertools.accumulate(len(batch.sizes) for batch in batches))
    return [
        Decoded(images[end - len(batch.sizes) : end], batch.boxes, batch.plans, None, batch.pixels)
        for batch, end in zip(batches, ends, strict=True)
    ]


def _jpegs(batch: Encoded) -> list[torch.Tensor]:
    """The batch's JPEGs, each a view of its bytes."""
    return list(batch.blob.split(batch.sizes)) if batch.sizes else []


def crop_decoded(
    decoded: Decoded, size: int, device: torch.device, channels_last: bool, augment: Augment = NO_AUGMENT
) -> torch.Tensor:
    """Crop, resize, flip, augment (``augment``'s ops, normalisation, erasing): float N×3×size×size on ``device``."""
    images, boxes, n = decoded.images, decoded.boxes, len(decoded.images)
    kernel = _crop_kernel(device) if isinstance(images, list) else None
    out = torch.empty(n + len(decoded.pixels), 3, size, size, device=device, memory_format=memory_format(channels_last))
    # With no augmentation op between the flip and the normalisation, the kernel does both as it
    # stores each pixel where the batch goes: one pass over the batch instead of eight
    normalised = augment.policy is None
    if kernel is not None:
        kernel.resized_crops(images, boxes[:n], out[:n], *((MEAN_255, STD_255) if normalised else ()))
    elif n:  # the CPU's (the tests'), or DALI's, cropped already
        crops = images if isinstance(images, torch.Tensor) else _resize_crops(images, boxes[:n], size)
        out[:n] = _flipped(crops, boxes[:n, 4])
    if len(decoded.pixels):
        pixels = decoded.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
        out[n:] = _flipped(pixels, boxes[n:, 4])
    mean, std = mean_std(device)
    if normalised:
        out[0 if kernel is None else n :].sub_(mean).div_(std)
    else:
        out = (augment.apply(out, decoded.plans) - mean) / std
    out = augment.erase_boxes(out, decoded.plans, 0.0)
    return out.contiguous(memory_format=memory_format(channels_last))


def _flipped(x: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """``x`` (N×C×H×W) mirrored left to right where ``flips`` (N, on the host) is set."""
    return torch.where(flips.bool().to(x.device, non_blocking=True).view(-1, 1, 1, 1), x.flip(-1), x)


def _crop_kernel(device: torch.device) -> ModuleType | None:
    """crop_kernel.py where ``device`` is CUDA (elsewhere None: roi_align crops), or a one-line
    ConfigError where Triton does not import."""
    if device.type != "cuda":
        return None
    try:
        from imagenet_ais.loader import crop_kernel  # (Triton: only where it runs)
    except ImportError as e:
        raise ConfigError(
            f"decode 'gpu' crops with Triton, which did not import ({e}): it comes with PyTorch's CUDA wheels "
            "on Linux (pip install triton), or train with --decode cpu"
        ) from None
    return crop_kernel


def _resize_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Each image's box resized to size × size, as 0-255 floats (N×3×size×size), on the CPU.

    Each output pixel averages ceil(box / size)² bilinear samples of its bin (roi_align's rule):
    a box filter that antialiases like PIL's bilinear does when shrinking. On CUDA one Triton
    kernel does the same for the whole batch where the decoder left it (crop_kernel.py).
    """
    out = torch.empty(len(images), 3, size, size)
    for i, (img, box) in enumerate(zip(images, boxes.tolist(), strict=True)):
        left, top, width, height = box[:4]
        roi = torch.tensor([[0, left, top, left + width, top + height]], dtype=torch.float32)
        out[i] = roi_align(img[None].float(), roi, (size, size), sampling_ratio=-1, aligned=True)[0]
    return out


def _decode(
    data: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[int] | None, tuple[int, str] | None]:
    """Batched decode; if the batch fails, one by one (``_decode_one``): the images, which
    sample each row is where some failed (replaced by good ones), and the first rescued one."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device), None, None
    except RuntimeError:
        pass
    images: dict[int, torch.Tensor] = {}
    rescued = None
    for i, one in enumerate(data):
        image, error = _decode_one(one, device)
        if image is not None:
            images[i] = image
            rescued = rescued or ((i, error) if error else None)
    if not images:
        raise RuntimeError(f"none of the {len(data)} JPEGs of a batch could be decoded on {device}")
    if len(images) == len(data):
        return list(images.values()), None, rescued
    good = list(images)
    rows = [i if i in images else good[i % len(good)] for i in range(len(data))]
    return [images[r] for r in rows], rows, rescued


def _decode_one(data: torch.Tensor, device: torch.device) -> tuple[torch.Tensor | None, str]:
    """One JPEG on ``device`` (None where it cannot be decoded), and the device decoder's error
    where libjpeg decoded it instead, its pixels copied over. nvJPEG's failures are not all the
    picture's: torchvision reports a device out of memory as it does a broken JPEG."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device), ""
    except RuntimeError as e:
        if device.type == "cpu":
            return None, ""
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        image = decode_jpeg(data, mode=ImageReadMode.RGB)
    except RuntimeError:
        return None, ""
    return image.to(device), error  # (a device that cannot take it fails the run here)
