"""Several shard sets mixed by weight (loader/mixture.py): resampled draws in proportion to the
weights, exact epochs that repeat and choose by them, the classes merged by name, a state that
carries the mixture over to another world size, and the mixtures refused in one line."""

from __future__ import annotations

import io
import json
import re
import shutil
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import members, train_here, write_shards
from PIL import Image

from imagenet_ais import ShardLoader, StateMismatch
from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.mixture import Source, parse_source

OPTIONS = {"image_size": 16, "workers": 2, "device": "cpu", "seed": 3}
A_SHARDS, B_SHARDS = [5, 7], [6, 4]  # 12 and 10 samples
B_NAMES = ["c3", "c2", "x", "y"]  # two of A's classes (c0-c3), in another order, and two new ones


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    write_shards(root / "a", {"train": A_SHARDS, "val": [3]}, prefix="a-")
    # noise, not one colour: another crop of it is other pixels
    noise = {f"b-train-{s}-{i}": noisy(s * 10 + i) for s, n in enumerate(B_SHARDS) for i in range(n)}
    write_shards(root / "b", {"train": B_SHARDS}, names=B_NAMES, prefix="b-", pictures=noise)
    return str(root / "a"), str(root / "b")


def noisy(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def labels_in(location: str) -> dict[str, int]:
    """Each training key's label as its shards store it."""
    out: dict[str, int] = {}
    for shard in sorted(Path(location).glob("*-train-*.tar")):
        out.update({name[: -len(".cls")]: int(data) for name, data in members(shard).items() if name.endswith(".cls")})
    return out


def keys_of(loader: ShardLoader, steps: int | None = None) -> list[str]:
    keys: list[str] = []
    for step, (_, _, batch) in enumerate(loader):
        keys += batch
        if steps is not None and step + 1 == steps:
            break
    return keys


def test_resampled_epochs_draw_each_source_in_proportion_to_its_weight(tmp_path: Path) -> None:
    # shards of 16 samples beside shards of 4: the weights are the samples' shares, not the shards'
    write_shards(tmp_path / "big", {"train": [16] * 4}, prefix="big-")
    write_shards(tmp_path / "small", {"train": [4] * 4}, prefix="small-")
    for weights, expected in (((1, 1), 0.5), ((1, 3), 0.75)):
        mixture = [(str(tmp_path / "big"), weights[0]), (str(tmp_path / "small"), weights[1])]
        with ShardLoader(mixture, "train", 16, epoch_mode="resampled", epoch_size=1600, **OPTIONS) as loader:
            assert (len(loader), loader.samples) == (100, 80)
            keys = keys_of(loader)
        share = sum(k.startswith("small-") for k in keys) / len(keys)
        # 4 σ: the share's spread over 400 simulated epochs of these draws was 0.038-0.039 (by
        # shard counts, without the weights, it would be 0.2)
        assert abs(share - expected) < 4 * 0.039, (weights, share)


def test_exact_epochs_repeat_and_choose_by_weight_with_the_classes_merged_by_name(sources: tuple[str, str]) -> None:
    a, b = sources
    mixture = [(a, 1), (b, 2.8)]  # a once; b twice whole and 8 of its 10 samples a third time: 40 a epoch
    with ShardLoader(mixture, "train", 4, epoch_mode="exact", **OPTIONS) as loader:
        assert (len(loader), loader.samples) == (10, 40)
        assert loader.classes == ["c0", "c1", "c2", "c3", "x", "y"]
        stored = {**labels_in(a), **labels_in(b)}
        epochs: list[Counter[str]] = []
        for _ in range(2):
            seen: Counter[str] = Counter()
            crops: dict[str, list[torch.Tensor]] = {}
            for images, labels, keys in loader:
                seen.update(keys)
                for key, image, label in zip(keys, images, labels.tolist(), strict=True):
                    theirs = B_NAMES if key.startswith("b-") else loader.classes
                    assert loader.classes[label] == theirs[stored[key]], f"{key}: mapped by its class's name"
                    crops.setdefault(key, []).append(image)
            epochs.append(seen)
            for key, taken in crops.items():
                assert all(not torch.equal(taken[0], other) for other in taken[1:]), (
                    f"{key}: a crop of its own each pass"
                )
    for seen in epochs:
        assert {k: n for k, n in seen.items() if k.startswith("a-")} == dict.fromkeys(labels_in(a), 1)
        b_counts = Counter(n for k, n in seen.items() if k.startswith("b-"))
        assert b_counts == {3: 8, 2: 2}, "every b sample twice, 8 of them three times"
    thrice = [{k for k, n in seen.items() if n == 3} for seen in epochs]
    assert thrice[0] != thrice[1], "the chosen part is drawn again each epoch"


def test_a_mixture_stopped_mid_epoch_goes_on_on_two_ranks_each_sample_as_often_as_planned(
    sources: tuple[str, str],
) -> None:
    mixture = [(sources[0], 1), (sources[1], 2.8)]
    options = {**OPTIONS, "epoch_mode": "exact"}
    with ShardLoader(mixture, "train", 4, **options) as whole:
        planned = Counter(keys_of(whole))
    with ShardLoader(mixture, "train", 4, **options) as loader:
        before = keys_of(loader, steps=4)
        state = loader.state_dict()
    after: list[list[str]] = []
    for rank in (0, 1):
        with ShardLoader(mixture, "train", 2, rank=rank, world_size=2, **options) as loader:
            loader.load_state_dict(state)
            assert (loader.epoch, loader.step) == (0, 4), "24 samples left: 6 steps of 2 × 2, from step 4 of 10"
            after.append(keys_of(loader))
    assert len(after[0]) == len(after[1]) == 12, "the same steps on each rank"
    assert Counter(before + after[0] + after[1]) == planned


@pytest.mark.parametrize(
    ("mixture", "says"),
    [
        (lambda a, b: [(a, 1), (b, 3)], "over other shards or weights, or with another seed"),
        # fewer shards listed than the state names (b's part pass dropped, b dropped): a DataError was
        # raised, "a ShardLoader state naming shard 12: these shards are 0 to 11"
        (lambda a, b: [(a, 1), (b, 2)], "over other shards or weights, or with another seed"),
        (lambda a, b: [a], "over other shards or with another seed"),
        (lambda a, b: [(b, 2.5)], "over other shards or weights, or with another seed"),
    ],
)
def test_a_mixture_restored_under_other_weights_or_sources_starts_its_epoch_over(
    mixture, says: str, sources: tuple[str, str]
) -> None:
    options = {**OPTIONS, "epoch_mode": "exact"}
    with ShardLoader([(sources[0], 1), (sources[1], 2.5)], "train", 4, **options) as loader:
        keys_of(loader, steps=2)
        state = loader.state_dict()
    with ShardLoader(mixture(*sources), "train", 4, **options) as loader:
        with pytest.raises(StateMismatch, match=re.escape(f"epoch 1 stopped at step 2 of 9 on 1 × 4 {says}")):
            loader.load_state_dict(state)
        assert len(keys_of(loader)) == len(loader) * 4, "the epoch whole, from its start"


@pytest.mark.parametrize(
    ("mixture", "says"),
    [
        (lambda a, b: [(a, 1), (b, 0)], "weight 0 in the mixture: give a number above 0"),
        (lambda a, b: [(a, 1), (b, -2)], "weight -2 in the mixture"),
        (lambda a, b: [(a, float("nan")), b], "weight nan in the mixture"),
        (lambda a, b: [(a, 1), (b, float("inf"))], "weight inf in the mixture"),
        (lambda a, b: [(a, 1), (b, "2")], "weight '2' in the mixture"),
        (lambda a, b: [(a, 1), (a + "/", 2)], "given twice in the mixture"),
        (lambda a, b: [(a, 1), ("/" + a, 2)], "given twice in the mixture"),  # ("//tmp/...": the same directory)
        (lambda a, b: [a, (b, 1, 2)], "give (location, weight) pairs or locations"),
        (lambda a, b: [], "give a shard location, or a list of them"),
        (lambda a, b: 123, "location=123: give a shard location"),
    ],
)
def test_bad_mixtures_are_one_line(mixture, says: str, sources: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        ShardLoader(mixture(*sources), "train", 4, **OPTIONS)


@pytest.mark.parametrize(
    ("mode", "weight", "says"),
    [
        # each trained without b (0.02 × 10 samples rounds to none), its weight in the banner still
        (
            "exact",
            0.02,
            "weight 0.02 takes none of its 10 samples an exact epoch (0.02 × 10 rounds to 0): give it 0.1 or more",
        ),
        ("exact", 1e-300, "weight 1e-300 takes none of its 10 samples an exact epoch"),
        ("resampled", 1e-300, "weight 1e-300 draws 2.2e-299 of every 22 samples: give it 0.0477 or more (one in 22)"),
        ("resampled", 5e-324, "weight 4.94066e-324 draws 1.1e-322 of every 22 samples"),
        # an OverflowError and a MemoryError (every pass of every shard listed)
        ("exact", 1e308, "weight 1e+308 in exact mode takes each sample 1e+308 times an epoch: give 1000 or less"),
        ("exact", 1e9, "weight 1e+09 in exact mode takes each sample 1e+09 times an epoch: give 1000 or less"),
    ],
)
def test_a_weight_that_gives_a_source_no_samples_or_no_plan_is_one_line(
    mode: str, weight: float, says: str, sources: tuple[str, str]
) -> None:
    a, b = sources
    with pytest.raises(ConfigError, match=re.escape(f"{b}: {says}")):
        ShardLoader([(a, 1), (b, weight)], "train", 4, epoch_mode=mode, **OPTIONS)


def test_the_least_weight_it_names_gives_the_source_its_samples(sources: tuple[str, str]) -> None:
    a, b = sources
    with ShardLoader([(a, 1), (b, 0.1)], "train", 4, epoch_mode="exact", **OPTIONS) as loader:
        assert loader.samples == 12 + 1
    # weights too small or too large for a float sum: their shares, as weights 1 and 1 give
    with ShardLoader([(a, 5e-324), (b, 5e-324)], "train", 4, epoch_mode="resampled", **OPTIONS) as loader:
        assert {key[0] for key in keys_of(loader)} == {"a", "b"}  # (a ValueError: "Total of weights ...")
    with ShardLoader([(a, 1e308), (b, 1e308)], "train", 4, epoch_mode="resampled", **OPTIONS) as loader:
        assert {key[0] for key in keys_of(loader)} == {"a", "b"}


@pytest.mark.parametrize("weight", [np.int64(2), Fraction(5, 2), np.float32(2.5), 2])
def test_a_weight_is_any_real_number(weight: object, sources: tuple[str, str]) -> None:
    a, b = sources
    with ShardLoader([(a, 1), (b, weight)], "train", 4, epoch_mode="exact", **OPTIONS) as loader:
        assert loader.samples == 12 + round(float(weight) * 10)  # ("not a number" for numpy's ints and Fraction)


def test_the_same_shards_under_another_name_are_given_twice(sources: tuple[str, str], tmp_path: Path) -> None:
    a, b = sources
    (tmp_path / "link").symlink_to(b)
    shutil.copytree(b, tmp_path / "copy")
    for other in (tmp_path / "link", tmp_path / "copy"):
        with pytest.raises(ConfigError, match=re.escape(f"{other}: given twice in the mixture (as {b}")):
            ShardLoader([a, b, str(other)], "train", 4, **OPTIONS)


def test_what_a_mixture_cannot_be_asked_is_one_line(sources: tuple[str, str], tmp_path: Path) -> None:
    a, b = sources
    with pytest.raises(ConfigError, match="the val split of a mixture of 2 sources: val reads one location"):
        ShardLoader([a, b], "val", 4, **OPTIONS)
    with pytest.raises(ConfigError, match="class 'x' \\(and 1 more\\) is not among the 4 classes given"):
        ShardLoader(b, "train", 4, classes=["c0", "c1", "c2", "c3"], **OPTIONS)
    write_shards(tmp_path / "twice", {"train": [4]}, names=["c0", "c1", "c0"])
    with pytest.raises(ConfigError, match="names class 'c0' more than once"):
        ShardLoader([a, str(tmp_path / "twice")], "train", 4, **OPTIONS)


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("ais://imagenet/shards:0.5", Source("ais://imagenet/shards", 0.5)),
        ("/data/own:3", Source("/data/own", 3.0)),
        ("/data/own", Source("/data/own")),
        ("http://host:8080", Source("http://host:8080")),
        ("http://host:8080/shards:2", Source("http://host:8080/shards", 2.0)),
        ("/data/a:b", Source("/data/a:b")),
        ("C:", Source("C:")),
    ],
)
def test_a_command_lines_location_and_weight(text: str, source: Source) -> None:
    assert parse_source(text) == source


def test_train_py_trains_on_a_mixture_and_records_its_classes(sources: tuple[str, str], tmp_path: Path) -> None:
    a, b = sources
    out = tmp_path / "run"
    result = train_here(
        "--data", a, "--data", f"{b}:2", "--output", out, "--arch", "resnet18", "--image-size", "32",
        "--batch-size", "8", "--epochs", "1", "--warmup-epochs", "0", "--workers", "1", "--epoch-mode", "exact",
        "--tracker", "none",
    )  # fmt: skip
    assert "from 2 sources mixed (1, 2)" in result.stdout + result.stderr
    merged = ["c0", "c1", "c2", "c3", "x", "y"]
    assert json.loads((out / "classes.json").read_text()) == merged
    checkpoint = torch.load(out / "last.pt", map_location="cpu", weights_only=False)
    assert checkpoint["classes"] == merged and checkpoint["model"]["fc.weight"].shape[0] == 6
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if r["kind"] == "val"] == [3], "validated on the first source's val split"
    # other weights, the same shards: the run goes on (another epoch's plan), not refused as other data
    again = train_here(
        "--data", a, "--data", f"{b}:3", "--output", out, "--arch", "resnet18", "--image-size", "32",
        "--batch-size", "8", "--epochs", "2", "--warmup-epochs", "0", "--workers", "1", "--epoch-mode", "exact",
        "--tracker", "none", "--resume", "auto",
    )  # fmt: skip
    assert "from 2 sources mixed (1, 3)" in again.stdout + again.stderr
    epochs = [
        r["epoch"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "val"
    ]
    assert epochs == [1, 2]
    bad = train_here("--data", a, "--data", f"{b}:0", "--output", tmp_path / "bad", check=False)
    assert bad.returncode == 1 and f"{b}: weight 0.0 in the mixture: give a number above 0" in bad.stderr
    assert not (tmp_path / "bad").exists(), "refused before anything is made"
