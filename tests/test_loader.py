"""ShardLoader, the data path as a library: a plain training loop over it, its state across a
stop (also on another number of ranks), and PyTorch Lightning resuming mid-epoch through it."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import os
import re
import shutil
import signal
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TINY_ARCH, child_pids, ended_as_dropped, write_shards
from PIL import Image
from torch import nn
from torchvision.transforms import v2

from imagenet_ais import ShardLoader, Stalled, StateMismatch, TransformFailed
from imagenet_ais.errors import ConfigError, DataError
from imagenet_ais.loader.augment import Augment
from imagenet_ais.loader.shard_loader import few_queues
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.storage import LocalStore

SHARDS = [20, 13, 7, 24]  # 64 samples: 8 steps of 8 on one rank, 4 on two
ALL = {f"train-{s}-{i}" for s, n in enumerate(SHARDS) for i in range(n)}
OPTIONS = {"image_size": 32, "workers": 2, "epoch_mode": "exact", "device": "cpu"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("shards")
    write_shards(root, {"train": SHARDS, "val": [5, 6]})
    return str(root)


def tiny_model() -> nn.Module:
    layers = [nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return nn.Sequential(*layers)


def train_steps(loader: ShardLoader, model: nn.Module, steps: int | None = None) -> list[str]:
    """A plain loop over one pass of ``loader`` (``steps`` of it at most): the keys trained."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    keys: list[str] = []
    for step, (images, labels, batch_keys) in enumerate(loader):
        assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        keys += batch_keys
        if steps is not None and step + 1 == steps:
            break
    return keys


def test_a_plain_loop_trains_exact_epochs_and_resumes_mid_epoch_on_two_ranks(data: str, tmp_path: Path) -> None:
    model = tiny_model()
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        assert (len(loader), loader.classes, loader.samples) == (8, ["c0", "c1", "c2", "c3"], 64)
        first = train_steps(loader, model)
        assert Counter(first) == Counter(ALL), "epoch 1: every sample once"
        second = train_steps(loader, model, steps=3)  # the next pass is the next epoch
        assert first != second[: len(first)], "another epoch, another order"
        torch.save({"model": model.state_dict(), "data": loader.state_dict()}, tmp_path / "ckpt.pt")

    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # (plain data: a weights-only load reads it)
    assert (saved["data"]["epoch"], saved["data"]["step"]) == (1, 3)
    rest: list[list[str]] = []
    for rank in (0, 1):  # the epoch goes on on 2 ranks, each its own loader (as DDP's processes)
        with ShardLoader(data, "train", 8, rank=rank, world_size=2, **OPTIONS) as loader:
            loader.load_state_dict(saved["data"])
            assert (loader.epoch, loader.step) == (1, 2), "40 samples left: 2 steps of 2 × 8"
            assert loader.continued == (1, 3, 8, 1, 8, 24), "where it stopped: epoch 2, 3 steps of 8 on 1 × 8"
            assert str(loader.continued) == "epoch 2 stopped at step 3 of 8 on 1 × 8"
            rest.append(train_steps(loader, tiny_model()))
            assert loader.state_dict()["epoch"] == 2, "handed out whole: the state is the next epoch's"
    assert [len(r) for r in rest] == [16, 16], "the same steps on each rank"
    trained = Counter(second + rest[0] + rest[1])
    assert set(trained.values()) == {1} and len(trained) == 56, "epoch 2: no sample twice (8 sit it out)"


def test_a_resampled_epoch_goes_on_as_far_through_it_from_fresh_streams(data: str) -> None:
    options = {**OPTIONS, "epoch_mode": "resampled", "epoch_size": 160}
    with ShardLoader(data, "train", 8, **options) as loader:
        assert len(loader) == 20
        before = train_steps(loader, tiny_model(), steps=5)
        state = loader.state_dict()
    assert (state["step"], state["position"]) == (5, None)
    with ShardLoader(data, "train", 4, **options) as loader:  # half the batch: twice the steps
        loader.load_state_dict(state)
        assert loader.continued is not None and loader.continued.trained is None, "resampled: no record of samples"
        after = [key for _, _, keys in loader for key in keys]
        assert len(after) == (40 - 10) * 4, "from step 10 of 40"
        assert (loader.step, loader.state_dict()["epoch"]) == (0, 1), "the next pass: the next epoch's start"
    assert set(before + after) <= ALL


def test_a_pass_ended_before_its_end_says_so_rather_than_stop_as_if_whole(data: str) -> None:
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        with pytest.raises(ConfigError, match=r"ended when another began .*zip\(loader, loader\)") as raised:
            list(zip(loader, loader, strict=True))  # the second pass began before the first's first batch
        assert "\n" not in str(raised.value)
        first = iter(loader)
        next(first)
        second = iter(loader)  # the first is still held: asking it for more is an error, not its epoch's end
        with pytest.raises(ConfigError, match="ended when another began"):
            next(first)
        assert len(list(second)) == len(loader), "the new pass is a whole epoch"
        with pytest.raises(StopIteration):
            next(second)  # a pass handed out whole ends as any iterator does
        assert len(train_steps(loader, tiny_model(), steps=3)) == 24  # a pass left by break is simply dropped
        assert len(list(loader)) == len(loader)
        fourth = iter(loader)
        next(fourth)
        fourth.close()  # as a generator's: its feed stops, and it ends
        assert next(fourth, None) is None
        third = iter(loader)
        next(third)
    with pytest.raises(ConfigError, match="the loader was closed during this pass"):
        next(third)


def test_a_loader_whose_loop_broke_off_a_pass_and_dropped_it_ends_its_workers_at_once(data: str) -> None:
    # as it is dropped, not at some later collection, in whatever thread or lock that runs in
    before = child_pids(os.getpid())
    held = [ShardLoader(data, "train", 8, **OPTIONS)]
    assert len(train_steps(held[0], tiny_model(), steps=2)) == 16  # the loop breaks off its pass
    workers = child_pids(os.getpid()) - before
    assert len(workers) == 2
    ended_as_dropped(held, workers)


def _solid_red(img: Image.Image) -> Image.Image:
    return Image.new("RGB", (8, 8), (255, 0, 0))


def _sevens(img: Image.Image) -> torch.Tensor:
    return torch.full((3, 8, 8), 7.0)


def _frozen_objects(img: Image.Image) -> torch.Tensor:
    return torch.full((3, 8, 8), float(gc.get_freeze_count()))


def _raising(img: Image.Image) -> torch.Tensor:
    raise ValueError(f"no crop of {img.width}×{img.height}\nsecond line")


def _as_big_as_given(img: Image.Image) -> torch.Tensor:
    return v2.functional.pil_to_tensor(img)  # the pictures' own sizes: no batch of them


def _a_number(img: Image.Image) -> int:
    return 3


def _sixteen_bits(img: Image.Image) -> torch.Tensor:
    return torch.zeros((3, 8, 8), dtype=torch.int16)  # (it was taken as floats, never normalised)


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _unprintable(img: Image.Image) -> torch.Tensor:
    raise RuntimeError(_Unprintable())  # (it came as torch's "Caught RuntimeError in DataLoader worker process 0")


def _quoting_ours(img: Image.Image) -> torch.Tensor:
    raise RuntimeError("imagenet_ais.loader.failures.TransformFailed: not this")  # (it was all the line said)


def _exits(img: Image.Image) -> torch.Tensor:
    raise SystemExit(3)  # (it was a worker "killed? the OOM killer says so")


def _interrupted(img: Image.Image) -> torch.Tensor:
    raise KeyboardInterrupt


def _moves_away(img: Image.Image) -> torch.Tensor:
    os.chdir("/")  # (the rest of the worker's shards were unread: their paths were relative)
    return _sevens(img)


def _nothing(images: torch.Tensor) -> None:
    return None


def _as_a_list(images: torch.Tensor) -> list[torch.Tensor]:
    return list(images)


def _one_dropped(images: torch.Tensor) -> torch.Tensor:
    return images[1:]  # (handed out: 7 images, 8 labels)


def _ninth(images: torch.Tensor) -> torch.Tensor:
    return images[8]


def _hold_and_die(condition: object) -> None:
    condition.acquire()  # type: ignore[attr-defined]
    os.kill(os.getpid(), signal.SIGKILL)


def test_close_returns_where_a_process_was_killed_holding_the_workers_shutdown_lock(data: str) -> None:
    # close() kills the workers at once; each checks torch's shutdown event in its loop, under the
    # event's lock, and one killed holding it left close() waiting for ever (a CI run hung so)
    loader = ShardLoader(data, "train", 8, **OPTIONS)
    next(iter(loader))
    event = loader._loader.loader._iterator._workers_done_event
    holder = mp.get_context("fork").Process(target=_hold_and_die, args=(event._cond,))
    holder.start()
    holder.join()
    assert holder.exitcode == -signal.SIGKILL
    closing = threading.Thread(target=loader.close, daemon=True)
    closing.start()
    closing.join(timeout=20)
    assert not closing.is_alive(), "close() waits on a lock no live process can release"


def test_the_loader_goes_on_where_a_process_was_killed_holding_a_counters_lock(data: str) -> None:
    # The workers are killed at once (a resumed epoch's end, close), and their counters' locks
    # are semaphores no death releases: one killed holding one left the next workers' counts, and
    # this process's reads of them, waiting for ever
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        next(iter(loader))
        signals = loader._loader.signals
        for lock in (signals.drawn.get_lock(), signals.reads.get_lock()):
            holder = mp.get_context("fork").Process(target=_hold_and_die, args=(lock,))
            holder.start()
            holder.join()
            assert holder.exitcode == -signal.SIGKILL
        loader._loader.shut_down()  # (as set_epoch does for a restored epoch's successor)
        went_on: list[tuple[dict, int, dict]] = []  # (each call in a thread: one may wait for ever)
        epoch = threading.Thread(
            target=lambda: went_on.append((loader.reads(), len(list(loader)), loader.reads())), daemon=True
        )
        epoch.start()
        epoch.join(timeout=60)
        assert not epoch.is_alive(), "the counts wait on a lock no live process can release"
    ((reads_before, steps, reads_after),) = went_on
    (before,), (after,), listed = (
        reads_before.values(),
        reads_after.values(),
        load_manifest(LocalStore(data)).splits["train"].bytes,
    )
    assert steps == len(loader) and after["read_bytes"] >= before["read_bytes"] + listed, "counted on from before"


def test_workers_keep_what_they_inherit_out_of_their_collections(data: str) -> None:
    # Each full collection in a worker walked every object forked from the training process
    # (some 430,000 on a GPU host: 220-340 ms), every worker at about the same step (RESULTS run BE)
    gc.collect()  # (Python 3.12 puts its 375 immortal objects among the frozen at each full collection)
    immortal = gc.get_freeze_count()  # nothing else frozen here: what the workers hold frozen, they froze
    with ShardLoader(data, "train", 8, **OPTIONS, transform=_frozen_objects) as loader:
        counts = torch.cat([b.images for b in loader]).flatten().unique()
    assert len(counts) and bool((counts > immortal + 1000).all()), counts
    assert gc.get_freeze_count() == immortal, "the training process's collector as it was"


def test_your_own_transforms_with_torchvision_v2(data: str) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    crop = v2.Compose([
        v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ])  # fmt: skip
    with ShardLoader(data, "train", 8, **OPTIONS, transform=crop) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) and {k for b in batches for k in b.keys} == ALL, "every sample, once"
    images = torch.cat([b.images for b in batches])
    assert images.shape == (64, 3, 24, 24) and images.dtype == torch.float32
    assert images.min() > -2.2 and images.max() < 2.7, "normalised once, by the transform (not again)"
    with ShardLoader(data, "train", 8, **OPTIONS, transform=_sevens) as loader:
        assert bool((next(iter(loader)).images == 7).all()), "a float tensor is taken as it is"
    with ShardLoader(data, "val", 4, **OPTIONS, transform=_solid_red) as loader:  # a PIL image: as the loader's own
        pixel = next(iter(loader)).images[0, :, 0, 0]
    assert pixel.tolist() == pytest.approx([(c - m) / s for c, m, s in zip((1, 0, 0), mean, std, strict=True)])
    # on the device batch, any decode
    with ShardLoader(data, "train", 8, **OPTIONS, batch_transform=v2.RandomErasing(p=1.0, value=0)) as loader:
        erased = next(iter(loader)).images
    assert erased.shape == (8, 3, 32, 32) and bool((erased == 0).any())


@pytest.mark.parametrize(
    ("transform", "says"),
    [
        (_raising, r"the transform _raising raised on sample 'train-\d+-\d+': ValueError: no crop of \d+×\d+$"),
        (
            _as_big_as_given,
            r"samples 'train-\d+-\d+' and 'train-\d+-\d+' of a batch are torch.uint8 \(\d+, \d+, 3\)",
        ),
        (
            _a_number,
            r"the transform _a_number gave int for sample 'train-\d+-\d+': return a PIL image, or a uint8 or float",
        ),
        (_sixteen_bits, r"_sixteen_bits gave a torch.int16 tensor of shape \(3, 8, 8\) for sample 'train-\d+-\d+'"),
        (_unprintable, r"_unprintable raised on sample 'train-\d+-\d+': RuntimeError: \(its message cannot be shown"),
        (_quoting_ours, r"_quoting_ours raised on sample 'train-\d+-\d+': RuntimeError: imagenet_ais.loader.failures"),
        (_exits, r"the transform _exits raised on sample 'train-\d+-\d+': SystemExit: 3$"),
        (_interrupted, r"the transform _interrupted raised on sample 'train-\d+-\d+': KeyboardInterrupt$"),
    ],
    ids=["raises", "sizes", "kind", "dtype", "unprintable", "quoting", "exits", "interrupted"],
)
def test_a_transform_that_fails_names_the_sample_in_one_line(transform, says: str, data: str) -> None:
    with (
        ShardLoader(data, "train", 8, **OPTIONS, transform=transform) as loader,
        pytest.raises(TransformFailed, match=says) as raised,
    ):
        next(iter(loader))
    assert "\n" not in str(raised.value)
    if transform is not _as_big_as_given:  # (a batch's samples come from several shards)
        assert re.match(rf"{re.escape(data)}/imagenet-train-\d+\.tar: the transform _", str(raised.value))


@pytest.mark.parametrize(
    ("batch_transform", "says"),
    [
        (_ninth, r"_ninth raised on the batch of 'train-\d+-\d+' and 7 more: IndexError: index 8 is out"),
        # each was handed out as it came
        (_nothing, r"_nothing gave NoneType for the batch of 'train-\d+-\d+' and 7 more: return a float tensor"),
        (_as_a_list, r"_as_a_list gave list for the batch of 'train-\d+-\d+' and 7 more: return a float tensor"),
        (_one_dropped, r"_one_dropped gave a torch.float32 tensor of shape \(7, 3, 32, 32\) for .* its 8 images"),
    ],
    ids=["raises", "none", "list", "one-dropped"],
)
def test_a_batch_transform_that_fails_names_the_batch_in_one_line(batch_transform, says: str, data: str) -> None:
    with (
        ShardLoader(data, "train", 8, **OPTIONS, batch_transform=batch_transform) as loader,
        pytest.raises(TransformFailed, match=rf"^{re.escape(data)}: the batch_transform {says}") as raised,
    ):
        next(iter(loader))
    assert "\n" not in str(raised.value)


def test_a_transform_spawned_workers_cannot_be_sent_is_refused_in_one_line(data: str) -> None:
    # the first batch failed with pickle's "Can't pickle local object" from deep inside the DataLoader
    before = mp.get_start_method(allow_none=True)
    mp.set_start_method("spawn", force=True)
    try:
        says = r"^transform=.*<lambda> cannot be sent to the DataLoader workers \('spawn'.*module-level function"
        with pytest.raises(ConfigError, match=says):
            ShardLoader(data, "train", 8, **OPTIONS, transform=lambda img: _sevens(img))
        ShardLoader(data, "train", 8, **OPTIONS, transform=_sevens).close()  # a module-level function can be
    finally:
        mp.set_start_method(before, force=True)


def test_a_transform_that_changes_directory_leaves_every_sample_readable(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(data).parent)
    with ShardLoader(Path(data).name, "train", 8, **OPTIONS, transform=_moves_away) as loader:
        monkeypatch.chdir(tmp_path)  # the caller's own, after the loader was made
        keys = [key for batch in loader for key in batch.keys]
        assert loader.counters()["unread"] == 0
    assert Counter(keys) == Counter(ALL), "every sample once (40 of 64 were unread)"


def test_a_shard_lost_during_an_exact_epoch_is_named_with_the_samples_padded(data: str, tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(data, copy)
    with ShardLoader(str(copy), "train", 8, **OPTIONS) as loader:
        (copy / "imagenet-train-000002.tar").unlink()  # its 7 samples, after the loader was made
        with pytest.warns(UserWarning) as said:
            keys = [key for batch in loader for key in batch.keys]
        assert loader.counters()["padded"] == 7
    assert len(keys) == 64 and len(set(keys)) == 57
    lines = [str(w.message) for w in said if "padded" in str(w.message)]
    assert len(lines) == 1, "said once"
    where = re.escape(str(copy))
    says = rf"^{where}: epoch 1 was padded with 7 repeats .* 7 of {where}/imagenet-train-000002\.tar"
    assert re.search(says, lines[0]) and "\n" not in lines[0]
    with ShardLoader(str(copy), "train", 8, **OPTIONS) as loader, warnings.catch_warnings():
        warnings.simplefilter("error")  # a caller that takes the problems names them (train.py): no warning
        problems = loader.problems
        assert len(list(loader)) == 8
        assert "imagenet-train-000002.tar: could not be read" in problems.get(timeout=30)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (
            {"transform": _sevens, "decode": "gpu"},
            "transform= runs in the workers on PIL images, not with decode='gpu'",
        ),
        ({"transform": _sevens, "augment": Augment("ra")}, "transform= replaces the loader's crop, flip and augment"),
        ({"transform": "v2.RandomResizedCrop(24)"}, "transform='v2.RandomResizedCrop(24)': give a callable"),
        ({"batch_transform": 3}, "batch_transform=3: give a callable"),
    ],
)
def test_transforms_a_loader_cannot_use_are_one_line(given: dict, says: str, data: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        ShardLoader(data, "train", 8, **{**OPTIONS, **given})


def test_a_state_of_other_shards_or_seed_starts_its_epoch_over(data: str) -> None:
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        train_steps(loader, tiny_model(), steps=2)
        state = loader.state_dict()
    with ShardLoader(data, "train", 8, **OPTIONS, seed=1) as loader:
        # in the library's words as well as train.py's (it said "another --seed" only)
        says = r"epoch 1 stopped at step 2 of 8 on 1 × 8 over other shards or with another seed \(ShardLoader's seed="
        with pytest.raises(StateMismatch, match=says):
            loader.load_state_dict(state)
        assert Counter(train_steps(loader, tiny_model())) == Counter(ALL), "the epoch whole, from its start"


@pytest.fixture(scope="module")
def stopped(data: str) -> dict:
    """A state 2 steps into an exact epoch."""
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        train_steps(loader, tiny_model(), steps=2)
        return loader.state_dict()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda s: s.update(version=99), "a ShardLoader state of version 99: this loader reads 1"),
        (lambda s: s.update(epoch=-5), "whose epoch is -5: not a whole number, 0 or more"),
        (lambda s: s.pop("plan"), "not a ShardLoader state: no 'plan' in it"),
        (lambda s: s["position"]["delivered"].update({0: [3, 36]}), "samples of shard 0 it does not hold (20)"),
        (lambda s: s["position"]["delivered"].update({0: [-1]}), "samples of shard 0 it does not hold"),
        (lambda s: s["position"]["delivered"].update({0: ["a"]}), "samples of shard 0 it does not hold"),
        (lambda s: s["position"]["delivered"].update({9: [1]}), "naming shard 9: these shards are 0 to 3"),
    ],
)
def test_a_state_that_cannot_be_one_is_one_line(edit, says: str, stopped: dict, data: str) -> None:
    # each was taken: out of range, 36 of 48 samples never trained; version 99 and epoch -5 silently
    state = {**stopped, "position": {**stopped["position"], "delivered": dict(stopped["position"]["delivered"])}}
    edit(state)
    with ShardLoader(data, "train", 8, **OPTIONS) as loader:
        with pytest.raises(DataError, match=re.escape(says)):
            loader.load_state_dict(state)
        with pytest.raises(DataError, match="a ShardLoader state is a dict"):
            loader.load_state_dict([state])  # type: ignore[arg-type]


def test_a_state_over_shards_converted_again_starts_its_epoch_over(stopped: dict, data: str, tmp_path: Path) -> None:
    # the same names and counts (another --seed's conversion): 8 samples trained twice, 8 never
    again = tmp_path / "again"
    shutil.copytree(data, again)
    manifest = load_manifest(LocalStore(str(again)))
    shard = manifest.splits["train"].shards[0]
    with (again / shard.name).open("ab") as f:
        f.write(bytes(1024))  # other bytes, the same samples (zero blocks past a tar's end)
    shard.bytes, shard.sha256 = shard.bytes + 1024, hashlib.sha256((again / shard.name).read_bytes()).hexdigest()
    (again / "manifest.json").write_text(manifest.to_json())
    with ShardLoader(str(again), "train", 8, **OPTIONS) as loader:
        with pytest.raises(StateMismatch, match=r"epoch 1 stopped at step 2 .* other bytes"):
            loader.load_state_dict(stopped)
        assert Counter(train_steps(loader, tiny_model())) == Counter(ALL), "the epoch whole, from its start"


def test_a_worker_that_stops_ends_the_wait_in_one_line(data: str) -> None:
    # one stopped worker (SIGSTOP) left the loop waiting for ever, with no word
    with ShardLoader(data, "train", 8, **{**OPTIONS, "workers": 1}, data_timeout=3) as loader:
        batches = iter(loader)
        next(batches)
        (worker,) = [p for p in mp.active_children() if p.daemon]  # (the DataLoader worker)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(Stalled, match=r"no batch came from the loader's workers for 3 s .* --resume auto"):
                for _ in batches:  # (those made before it stopped come first)
                    pass
            assert time.monotonic() - start < 30
        finally:
            os.kill(worker.pid, signal.SIGCONT)


def test_a_rank_of_several_without_a_process_group_cannot_save_mid_epoch(data: str) -> None:
    # it said world size 2 but held only this rank's samples
    with ShardLoader(data, "train", 8, rank=0, world_size=2, **OPTIONS) as loader:
        train_steps(loader, tiny_model(), steps=1)
        with pytest.raises(ConfigError, match=r"state_dict\(\) of rank 0 of 2 mid-epoch: .* init_process_group"):
            loader.state_dict()


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"location": 123}, "location=123: give a shard location"),
        ({"manifest": "x"}, "manifest='x': give a Manifest"),
        ({"batch_size": "4"}, "batch_size='4': give a whole number, 1 or more"),
        ({"image_size": 0}, "image_size=0: give a whole number, 8 to 2048"),
        ({"image_size": -8}, "image_size=-8: give a whole number, 8 to 2048"),  # iterating spun with no batch
        ({"image_size": 30000}, "image_size=30000: give a whole number, 8 to 2048"),  # MemoryError in a worker
        ({"epoch_size": 0}, "epoch_size=0: give a whole number, 1 or more"),  # trained a full epoch
        ({"epoch_size": -10}, "epoch_size=-10: give a whole number, 1 or more"),
        ({"workers": 1.5}, "workers=1.5: give a whole number of DataLoader workers"),
        ({"workers": 99999}, "workers=99999: give a whole number of DataLoader workers, 0 to"),
        ({"augment": "ra"}, "augment='ra': give an Augment"),
        ({"rank": 1}, "rank=1, world_size=None: give both, or neither"),  # ran as rank 0 of 1
        ({"device": "gpu9"}, "device='gpu9':"),
        ({"classes": ["c0", "c1", "c2", "c3", "c1"]}, "classes= names 'c1' more than once"),  # 5 outputs for 4
    ],
)
def test_arguments_a_loader_cannot_work_with_are_one_line(given: dict, says: str, data: str) -> None:
    arguments = {"location": data, "split": "train", "batch_size": 8, **OPTIONS, **given}
    with pytest.raises(ConfigError, match=re.escape(says)):
        ShardLoader(**arguments)


def test_validation_reads_every_sample_once_and_wrong_settings_are_one_line(data: str, monkeypatch) -> None:
    with ShardLoader(data, "val", 4, **OPTIONS) as loader:
        keys = [key for _, _, batch in loader for key in batch]
        assert sorted(keys) == sorted(f"val-{s}-{i}" for s, n in enumerate([5, 6]) for i in range(n))
        assert loader.state_dict() == {}
        with pytest.raises(TypeError):
            len(loader)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, before the caller's init_process_group
    with pytest.raises(ConfigError, match=r"WORLD_SIZE is 2 but torch\.distributed is not initialised"):
        ShardLoader(data, "train", 8, **OPTIONS)
    with pytest.raises(ConfigError, match="rank 2 of world size 2"):
        ShardLoader(data, "train", 8, rank=2, world_size=2, **OPTIONS)
    with pytest.raises(ConfigError, match="epoch mode 'exactly'"):
        ShardLoader(data, "train", 8, rank=0, world_size=1, **{**OPTIONS, "epoch_mode": "exactly"})


def test_cuda_left_at_its_default_work_queues_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # ShardLoader warns with this on a GPU: the decode's kernels would wait behind the step's
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS is 8: the GPU decode" in str(few_queues())
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as some model-parallel recipes set it
    assert "is 1:" in str(few_queues())
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert few_queues() is None


def test_lightning_resumes_mid_epoch_with_each_sample_of_the_epoch_once(data: str, tmp_path: Path) -> None:
    import lightning.pytorch as pl  # (5 s of import: only here)

    trained: list[list[str]] = []  # each fit's keys, by epoch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()

        def training_step(self, batch: tuple, _: int) -> torch.Tensor:
            images, labels, keys = batch
            while len(trained[-1]) <= self.current_epoch:
                trained[-1].append([])
            trained[-1][self.current_epoch] += keys
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> ShardLoader:
            return ShardLoader(data, "train", 8, **OPTIONS)

    def fit(ckpt_path: Path | None = None, **options: object) -> None:
        trained.append([])
        checkpoints = pl.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=5, save_top_k=-1)
        trainer = pl.Trainer(
            max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[checkpoints], **options,  # type: ignore[arg-type]
        )  # fmt: skip
        trainer.fit(Module(), datamodule=Data(), ckpt_path=ckpt_path)

    fit(max_steps=5)  # stopped after 5 of epoch 1's 8 steps, as a preempted job (its checkpoint at step 5)
    (saved,) = tmp_path.glob("*.ckpt")
    loop = torch.load(saved, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert loop["combined_loader"][0]["step"] == 5, "Lightning keeps the loader's state in its checkpoint"
    fit(ckpt_path=saved)
    (before,), (after, second) = trained
    assert len(before) == 40 and len(after) == 24, "the rest of epoch 1, not its start again"
    assert Counter(before + after) == Counter(ALL) and Counter(second) == Counter(ALL), "each sample once an epoch"
    assert second != before + after, "epoch 2 in another order"


def test_a_closed_loader_and_a_finished_run_leave_no_worker_behind(data: str, tmp_path: Path) -> None:
    from imagenet_ais.train import loop
    from imagenet_ais.train.config import TrainConfig

    before = set(mp.active_children())
    loader = ShardLoader(data, "train", 8, **OPTIONS)
    next(iter(loader))  # its workers started, and prefetching
    assert len(set(mp.active_children()) - before) == 2
    loader.close()
    assert set(mp.active_children()) <= before, "killed: nothing of theirs outlives them"
    cfg = TrainConfig(
        data=data, output=str(tmp_path / "run"), arch=TINY_ARCH, image_size=32, batch_size=8, epochs=1, workers=2,
        warmup_epochs=0, epoch_mode="exact",
    )  # fmt: skip
    assert loop.train(cfg)["exit_code"] == 0, "the killed workers are no crash to torch's SIGCHLD handler"
    assert set(mp.active_children()) <= before, "a run in someone else's program ends its loaders' workers"
