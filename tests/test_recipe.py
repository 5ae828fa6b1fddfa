"""The recipe's extras on real tensors and real training runs: batch mixing, weight EMA, augmentation, --recipe."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import TINY, TINY_ARCH, records, train_here, write_shards
from forked import ranks

from imagenet_ais.cli.train import parse
from imagenet_ais.train import loop
from imagenet_ais.train.config import TrainConfig, differences, with_recipe
from imagenet_ais.train.ema import ModelEma, ema_decay
from imagenet_ais.train.mixup import batch_mixer

# the trained run the tests share (a module fixture): made once, in one of ./run test's processes
pytestmark = pytest.mark.xdist_group("recipe")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    # each picture one constant value, its class: what went where can be read back from the pixels
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    x = (10.0 * y + 1).view(-1, 1, 1, 1).expand(-1, 3, 16, 16).contiguous()
    return x, y


def test_mixup_blends_each_picture_with_another_and_their_labels_alike() -> None:
    torch.manual_seed(0)
    x, y = batch()
    mixed, probs = batch_mixer(0.4, 0.0, 10)(x, y)  # type: ignore[misc]
    assert probs.shape == (6, 10) and torch.allclose(probs.sum(1), torch.ones(6))
    # one λ per batch: picture i = λ·x_i + (1-λ)·x_(i-1), labels likewise
    lam = float(probs[0, 0])
    assert 0 <= lam <= 1
    assert torch.allclose(mixed, lam * x + (1 - lam) * x.roll(1, 0))
    assert torch.allclose(probs, lam * F.one_hot(y, 10) + (1 - lam) * F.one_hot(y.roll(1), 10))


def test_cutmix_pastes_a_box_and_weighs_the_labels_by_its_area() -> None:
    torch.manual_seed(1)
    x, y = batch()
    for _ in range(5):
        mixed, probs = batch_mixer(0.0, 1.0, 10)(x, y)  # type: ignore[misc]
        pasted = (mixed[0, 0] != x[0, 0, 0, 0]).float().mean()  # the area taken from picture 5
        assert torch.equal(mixed[0, 0][mixed[0, 0] != x[0, 0, 0, 0]].unique(), x[5, 0, 0, 0].view(1)) or pasted == 0
        assert torch.allclose(probs[0, 0], 1 - pasted) and torch.allclose(probs[0, 5], pasted)


def test_no_mixing_unless_asked() -> None:
    assert batch_mixer(0.0, 0.0, 10) is None


def test_ema_follows_the_model_slowly_and_keeps_its_batchnorm_statistics() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    ema = ModelEma(net, decay=0.9)
    ema.update_parameters(net)  # the first update copies
    start = net[0].weight.detach().clone()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    net(torch.randn(2, 3, 8, 8))  # training mode: BatchNorm's running mean moves
    ema.update_parameters(net)
    assert torch.allclose(ema.module[0].weight, start + 0.1)  # 0.9 · old + 0.1 · new
    assert torch.allclose(ema.module[1].running_mean, 0.1 * net[1].running_mean)


@pytest.mark.parametrize(("world", "every"), [(1, 32), (8, 32), (8, 1)])
def test_ema_decay_keeps_the_horizon_in_images(world: int, every: int) -> None:
    decay = ema_decay(0.99998, every, 256 * world, 600)
    images_per_update = 256 * world * every
    # (1 - decay) per image is the same whatever the world size or update interval
    assert (1 - decay) / images_per_update == pytest.approx((1 - 0.99998) / 600)


# --- the options in real training runs (tiny shards, CPU) ------------------------------------

ONE_WORKER = [*TINY, "--workers", "1"]
CLASSES = 6
RECIPE = ["--model-ema", "--model-ema-steps", "2", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]


def scores(proc: subprocess.CompletedProcess) -> tuple[float, float]:
    found = re.search(r"^test: top-1 ([\d.]+)% top-5 ([\d.]+)%", proc.stdout + proc.stderr, re.M)
    assert found, proc.stdout + proc.stderr
    return float(found[1]), float(found[2])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Shards, and a 2-epoch run with EMA and mixing stopped after 5 steps then resumed."""
    root = tmp_path_factory.mktemp("recipe")
    data, output = root / "shards", root / "run"
    # 8 steps an epoch; 6 classes: top-5 is measured (of fewer it is always 100%, and left out)
    write_shards(data, {"train": [12, 12, 8], "val": [6, 6]}, classes=CLASSES)
    common = ["--data", data, "--output", output, *ONE_WORKER, *RECIPE, "--epochs", "2", "--log-every", "4"]
    train_here(*common, "--max-steps", "5")
    stopped = torch.load(output / "last.pt", weights_only=True)
    assert int(stopped["model_ema"]["n_averaged"]) == 2  # updates at steps 2 and 4
    train_here(*common, "--resume", "auto")
    return data, output


def test_ema_weights_are_validated_saved_and_carried_across_a_resume(trained: tuple[Path, Path]) -> None:
    _, output = trained
    state = torch.load(output / "last.pt", weights_only=True)
    # updates every 2 of the 16 steps: 8 if the resumed run went on with the saved average (6 if it began anew)
    assert int(state["model_ema"]["n_averaged"]) == 8
    ema, model = state["model_ema"], state["model"]
    assert any(not torch.equal(ema[f"module.{k}"], v) for k, v in model.items() if v.is_floating_point())
    val = records(output, "val")
    assert len(val) == 2 and all({"ema_top1", "ema_top5"} <= r.keys() for r in val)


@pytest.mark.slow
def test_mixing_changes_what_the_model_is_trained_on(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = trained
    losses = []
    variants = (
        [],
        ["--mixup-alpha", "0.4"],
        ["--cutmix-alpha", "1.0"],
        ["--auto-augment", "ta_wide"],
        ["--random-erase", "0.5"],
        ["--decode", "gpu"],
        ["--decode", "gpu", "--auto-augment", "augmix", "--random-erase", "0.5"],
    )
    for extra in variants:
        output = tmp_path / f"run{len(losses)}"
        train_here("--data", data, "--output", output, *ONE_WORKER, "--epochs", "1", "--log-every", "2", *extra)
        losses.append([r["loss"] for r in records(output, "train")])
    assert len({tuple(run) for run in losses[:5]}) == 5
    assert losses[5] != losses[6]  # the device path augments too


def test_recipes_fill_in_what_the_command_line_leaves_out() -> None:
    v2 = parse(["--recipe", "v2", "--epochs", "3", "--lr", "0.1"])
    assert (v2.epochs, v2.lr, v2.auto_augment, v2.random_erase, v2.model_ema) == (3, 0.1, "ta_wide", 0.1, True)
    assert (v2.image_size, v2.val_size, v2.val_resize_size, v2.mixup_alpha) == (176, 224, 232, 0.2)
    fast = parse(["--recipe", "fast", "--label-smoothing", "0"])
    assert (fast.epochs, fast.progressive, fast.val_size, fast.label_smoothing) == (16, "160:192", 256, 0)
    # an option given at its default value still counts as given
    assert parse(["--recipe", "v2", "--random-erase", "0"]).random_erase == 0
    assert parse([]) == TrainConfig()
    # torchvision's names for the sizes
    named = parse(["--train-crop-size", "176", "--val-crop-size", "224", "--val-resize-size", "232"])
    assert (named.image_size, named.val_size, named.val_resize_size) == (176, 224, 232)


def test_every_option_given_beats_a_recipe_and_a_launchers_own_defaults_do_not() -> None:
    # --recipe fast --image-size 64 trained at 160 px; ./run local1 --recipe fast kept the demo's epochs 8, lr 0.4
    sized = parse(["--recipe", "fast", "--image-size", "64"])
    assert (sized.image_size, sized.progressive, sized.epochs) == (64, None, 16)
    demo = ["--arch", "resnet18", "--epochs", "8", "--lr", "0.4", "--launcher-defaults", "arch,epochs,lr"]
    launched = parse(["--recipe", "fast", *demo])
    assert (launched.arch, launched.epochs, launched.lr) == ("resnet18", 16, 0.425)
    assert (launched.sources["arch"], launched.sources["epochs"]) == ("launcher", "recipe fast")
    assert parse(demo).epochs == 8, "without a recipe they hold"
    with pytest.raises(ValueError, match=r"^--image-size 64 with --progressive 160:192: .*leave one out$"):
        parse(["--image-size", "64", "--progressive", "160:192"])
    # from Python too (only the command line applied recipes)
    from_python = with_recipe(TrainConfig(recipe="fast", epochs=3))
    assert differences(from_python) == {
        "set": ["recipe=fast", "epochs=3"],
        "recipe fast": ["lr=0.425", "warmup_epochs=2.0", "progressive=160:192", "val_size=256"],
    }
    assert with_recipe(from_python) == from_python


def test_a_run_says_its_settings_once_and_keeps_them_beside_its_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    output = tmp_path / "run"
    cfg = TrainConfig(
        output=str(output), synthetic=True, arch=TINY_ARCH, batch_size=2, recipe="fast", epochs=1, warmup_epochs=0,
        max_steps=1, sources={"epochs": "option"},
    )  # fmt: skip
    loop.train(cfg)
    said = capsys.readouterr().out.splitlines()
    assert said[:3] == [
        f"set: recipe=fast, output={output}, arch={TINY_ARCH}, batch_size=2, warmup_epochs=0, max_steps=1, "
        "synthetic=True",
        "option: epochs=1",
        "recipe fast: lr=0.425, progressive=160:192, val_size=256",
    ]
    kept = json.loads((output / "config.json").read_text())
    assert (kept["progressive"], kept["sources"]["lr"], kept["sources"]["epochs"]) == (
        "160:192",
        "recipe fast",
        "option",
    )


def test_test_only_reproduces_the_last_validation_at_any_world_size(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, output = trained
    last = records(output, "val")[-1]
    expected = (round(last["top1"], 4), round(last["top5"], 4))
    args = ["--data", data, *ONE_WORKER, "--test-only", "--resume", output / "last.pt"]
    assert scores(train_here(*args, "--output", tmp_path / "one")) == expected
    # training's augmentation is not validation's
    augmented = ["--auto-augment", "augmix", "--random-erase", "1"]
    assert scores(train_here(*args, *augmented, "--output", tmp_path / "aug")) == expected
    assert scores(ranks(2, *args, "--output", tmp_path / "two")) == expected
    # nothing to test: a fresh output and no weights
    refused = train_here("--data", data, *ONE_WORKER, "--test-only", "--output", tmp_path / "none", check=False)
    assert refused.returncode == 1 and "--test-only: nothing to test" in refused.stderr


def test_a_model_started_from_weights_validates_as_the_run_it_came_from(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    data, output = trained
    last = records(output, "val")[-1]
    plain = tmp_path / "weights.pth"  # a bare state dict, as torchvision's released weights are
    torch.save(torch.load(output / "last.pt", weights_only=True)["model"], plain)
    for weights in (plain, output / "last.pt"):
        test = ["--test-only", "--weights", weights, "--output", tmp_path / "t"]
        proc = train_here("--data", data, *ONE_WORKER, *test)
        assert scores(proc) == (round(last["top1"], 4), round(last["top5"], 4))
    wrong = train_here(
        "--data", data, *ONE_WORKER, "--arch", "resnet34", "--test-only", "--weights", plain,
        "--output", tmp_path / "w", check=False,
    )  # fmt: skip
    assert wrong.returncode == 1 and f"--weights {plain}: does not fit this model" in wrong.stderr


def test_clipped_gradients_move_the_weights_less(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = trained
    torch.manual_seed(0)
    start = tmp_path / "start.pth"
    torch.save(torchvision.models.get_model(TINY_ARCH, num_classes=CLASSES).state_dict(), start)
    moved = []
    for clip in ([], ["--clip-grad-norm", "0.001"]):
        output = tmp_path / f"clip{len(moved)}"
        train_here("--data", data, "--output", output, *ONE_WORKER, "--weights", start, "--max-steps", "3", *clip)
        end = torch.load(output / "last.pt", weights_only=True)["model"]
        begin = torch.load(start, weights_only=True)
        # the weights the optimizer steps: BatchNorm's running statistics follow the data, clipped or not
        weights = [k for k in begin if begin[k].is_floating_point() and not k.endswith(("running_mean", "running_var"))]
        moved.append(sum(float((end[k] - begin[k]).norm()) for k in weights))
    assert moved[1] < moved[0] / 10, moved


def test_sync_bn_is_refused_without_gpus(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = trained
    args = ["--data", data, "--output", tmp_path / "run", *ONE_WORKER, "--sync-bn", "--max-steps", "1"]
    proc = ranks(2, *args, check=False)
    assert proc.returncode != 0 and "--sync-bn: SyncBatchNorm runs on GPUs only" in proc.stderr


def test_a_validation_resize_below_its_crop_is_refused(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, output = trained
    args = ["--data", data, *ONE_WORKER, "--test-only", "--resume", output / "last.pt", "--output", tmp_path / "t"]
    proc = train_here(*args, "--val-resize-size", "24", check=False)
    assert proc.returncode == 1 and "--val-resize-size 24 is smaller than the validation crop (32)" in proc.stderr
    whole = scores(train_here(*args, "--val-resize-size", "32"))  # the whole short side, at 32 px
    assert 0 <= whole[0] <= 100
