"""The two decode paths train the same thing: same crop distribution, same pixels within JPEG tolerance.

The device path runs here on the CPU (libjpeg instead of nvJPEG, same crop/resize/flip code);
on a machine with CUDA the same checks run on the GPU too.
"""

from __future__ import annotations

import importlib.util
import io
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

import imagenet_ais.loader
from imagenet_ais.errors import ConfigError
from imagenet_ais.loader import device_decode
from imagenet_ais.loader.augment import NO_AUGMENT, Augment
from imagenet_ais.loader.device_decode import (
    Decoded,
    _resize_crops,
    crop_decoded,
    decode_encoded,
    decode_on_device,
    decode_together,
)
from imagenet_ais.loader.transforms import (
    MEAN,
    MEAN_255,
    RATIO,
    SCALE,
    STD,
    STD_255,
    Box,
    _crop_resize,
    decode_on_cpu,
    encode_for_device,
)
from imagenet_ais.loader.wire import encode_batch

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """Smooth gradients with a few hard-edged shapes: JPEG-friendly but not flat."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1).astype(np.uint8)
    for _ in range(4):
        x0, y0 = rng.integers(0, w - 40), rng.integers(0, h - 40)
        pixels[y0 : y0 + 40, x0 : x0 + 40] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels)


def jpeg(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95, **kw)
    return buf.getvalue()


def pixels(x: torch.Tensor) -> torch.Tensor:
    """Normalised N×3×H×W back to 0-255 N×H×W×3 on the CPU."""
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1) * 255
    return (x * std + mean).permute(0, 2, 3, 1).cpu()


def ks_statistic(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov distance: the largest gap between the empirical CDFs."""
    a_sorted, b_sorted = np.sort(a), np.sort(b)
    grid = np.concatenate([a_sorted, b_sorted])
    cdf_a = np.searchsorted(a_sorted, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b_sorted, grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def test_device_path_crops_follow_torchvision_random_resized_crop() -> None:
    data, w, h = jpeg(photo(500, 375)), 500, 375
    ours = [encode_for_device(data, random.Random(i))[1] for i in range(4000)]
    reference = RandomResizedCrop(224, scale=list(SCALE), ratio=list(RATIO))
    torch.manual_seed(2)
    theirs = [reference.get_params(Image.new("RGB", (w, h)), reference.scale, reference.ratio) for _ in range(4000)]
    theirs_boxes = [Box(left, top, cw, ch) for top, left, ch, cw in theirs]
    for stat in (
        lambda b: b.width * b.height / (w * h),  # scale
        lambda b: math.log(b.width / b.height),  # aspect ratio
        lambda b: (b.left + b.width / 2) / w,  # where the crop sits
    ):
        assert ks_statistic([stat(b) for b in ours], [stat(b) for b in theirs_boxes]) < 0.04
    for b in ours:
        assert min(b.left, b.top) >= 0 and b.left + b.width <= w and b.top + b.height <= h
        assert SCALE[0] - 0.01 <= b.width * b.height / (w * h) <= 1
        assert RATIO[0] - 0.02 <= b.width / b.height <= RATIO[1] + 0.02
    flips = sum(b.flip for b in ours) / len(ours)
    assert 0.46 < flips < 0.54


@pytest.mark.parametrize("device", DEVICES)
def test_device_decode_matches_pil_within_jpeg_tolerance(device: str) -> None:
    rng = random.Random(0)
    datas = [jpeg(photo(rng.randint(300, 520), rng.randint(250, 400), seed=i)) for i in range(5)]
    datas.append(jpeg(photo(1124, 300)))  # larger than the rest, so theirs is not its shape
    # val: the whole pipeline on both sides
    batch = encode_batch([encode_for_device(d, None) for d in datas])
    got, rows = decode_on_device(batch, 64, torch.device(device), channels_last=True)
    assert rows is None and got.shape == (6, 3, 64, 64) and got.is_contiguous(memory_format=torch.channels_last)
    expected = torch.stack([decode_on_cpu(d, 64, None) for d in datas]).float()
    assert (pixels(got) - expected).abs().mean() < 3.0
    # train: the same random boxes through both paths, flips included
    boxes = [Box(10, 20, 200, 150, False), Box(0, 0, 120, 240, True), Box(50, 5, 250, 240, True)]
    batch = encode_batch([(datas[i], box) for i, box in enumerate(boxes)])
    got, _ = decode_on_device(batch, 48, torch.device(device), channels_last=False)
    expected = []
    for i, box in enumerate(boxes):
        out = _crop_resize(Image.open(io.BytesIO(datas[i])), box, 48)
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if box.flip else out
        expected.append(torch.from_numpy(np.array(out)).float())
    diff = (pixels(got) - torch.stack(expected)).abs()
    assert diff.mean() < 3.0, diff.mean(dim=(1, 2, 3))
    # the flip is there: comparing against the unflipped crop is far off
    unflipped = torch.from_numpy(np.array(_crop_resize(Image.open(io.BytesIO(datas[1])), boxes[1], 48))).float()
    assert (pixels(got)[1] - unflipped).abs().mean() > 10


@pytest.mark.parametrize("device", DEVICES)
def test_shrinking_fine_detail_averages_it_like_pil(device: str) -> None:
    # black/white pixel noise shrunk 8×: a resize that only samples keeps it (std ≈ 60);
    # PIL's filter averages it towards grey (std ≈ 16), so must ours
    noise = np.random.default_rng(0).integers(0, 2, (256, 256, 1), dtype=np.uint8).repeat(3, axis=2) * 255
    data, box = jpeg(Image.fromarray(noise), subsampling=0), Box(0, 0, 256, 256)
    pil = torch.from_numpy(np.array(_crop_resize(Image.open(io.BytesIO(data)), box, 32))).float()
    got, _ = decode_on_device(encode_batch([(data, box)]), 32, torch.device(device), channels_last=False)
    assert pil.std() < 25 and pixels(got).std() < 25, (pil.std(), pixels(got).std())


# photo(200, 150) coded with arithmetic instead of Huffman tables (libjpeg-turbo's `cjpeg -arithmetic`),
# which libjpeg decodes and nvJPEG does not: shards made elsewhere may hold such JPEGs
ARITHMETIC = Path(__file__).parent / "jpegs" / "arithmetic.jpg"


@pytest.mark.parametrize("device", DEVICES)
def test_odd_inputs_are_reencoded_for_the_device(device: str) -> None:
    img = photo(200, 150)
    gray, cmyk = jpeg(img.convert("L")), jpeg(img.convert("CMYK"))
    png = io.BytesIO()
    img.save(png, format="PNG")
    odd = (gray, cmyk, png.getvalue(), ARITHMETIC.read_bytes())
    samples = [encode_for_device(d, None) for d in odd]
    for (raw, box), data in zip(samples, odd, strict=True):
        reread = Image.open(io.BytesIO(raw))
        assert raw != data and (reread.format, reread.mode, reread.size) == ("JPEG", "RGB", (200, 150))
        assert box == Box(34, 9, 131, 131)  # the centre 131 × 131 (0.875 × 150)
    progressive = jpeg(img, progressive=True)  # (nvJPEG's own)
    assert encode_for_device(progressive, None)[0] == progressive
    got, _ = decode_on_device(encode_batch(samples), 32, torch.device(device), channels_last=False)
    expected = torch.stack([decode_on_cpu(d, 32, None) for d in odd]).float()
    assert (pixels(got) - expected).abs().mean() < 4.0


@pytest.mark.parametrize("device", DEVICES)
def test_a_jpeg_the_devices_decoder_fails_is_decoded_by_libjpeg_not_replaced(device: str) -> None:
    # (the workers re-encode these; a JPEG that reaches the device anyway loses nothing)
    good = [encode_for_device(jpeg(photo(120, 100, seed=i)), None) for i in range(2)]
    data = ARITHMETIC.read_bytes()
    batch = encode_batch([good[0], (data, Box(34, 9, 131, 131)), good[1]])  # validation's box
    got, rows = decode_on_device(batch, 32, torch.device(device), channels_last=False)
    assert rows is None
    assert (pixels(got)[1] - decode_on_cpu(data, 32, None).float()).abs().mean() < 4.0


def random_crops(
    count: int, seed: int, sides: tuple[int, int], least: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """``count`` uint8 3×H×W noise images with sides in ``sides``, and a box in each of at least
    ``least`` pixels a side, every other one flipped."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    images, boxes = [], []
    for i in range(count):
        h, w = rng.randint(*sides), rng.randint(*sides)
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        bw, bh = rng.randint(least, w), rng.randint(least, h)
        boxes.append([rng.randint(0, w - bw), rng.randint(0, h - bh), bw, bh, i % 2])
    return images, boxes


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """crop_kernel.py as Triton's interpreter runs it, on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.find_spec("imagenet_ais.loader.crop_kernel")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)  # (its own copy: a CUDA run's stays compiled)
    spec.loader.exec_module(module)
    return module


def test_the_cuda_crop_kernel_resizes_flips_and_normalises_as_the_cpu_path(kernel: ModuleType) -> None:
    # The Triton kernel CUDA crops with, run here by Triton's interpreter, against the image-by-image
    # roi_align of the CPU path, then torch's flip and normalisation: images of other shapes in one
    # batch, boxes down- and upscaled, whole pictures, one pixel at the bottom right corner, flipped
    # or not, written into a slice of a channels-last batch or a plain one.
    images, boxes = random_crops(6, seed=0, sides=(20, 90), least=1)
    images += [images[0], images[1], images[2][:, 5:, :]]  # the last one not contiguous
    boxes += [[0, 0, 90, 90, 1], [0, 0, 1, 1, 0], [0, 0, 4, 4, 1]]
    boxes[6][2:4] = images[0].shape[2], images[0].shape[1]
    boxes[7][:2] = images[1].shape[2] - 1, images[1].shape[1] - 1
    box = torch.tensor(boxes)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1) * 255, torch.tensor(STD).view(1, 3, 1, 1) * 255
    for size, layout in ((16, torch.channels_last), (37, torch.contiguous_format)):
        resized = _resize_crops(images, box, size)
        flipped = torch.where(box[:, 4].bool().view(-1, 1, 1, 1), resized.flip(-1), resized)
        batch = torch.full((11, 3, size, size), -1000.0).contiguous(memory_format=layout)
        kernel.resized_crops(images, box, batch[1:10], MEAN_255, STD_255)
        assert (batch[1:10] - (flipped - mean) / std).abs().max() < 1e-4
        assert (batch[0] == -1000).all() and (batch[10] == -1000).all()  # the rest of the batch untouched
        kernel.resized_crops(images, box, batch[:9])  # 0-255, as when augmentation ops follow
        assert (batch[:9] - flipped).abs().max() < 1e-3
    assert (flipped[1] - resized[1].flip(-1)).abs().max() == 0 and (flipped[1] - resized[1]).abs().max() > 10
    kernel.resized_crops([], torch.zeros(0, 5), batch[:0])


@pytest.mark.parametrize("augment", [NO_AUGMENT, Augment("ra"), Augment(None, 0.5)], ids=str)
def test_the_crop_stage_with_the_kernel_matches_it_without(
    kernel: ModuleType, augment: Augment, monkeypatch: pytest.MonkeyPatch
) -> None:
    # crop_decoded as on CUDA (the kernel, here interpreted) against its CPU branch: the same
    # batch, whatever follows the crop, with two rows the workers cropped after the decoded ones
    images, boxes = random_crops(5, seed=1, sides=(30, 80), least=5)
    boxes += [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    pixels = torch.randint(0, 256, (2, 24, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    plans = torch.tensor([augment.draw(random.Random(i), 24) for i in range(7)], dtype=torch.float32)
    decoded = Decoded(images, torch.tensor(boxes), plans, None, pixels)
    for channels_last in (True, False):
        expected = crop_decoded(decoded, 24, torch.device("cpu"), channels_last, augment)
        with monkeypatch.context() as patch:
            patch.setattr(device_decode, "_crop_kernel", lambda device: kernel)
            got = crop_decoded(decoded, 24, torch.device("cpu"), channels_last, augment)
        assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert (got - expected).abs().max() < 1e-5


def test_cuda_crops_without_triton_stop_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # what an install without Triton imports
    # as if never imported: an earlier CUDA test may have left it in sys.modules and on its package
    monkeypatch.delitem(sys.modules, "imagenet_ais.loader.crop_kernel", raising=False)
    monkeypatch.delattr(imagenet_ais.loader, "crop_kernel", raising=False)
    image, box = torch.zeros(3, 8, 8, dtype=torch.uint8), torch.tensor([[0, 0, 8, 8, 0]])
    decoded = Decoded([image], box, torch.zeros(1, 4), None)
    with pytest.raises(ConfigError, match=r"decode 'gpu' crops with Triton, .*--decode cpu$"):
        crop_decoded(decoded, 4, torch.device("cuda"), False)


def test_an_undecodable_sample_is_replaced_by_another_of_the_batch() -> None:
    good = [encode_for_device(jpeg(photo(120, 100, seed=i)), None) for i in range(3)]
    broken = (b"\xff\xd8\xff not really a jpeg", good[0][1])
    got, rows = decode_on_device(encode_batch([good[0], broken, *good[1:]]), 16, torch.device("cpu"), False)
    assert got.shape == (4, 3, 16, 16) and rows is not None
    assert rows[0] == 0 and rows[2:] == [2, 3] and rows[1] in (0, 2, 3)
    assert torch.equal(got[1], got[rows[1]])
    with pytest.raises(RuntimeError, match="none of the 1 JPEGs"):
        decode_on_device(encode_batch([broken]), 16, torch.device("cpu"), False)


@pytest.mark.parametrize("device", DEVICES)
def test_batches_decoded_together_are_as_each_decoded_alone(device: str) -> None:
    # (the decode stage takes the batches waiting for it in one nvJPEG call: device_feed.Merged)
    broken = (b"\xff\xd8\xff not really a jpeg", encode_for_device(jpeg(photo(90, 80)), None)[1])
    first = [encode_for_device(jpeg(photo(120, 100, seed=i)), None) for i in range(3)]
    second = [encode_for_device(jpeg(photo(80, 90, seed=10 + i)), None) for i in range(2)]
    with_broken = [encode_batch(first), encode_batch([broken, *second])]
    for batches in ([encode_batch(first), encode_batch(second)], with_broken):
        together = decode_together(batches, torch.device(device))
        for batch, got in zip(batches, together, strict=True):
            alone = decode_encoded(batch, torch.device(device))
            assert got.rows == alone.rows and torch.equal(got.boxes, alone.boxes)
            assert [tuple(i.shape) for i in got.images] == [tuple(i.shape) for i in alone.images]
            assert all(torch.equal(a, b) for a, b in zip(got.images, alone.images, strict=True))
    assert together[0].rows is None and together[1].rows is not None  # replaced within its own batch
    assert together[1].rows[0] in (1, 2)


def test_crops_at_the_picture_edge_are_not_darkened() -> None:
    white = jpeg(Image.new("RGB", (200, 150), (255, 255, 255)))
    boxes = [Box(100, 50, 100, 100), Box(0, 0, 200, 150), Box(180, 130, 20, 20)]  # down- and upscaled
    larger = (jpeg(Image.new("RGB", (300, 300), (255, 255, 255))), Box(0, 0, 10, 10))  # so the others get padding
    batch = encode_batch([*((white, b) for b in boxes), larger])
    got, _ = decode_on_device(batch, 32, torch.device("cpu"), channels_last=False)
    assert pixels(got).min() > 250


def test_validation_takes_the_centre_square_the_resize_size_leaves() -> None:
    data = jpeg(photo(200, 150))
    # 224 of 256 (the default), 224 of 232 (torchvision's V2 weights), the whole short side
    for crop, side in ((0.875, 131), (224 / 232, 145), (1.0, 150)):
        _, box = encode_for_device(data, None, crop)
        assert box == Box((200 - side) // 2, (150 - side) // 2, side, side)
        on_cpu = decode_on_cpu(data, 32, None, crop).float()
        on_device, _ = decode_on_device(encode_batch([(data, box)]), 32, torch.device("cpu"), channels_last=False)
        assert (pixels(on_device)[0] - on_cpu).abs().mean() < 3.0
