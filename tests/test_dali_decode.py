"""Decode "dali": DALI decodes the workers' crops (the CPU decoder here, the JPEG engines on a GPU),
and the batch comes out as the other paths make it; a batch DALI cannot decode goes to nvJPEG."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_shards
from PIL import Image
from test_transforms import DEVICES, jpeg, photo, pixels

from imagenet_ais.loader.dali_decode import DaliCrops, DaliFailed
from imagenet_ais.loader.device_decode import Decoded, crop_decoded
from imagenet_ais.loader.engine import Feeding, TrainLoader
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.transforms import Box, _crop_resize, encode_for_device
from imagenet_ais.loader.wire import encode_batch
from imagenet_ais.loader.worker import LoaderSpec
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.storage import open_store

pytestmark = pytest.mark.dali


def broken_jpeg(seed: int = 0) -> bytes:
    """A JPEG whose header reads (the worker picks its crop) but whose picture is cut short."""
    data = jpeg(photo(120, 100, seed=seed))
    return data[: data.find(b"\xff\xda") + 40]


@pytest.mark.parametrize("device", DEVICES)
def test_dali_crops_match_pil_and_leave_flip_and_normalisation_to_ours(device: str) -> None:
    datas = [jpeg(photo(w, h, seed=i)) for i, (w, h) in enumerate([(400, 300), (260, 380), (500, 333)])]
    boxes = [Box(10, 20, 200, 150, False), Box(0, 0, 120, 240, True), Box(300, 233, 200, 100, True)]  # one at the edge
    batch = encode_batch([(d, b) for d, b in zip(datas, boxes, strict=True)])
    crops = DaliCrops(torch.device(device))(batch, 48)
    assert crops.shape == (3, 48, 48, 3) and crops.dtype == torch.uint8 and crops.device.type == device
    got = crop_decoded(Decoded(crops.permute(0, 3, 1, 2), batch.boxes, batch.plans, None), 48, crops.device, True)
    expected = []
    for data, box in zip(datas, boxes, strict=True):
        out = _crop_resize(Image.open(io.BytesIO(data)), box, 48)
        expected.append(np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if box.flip else out))
    diff = (pixels(got) - torch.from_numpy(np.stack(expected)).float()).abs()
    assert diff.mean() < 3.0, diff.mean(dim=(1, 2, 3))
    unflipped = torch.from_numpy(np.array(_crop_resize(Image.open(io.BytesIO(datas[1])), boxes[1], 48))).float()
    assert (pixels(got)[1] - unflipped).abs().mean() > 10


def test_a_batch_dali_cannot_decode_fails_in_one_line_and_the_next_one_decodes() -> None:
    good = [encode_for_device(jpeg(photo(120, 100, seed=i)), None) for i in range(3)]
    dali = DaliCrops(torch.device("cpu"))
    with pytest.raises(DaliFailed, match=r"^Failed to decode sample #1$"):
        dali(encode_batch([good[0], encode_for_device(broken_jpeg(), None), good[1]]), 16)
    # a pipeline that raised is unusable: the next batch gets a new one, at a new size and length
    assert dali(encode_batch(good), 24).shape == (3, 24, 24, 3)
    assert dali(encode_batch(good[:2]), 24).shape == (2, 24, 24, 3)


def test_the_loader_decodes_with_dali_and_hands_an_undecodable_batch_to_nvjpeg(tmp_path: Path) -> None:
    write_shards(tmp_path, {"train": [6]}, pictures={"train-0-0": broken_jpeg()})
    split = load_manifest(open_store(str(tmp_path))).split("train")
    spec = LoaderSpec(world=1, rank=0, batch=3, seed=0, image_size=32, decode="dali")
    loader = TrainLoader(one_source(split, str(tmp_path)), "exact", spec, Feeding(0), 0)
    loader.set_epoch(0)
    batches = list(loader)
    assert [b.images.shape for b in batches] == [(3, 3, 32, 32)] * 2
    problems = [loader.signals.problems.get(timeout=5) for _ in range(2)]
    assert problems[0].startswith("DALI: could not decode a batch (Failed to decode sample #")
    assert "nvJPEG decodes such batches" in problems[0]
    assert "could not be decoded on cpu, replaced by another of its batch" in problems[1]
    assert loader.signals.skipped.value == 1
    assert loader.to_device.dali is not None and loader.to_device.dali.pipes  # the next batch was DALI's
