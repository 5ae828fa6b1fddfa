"""--auto-augment and --random-erase: torchvision's ops, per sample in a batch, alike on both decode paths."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from test_transforms import DEVICES, jpeg, photo, pixels
from torchvision.transforms.v2 import functional as TF

from imagenet_ais.loader.augment import (
    AUGMIX_OPS,
    GEOMETRIC,
    IMAGENET_POLICY,
    OP,
    OPS,
    POLICIES,
    RA_OPS,
    Augment,
    apply_step,
    magnitude,
)
from imagenet_ais.loader.device_decode import decode_on_device
from imagenet_ais.loader.transforms import augment_on_cpu, decode_on_cpu, encode_for_device
from imagenet_ais.loader.wire import encode_batch


def affine(u8: torch.Tensor, **kw: object) -> torch.Tensor:
    return TF.affine(u8, **{"angle": 0.0, "translate": [0, 0], "scale": 1.0, "shear": [0.0, 0.0], **kw})


SHEAR = math.tan(math.radians(17.0))
# (op, magnitude as a plan holds it, torchvision's version of the same)
REFERENCE = [
    ("Brightness", 0.5, lambda u8: TF.adjust_brightness(u8, 1.5)),
    ("Color", -0.5, lambda u8: TF.adjust_saturation(u8, 0.5)),
    ("Contrast", 0.7, lambda u8: TF.adjust_contrast(u8, 1.7)),
    ("Sharpness", 0.8, lambda u8: TF.adjust_sharpness(u8, 1.8)),
    ("Posterize", 3, lambda u8: TF.posterize(u8, 3)),
    ("Solarize", 100, lambda u8: TF.solarize(u8, 100)),
    ("AutoContrast", 0, TF.autocontrast),
    ("Equalize", 0, TF.equalize),
    ("Invert", 0, TF.invert),
    ("Rotate", -30, lambda u8: TF.rotate(u8, -30.0)),
    ("ShearX", SHEAR, lambda u8: affine(u8, shear=[17.0, 0.0], center=[0, 0])),
    ("ShearY", -SHEAR, lambda u8: affine(u8, shear=[0.0, -17.0], center=[0, 0])),
    ("TranslateX", 10.7, lambda u8: affine(u8, translate=[10, 0])),
    ("TranslateY", -7, lambda u8: affine(u8, translate=[0, -7])),
    ("Identity", 0, lambda u8: u8),
]  # fmt: skip


def images(n: int) -> torch.Tensor:
    """n different smooth pictures, 48 × 64, as 0-255 floats."""
    torch.manual_seed(0)
    coarse = (torch.rand(n, 3, 6, 8) * 255).round()
    return torch.nn.functional.interpolate(coarse, size=(48, 64), mode="bilinear").round().clamp(0, 255)


@pytest.mark.parametrize("device", DEVICES)
def test_each_sample_gets_its_own_op_as_torchvision_does_it(device: str) -> None:
    x = images(len(REFERENCE))
    step = torch.tensor([[OP[op], m] for op, m, _ in REFERENCE], dtype=torch.float32)
    got = apply_step(x.to(device), step).cpu()
    for i, (op, _, reference) in enumerate(REFERENCE):
        expected = reference(x[i].to(torch.uint8)).float()
        # torchvision works in uint8 (truncating after each op), we in floats
        assert (got[i] - expected).abs().max() <= 1.0, op


def test_plans_follow_each_policy() -> None:
    rng = random.Random(0)
    for policy in POLICIES:
        augment = Augment(policy)
        plans = [augment.draw(rng, 224) for _ in range(600)]
        assert {len(p) for p in plans} == {augment.width}
        steps = [(OPS[int(p[2 * k])], p[2 * k + 1]) for p in plans for k in range(augment.steps)]
        used = {op for op, _ in steps}
        if policy == "ta_wide":
            assert used == set(RA_OPS)  # one op of 14, each with 31 strengths
            assert len({abs(m) for op, m in steps if op == "Rotate"}) > 20
            assert max(abs(m) for op, m in steps if op == "Rotate") > 100  # the wide range: up to 135°
        if policy == "ra":
            assert used == set(RA_OPS)
            assert {abs(m) for op, m in steps if op == "Rotate"} == {9 / 30 * 30}  # bin 9 of 31, all the time
        if policy == "imagenet":
            allowed = {op for pair in IMAGENET_POLICY for op, _, _ in pair}
            assert used - {"none"} == allowed and "none" in used  # sub-policies' ops, each with its probability
        if policy == "augmix":
            assert used - {"none"} == set(AUGMIX_OPS)
            weights = torch.tensor([p[18:21] for p in plans])
            assert torch.allclose(weights.sum(1), torch.ones(len(plans)))
            assert max(abs(m) for op, m in steps if op == "Rotate") <= magnitude("augmix", "Rotate", 2, 224)
        signs = {m > 0 for op, m in steps if op in GEOMETRIC and m}
        assert signs == {True, False}  # geometric ops go either way
        assert all(p[-4:] == [0, 0, 0, 0] for p in plans)  # no erasing unless asked


def test_erasing_hits_the_asked_share_of_samples_with_boxes_of_the_asked_size() -> None:
    augment, rng = Augment(erase=0.25), random.Random(1)
    boxes = [augment.draw(rng, 100)[-4:] for _ in range(2000)]
    erased = [b for b in boxes if b[2]]
    assert 400 < len(erased) < 600  # 500 expected: 5 standard deviations either way
    assert all(0.02 * 0.8 <= h * w / 100**2 <= 0.33 * 1.2 for _, _, h, w in erased)
    assert all(top + h <= 100 and left + w <= 100 for top, left, h, w in erased)
    x = torch.full((1, 3, 100, 100), 7.0)
    plan = torch.tensor([[0, 0, 0, 0, 10, 20, 30, 40]], dtype=torch.float32)[:, -4:]
    out = augment.erase_boxes(x, plan, 0.0)
    assert out[0, :, 10:40, 20:60].eq(0).all() and out.eq(0).sum() == 3 * 30 * 40


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
def test_both_decode_paths_augment_a_sample_alike(policy: str, device: str) -> None:
    augment, diffs = Augment(policy, erase=0.5), []
    for seed in range(8):
        data = jpeg(photo(200, 150, seed))
        on_cpu_rng, on_device_rng = random.Random(seed), random.Random(seed)
        on_cpu = decode_on_cpu(data, 48, on_cpu_rng)
        on_cpu = augment_on_cpu(on_cpu, augment, augment.draw(on_cpu_rng, 48)).float()
        raw, box = encode_for_device(data, on_device_rng)
        batch = encode_batch([(raw, box)], [augment.draw(on_device_rng, 48)])
        on_device, _ = decode_on_device(batch, 48, torch.device(device), False, augment)
        diffs.append((pixels(on_device)[0] - on_cpu).abs())
    # the same crop, flip, ops and erased box; the decoders and resamplers differ by a few levels,
    # which an op like Equalize or Posterize can turn into a step here and there
    assert torch.stack(diffs).median() <= 1.0
    assert max(float(d.mean()) for d in diffs) < 8.0


def test_unknown_policies_and_probabilities_are_refused() -> None:
    with pytest.raises(ValueError, match="--auto-augment 'rand'"):
        Augment("rand")
    with pytest.raises(ValueError, match=r"--random-erase 1\.5"):
        Augment(erase=1.5)
    assert not Augment() and Augment(erase=0.1) and Augment("ra")
    assert Counter(len(Augment(p).draw(random.Random(0), 32)) for p in POLICIES) == Counter(
        Augment(p).width for p in POLICIES
    )
