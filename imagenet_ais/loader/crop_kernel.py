"""A decoded batch's crops resized, flipped and normalised in one Triton kernel, read where
nvJPEG left each image and written where the batch goes (CUDA).

Each output pixel is the mean of ceil(box / size)² bilinear samples of its bin, as torchvision's
``roi_align`` (``aligned=True``, ``sampling_ratio=-1``) takes them: a box filter that antialiases
like PIL's bilinear does when shrinking; samples past an image's last row or column take that
row or column. ``device_decode._resize_crops`` does the same with ``roi_align`` one image at a
time, on the CPU. With the batch copied into one zero-padded tensor for a single ``roi_align``
instead, the crop stage took 1.3 ms of the GPU per batch of 256 pictures of 500×375 at 160 px;
with this kernel 0.4 ms. Beside a fast step the feed's GPU time is the step's loss (bench/RESULTS.md
run AS). The flip, the normalisation and the batch's memory layout are done as each pixel is
stored: done after it by torch, in seven more passes over the batch, they took 1.8 ms of a
ResNet-18 bs512 step's 29 at 224 px (bench/RESULTS.md run BI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 512  # output pixels per program


@triton.jit
def _resize(meta, bins, out, size, stride_n, stride_c, stride_h, stride_w, m0, m1, m2, s0, s1, s2, BLOCK: tl.constexpr):
    # meta: (image address, height, width, samples down, samples across, flipped) per image;
    # bins: (top, left, bin height, bin width), in the image's pixels, half a pixel shifted (aligned);
    # out: float32, N×3×size×size with these strides; m0-m2 and s0-s2: each channel's mean and std, 0-255
    n = tl.program_id(0)
    pixel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pixel < size * size
    row, col = pixel // size, pixel % size
    image = tl.load(meta + 6 * n).to(tl.pointer_type(tl.uint8))
    height = tl.load(meta + 6 * n + 1).to(tl.int32)
    width = tl.load(meta + 6 * n + 2).to(tl.int32)
    down = tl.load(meta + 6 * n + 3).to(tl.int32)
    across = tl.load(meta + 6 * n + 4).to(tl.int32)
    flipped = tl.load(meta + 6 * n + 5) != 0
    source = tl.where(flipped, size - 1 - col, col)  # the column of the unflipped crop this one shows
    top, left = tl.load(bins + 4 * n), tl.load(bins + 4 * n + 1)
    bin_h, bin_w = tl.load(bins + 4 * n + 2), tl.load(bins + 4 * n + 3)
    plane = height.to(tl.int64) * width  # (3 planes of a large picture pass int32)
    red = tl.full([BLOCK], 0.0, tl.float32)  # (not tl.zeros: a @jit helper, which the interpreter may not run)
    green = tl.full([BLOCK], 0.0, tl.float32)
    blue = tl.full([BLOCK], 0.0, tl.float32)
    iy = 0
    while iy < down:  # (while, not range: Triton's interpreter, the tests' CPU, takes no loaded bound)
        y = tl.maximum(top + row * bin_h + (iy + 0.5) * bin_h / down, 0.0)
        y0 = tl.minimum(y.to(tl.int32), height - 1)  # (y ≥ 0: truncation is the floor)
        y1 = tl.minimum(y0 + 1, height - 1)
        ly = tl.where(y0 == height - 1, 0.0, y - y0)
        ix = 0
        while ix < across:
            x = tl.maximum(left + source * bin_w + (ix + 0.5) * bin_w / across, 0.0)
            x0 = tl.minimum(x.to(tl.int32), width - 1)
            x1 = tl.minimum(x0 + 1, width - 1)
            lx = tl.where(x0 == width - 1, 0.0, x - x0)
            w00, w01 = (1 - ly) * (1 - lx), (1 - ly) * lx
            w10, w11 = ly * (1 - lx), ly * lx
            i00, i01, i10, i11 = y0 * width + x0, y0 * width + x1, y1 * width + x0, y1 * width + x1
            red += _sample(image, i00, i01, i10, i11, w00, w01, w10, w11, inside)
            green += _sample(image + plane, i00, i01, i10, i11, w00, w01, w10, w11, inside)
            blue += _sample(image + 2 * plane, i00, i01, i10, i11, w00, w01, w10, w11, inside)
            ix += 1
        iy += 1
    count = (down * across).to(tl.float32)
    # (a batch of thousands at 512 px passes int32)
    first = out + n.to(tl.int64) * stride_n + row * stride_h + col * stride_w
    tl.store(first, (red / count - m0) / s0, mask=inside)
    tl.store(first + stride_c, (green / count - m1) / s1, mask=inside)
    tl.store(first + 2 * stride_c, (blue / count - m2) / s2, mask=inside)


@triton.jit
def _sample(channel, i00, i01, i10, i11, w00, w01, w10, w11, inside):
    v00 = tl.load(channel + i00, mask=inside, other=0).to(tl.float32)
    v01 = tl.load(channel + i01, mask=inside, other=0).to(tl.float32)
    v10 = tl.load(channel + i10, mask=inside, other=0).to(tl.float32)
    v11 = tl.load(channel + i11, mask=inside, other=0).to(tl.float32)
    return w00 * v00 + w01 * v01 + w10 * v10 + w11 * v11


def resized_crops(
    images: list[torch.Tensor],
    boxes: torch.Tensor,
    out: torch.Tensor,
    mean: Sequence[float] = (0.0, 0.0, 0.0),
    std: Sequence[float] = (1.0, 1.0, 1.0),
) -> None:
    """Each uint8 3×H×W image's box (``boxes``' rows: left, top, width, height, flip) resized to
    the size × size of ``out`` (float32, N×3×size×size, any strides, where the images are) and
    flipped where ``boxes`` says, as (value - mean) / std of each channel's 0-255 values: one launch."""
    if not images:
        return
    size, device = out.shape[-1], out.device
    images = [img if img.is_contiguous() else img.contiguous() for img in images]  # (nvJPEG's are)
    shapes = torch.tensor([img.shape[1:] for img in images], dtype=torch.int64)  # (read once: the GIL is shared)
    addresses = torch.tensor([img.data_ptr() for img in images], dtype=torch.int64)
    box = boxes[:, :4].to(torch.float32)
    extent = box[:, [3, 2]]  # height, width
    samples = torch.ceil(extent / size).clamp(min=1).to(torch.int64)
    meta = torch.cat([addresses[:, None], shapes, samples, boxes[:, 4:5].to(torch.int64)], 1)
    bins = torch.cat([box[:, [1, 0]] - 0.5, extent / size], 1)
    grid = (len(images), triton.cdiv(size * size, BLOCK))
    # Triton launches on the calling thread's current device (CUDA keeps one per thread, the
    # first GPU until set): the batch's, named. (On the CPU only its interpreter runs: the tests.)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _resize[grid](meta.to(device), bins.to(device), out, size, *out.stride(), *mean, *std, BLOCK=BLOCK)
