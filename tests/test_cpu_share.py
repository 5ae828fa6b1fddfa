"""Training crops made in the DataLoader workers (cpu_share.py): a share of each batch crosses as
pixels after its JPEGs, and the batch on the device is the one the GPU's path alone makes; "auto"
follows the time a worker waits for requests."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_shards
from test_dali_decode import broken_jpeg
from test_transforms import jpeg, photo, pixels
from test_wire import off_the_main_thread

from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.cpu_share import (
    AUTO,
    GAIN,
    HOST_BUSY,
    IDLE,
    LIMIT,
    PAUSE,
    START,
    STEP,
    STEP_WAIT,
    WINDOW,
    CpuShare,
    checked,
    offload,
)
from imagenet_ais.loader.cpu_time import cpu_jiffies, own_cpu_jiffies
from imagenet_ais.loader.engine import Feeding, TrainLoader
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.transforms import encode_for_device
from imagenet_ais.loader.wire import Encoded
from imagenet_ais.loader.worker import LoaderSpec
from imagenet_ais.shards.manifest import SplitInfo

COUNTS = [22, 21, 19]  # 62 samples: 12 batches of 5, the workers' short last ones pooled


def shards(tmp_path: Path, pictures: dict[str, bytes] | None = None) -> SplitInfo:
    keys = [f"train-{s}-{i}" for s, n in enumerate(COUNTS) for i in range(n)]
    photos = {k: jpeg(photo(90 + i % 40, 70 + i % 30, seed=i)) for i, k in enumerate(keys)}
    return write_shards(tmp_path, {"train": COUNTS}, pictures=photos | (pictures or {})).split("train")


def epoch(split: SplitInfo, root: str, feeding: Feeding, decode: str = "gpu") -> tuple[dict, list[int]]:
    """Each trained sample's image (0-255, as trained) by key, and the samples cropped in the workers per batch."""
    spec = LoaderSpec(1, 0, 5, seed=7, image_size=32, decode=decode)
    loader = TrainLoader(one_source(split, root), "exact", spec, feeding, 16)
    loader.set_epoch(0)
    images, cropped = {}, []
    for batch in loader.host_batches():  # the feed's stages, one after the other
        encoded: Encoded = batch.images  # type: ignore[assignment]
        cropped.append(len(encoded.pixels))
        assert len(encoded.sizes) + len(encoded.pixels) == len(batch.keys) == 5
        on = loader.to_device
        decoded, batch = on.dali_decode(batch) if decode == "dali" else on.decode([batch])[0]
        out, _ = on.crop((decoded, batch))
        images.update(zip(out.keys, pixels(out.images), strict=True))
    loader.shut_down()
    assert loader.counters()["cropped"] == sum(cropped)
    return images, cropped


def assert_same_training(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and len(got) == 60  # the exact epoch's samples, each once
    # resampled by PIL instead of roi_align: 1.3 levels apart on average here, 5.5 at most; a
    # sample flipped the other way is 52 apart at the median
    diff = torch.stack([(got[k] - expected[k]).abs().mean() for k in expected])
    assert diff.mean() < 2.0 and diff.max() < 8.0, diff


@off_the_main_thread
@pytest.mark.parametrize("shared", [True, False], ids=["in-the-workers-buffers", "in-blocks-of-their-own"])
def test_half_the_samples_cropped_in_the_workers_train_as_the_gpu_path_would(tmp_path: Path, shared: bool) -> None:
    split = shards(tmp_path)
    expected, none = epoch(split, str(tmp_path), Feeding(2, shared_buffers=shared, cpu_share=0.0))
    got, cropped = epoch(split, str(tmp_path), Feeding(2, shared_buffers=shared, cpu_share=0.5))
    assert sum(none) == 0
    assert 25 <= sum(cropped) <= 31 and any(0 < c < 5 for c in cropped), cropped  # each worker's every other
    assert_same_training(got, expected)


@off_the_main_thread
def test_an_epoch_all_cropped_in_the_workers_trains_the_same(tmp_path: Path) -> None:
    split = shards(tmp_path)
    expected, _ = epoch(split, str(tmp_path), Feeding(2, cpu_share=0.0))
    got, cropped = epoch(split, str(tmp_path), Feeding(2, cpu_share=1.0))
    assert cropped == [5] * 12  # no JPEG left for the device to decode
    assert_same_training(got, expected)


@pytest.mark.dali
@off_the_main_thread
def test_dali_decodes_the_jpegs_and_the_workers_crops_follow_them(tmp_path: Path) -> None:
    split = shards(tmp_path)
    expected, _ = epoch(split, str(tmp_path), Feeding(2, cpu_share=0.0))
    got, cropped = epoch(split, str(tmp_path), Feeding(2, shared_buffers=True, cpu_share=0.5), decode="dali")
    assert 25 <= sum(cropped) <= 31
    assert_same_training(got, expected)


def test_a_sample_pil_cannot_decode_is_skipped_as_decode_cpu_skips_it() -> None:
    good = encode_for_device(jpeg(photo(120, 100)), None)
    broken = (broken_jpeg(), good[1])
    samples = [((raw, box, []), 0, f"k{i}", 0, i) for i, (raw, box) in enumerate([good, broken, good])]
    cropped, failed = mp.Value("q", 0), []
    out = list(offload(iter(samples), CpuShare(1.0), 16, cropped, lambda s, what: failed.append((s[2], what))))
    assert [s[2] for s in out] == ["k0", "k2"] and cropped.value == 2
    assert all(isinstance(s[0][0], np.ndarray) and s[0][0].shape == (16, 16, 3) for s in out)
    assert len(failed) == 1 and failed[0][0] == "k1" and failed[0][1].startswith("OSError: "), failed


@off_the_main_thread
def test_in_a_loader_such_a_sample_is_named_with_its_shard_and_counted_as_skipped(tmp_path: Path) -> None:
    split = shards(tmp_path, pictures={"train-1-4": broken_jpeg()})
    spec = LoaderSpec(1, 0, 5, seed=7, image_size=32, decode="gpu")
    loader = TrainLoader(one_source(split, str(tmp_path)), "exact", spec, Feeding(2, cpu_share=1.0), 16)
    loader.set_epoch(0)
    keys = [k for batch in loader.host_batches() for k in batch.keys]
    assert len(keys) == 60 and "train-1-4" not in keys  # the exact epoch's 12 batches, of the 61 others
    problem = loader.signals.problems.get(timeout=5)
    assert problem.startswith(f"{tmp_path}/imagenet-train-000001.tar: sample 'train-1-4' skipped (OSError: ")
    assert loader.counters()["skipped"] == 1
    loader.shut_down()


class Cores:
    """The job's cores' (busy, all) time, advanced by each reading: ``busy`` of it busy."""

    def __init__(self, busy: float) -> None:
        self.busy, self.now = busy, (0, 0)

    def __call__(self) -> tuple[int, int]:
        self.now = (self.now[0] + round(100 * self.busy), self.now[1] + 100)
        return self.now


def test_auto_takes_more_while_a_worker_waits_and_gives_back_while_it_is_late() -> None:
    share = CpuShare(AUTO, Cores(busy=0.5))  # no crop timed yet: it moves by GAIN
    assert share.share == START and not share.take()
    share.observe(0.3, 0.3)  # not a whole window yet
    assert share.share == START
    share.observe(0.0, 0.4)  # a window: waited 0.7 of it
    assert share.share == pytest.approx(START + GAIN * (0.7 - IDLE))
    for _ in range(20):
        share.observe(0.2, 0.8)
    assert share.share == LIMIT
    share.observe(1.0, 0.0)  # late: no wait at all
    assert share.share == pytest.approx(LIMIT - GAIN * IDLE)
    for _ in range(20):
        share.observe(1.0, 0.0)
    assert share.share == 0


def test_auto_starts_cropping_at_once() -> None:
    share = CpuShare(AUTO, Cores(busy=0.5))
    assert sum(share.take() for _ in range(round(10 / START))) == 10  # before any window
    assert CpuShare(AUTO, lambda: None).share == START > 0


def window(share: CpuShare, samples: int, cropped: int, crop: float, idle: float) -> None:
    """One window of ``samples``, ``cropped`` of them taking ``crop`` seconds each, the worker
    having waited ``idle`` of WINDOW seconds."""
    busy = (WINDOW + 1e-9 - idle) / samples  # (a hair over: the sum of their parts reaches WINDOW)
    for i in range(samples):
        share.observe(busy, idle / samples, crop if i < cropped else 0.0)


def test_auto_turns_its_spare_time_into_crops_at_what_they_took() -> None:
    share = CpuShare(AUTO, Cores(busy=0.5))
    # 100 samples a window, a crop 10 ms: a share of 1 would take the whole window
    window(share, 100, cropped=5, crop=0.01, idle=IDLE + 0.2)
    assert share.share == pytest.approx(START + STEP * 0.2)
    window(share, 100, cropped=5, crop=0.005, idle=IDLE + 0.1)  # crops twice as cheap: twice as many
    assert share.share == pytest.approx(START + STEP * 0.2 + 2 * STEP * 0.1)
    window(share, 100, cropped=5, crop=0.005, idle=IDLE - 0.1)  # short of time: frees STEP of what it lacked
    assert share.share == pytest.approx(START + STEP * 0.2)
    window(share, 100, cropped=0, crop=0.0, idle=IDLE + 0.1)  # no crop in it: the last cost holds
    assert share.share == pytest.approx(START + STEP * 0.2 + 2 * STEP * 0.1)


def test_a_long_wait_is_a_pause_not_time_to_spare() -> None:
    share = CpuShare(AUTO, Cores(busy=0.5))
    share.observe(0.3, 0.4)
    share.observe(0.0, PAUSE + 1)  # compiling, validating: no change, and the window starts again
    assert share.share == START
    share.observe(0.0, 0.6)  # 0.6 s of the new window: not yet a whole one
    assert share.share == START
    share.observe(0.0, 0.4)
    assert share.share == pytest.approx(START + GAIN * (1 - IDLE))


def test_offload_tells_the_share_how_long_each_crop_took() -> None:
    class Seen(CpuShare):
        def observe(self, busy: float, idle: float, cropping: float = 0.0) -> None:
            seen.append((busy, cropping))

    seen: list[tuple[float, float]] = []
    good = encode_for_device(jpeg(photo(120, 100)), None)
    samples = [((good[0], good[1], []), 0, f"k{i}", 0, i) for i in range(4)]
    list(offload(iter(samples), Seen(0.5), 16, mp.Value("q", 0), lambda s, what: None))
    assert [cropping > 0 for _, cropping in seen] == [False, True, False, True]
    assert all(busy >= cropping for busy, cropping in seen)


def test_auto_gives_back_while_the_hosts_cores_are_taken_even_if_it_waits() -> None:
    cores = Cores(busy=0.5)
    share = CpuShare(AUTO, cores)
    for _ in range(10):
        share.observe(0.2, 0.8)
    assert share.share == LIMIT
    cores.busy = HOST_BUSY + 0.05  # the training process short of CPU: its workers wait all the more
    share.observe(0.0, 1.0)
    assert share.share == pytest.approx(LIMIT - GAIN * IDLE)
    cores.busy = HOST_BUSY - 0.05
    share.observe(0.0, 1.0)
    assert share.share == LIMIT
    assert CpuShare(AUTO, lambda: None).host_busy() == 0  # no /proc/stat: the workers' wait decides alone


def test_auto_gives_back_while_the_training_step_does_not_wait_for_batches() -> None:
    step_wait = mp.Value("d", 0.5, lock=False)  # as the training process sets it (device_feed.DeviceFeed.step_wait)
    share = CpuShare(AUTO, Cores(busy=0.5), step_wait)
    for _ in range(10):
        share.observe(0.2, 0.8)
    assert share.share == LIMIT
    step_wait.value = STEP_WAIT - 0.01  # the feed keeps up: crops here would only take the step's cores
    share.observe(0.0, 1.0)
    assert share.share == pytest.approx(LIMIT - GAIN * IDLE)
    step_wait.value = STEP_WAIT
    share.observe(0.0, 1.0)
    assert share.share == LIMIT


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: its time is the host's")
def test_the_cap_counts_the_cores_this_job_may_run_on() -> None:
    os_cpus = sorted(os.sched_getaffinity(0))
    one, every = cpu_jiffies({os_cpus[0]}), cpu_jiffies()
    assert one and every and one[1] < every[1]  # a core's time, not the host's
    assert own_cpu_jiffies() == pytest.approx(cpu_jiffies(set(os_cpus)), rel=0.01)
    # no such core in /proc/stat (a container numbering its own from 0): all of them
    assert cpu_jiffies({10_000}) == pytest.approx(cpu_jiffies(), rel=0.01)


def test_the_training_steps_wait_reaches_the_workers(tmp_path: Path) -> None:
    spec = LoaderSpec(1, 0, 5, seed=7, image_size=32, decode="gpu")
    loader = TrainLoader(one_source(shards(tmp_path), str(tmp_path)), "exact", spec, Feeding(2, cpu_share=0.5), 16)
    assert loader.dataset.share.step_wait is loader.signals.step_wait  # what the workers read (a copy of it each)
    loader.set_epoch(0)
    for _ in loader:
        time.sleep(0.05)  # a step slower than the feed: the loop hardly waits for its batches
    assert loader.signals.step_wait.value < 0.5
    loader.shut_down()


def test_a_fixed_share_takes_exactly_that_many_and_does_not_move() -> None:
    share = CpuShare(0.25)
    assert sum(share.take() for _ in range(100)) == 25
    share.observe(0.0, 10.0)
    assert share.share == 0.25
    assert not any(CpuShare(0.0).take() for _ in range(100))


def test_the_share_is_auto_on_a_gpu_with_workers_only_and_checked_in_one_line() -> None:
    cuda = torch.device("cuda")
    assert Feeding(2, cuda).share() == AUTO and Feeding(0, cuda).share() == 0.0
    assert Feeding(2).share() == 0.0 and Feeding(2, cpu_share=0.3).share() == 0.3
    assert checked("0.3") == 0.3 and checked(AUTO) == AUTO
    for bad in ("2", "-0.1", "half"):
        with pytest.raises(ConfigError, match=rf"^--cpu-share {bad}: give 'auto' or a share of the samples"):
            checked(bad)
