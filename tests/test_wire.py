"""The workers' shared buffers (wire.py): a training batch's JPEG bytes are read where a real
DataLoader worker wrote them, each buffer is used again once let go, and a batch with no buffer
free or large enough crosses the usual way, never waiting."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import members, write_shards

from imagenet_ais.loader import engine
from imagenet_ais.loader.engine import Feeding, HostBatch, TrainLoader
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.wire import Encoded, Slots
from imagenet_ais.loader.worker import LoaderSpec


def train_loader(tmp_path: Path, samples: int = 150, batch: int = 5) -> TrainLoader:
    manifest = write_shards(tmp_path, {"train": [samples // 3] * 3})
    spec = LoaderSpec(1, 0, batch, seed=7, image_size=32, decode="gpu")
    loader = TrainLoader(
        one_source(manifest.split("train"), str(tmp_path)), "exact", spec, Feeding(2, shared_buffers=True), 16
    )
    loader.set_epoch(0)
    return loader


def stored(root: Path) -> dict[str, bytes]:
    """Each sample's JPEG bytes as its shard holds them."""
    tars = (members(path).items() for path in root.glob("*.tar"))
    return {name.removesuffix(".jpg"): data for tar in tars for name, data in tar if name.endswith(".jpg")}


def jpegs(batch: HostBatch) -> dict[str, bytes]:
    images: Encoded = batch.images  # type: ignore[assignment]
    return {k: bytes(j.numpy()) for k, j in zip(batch.keys, images.blob.split(images.sizes), strict=True)}


def buffer_of(slots: Slots, batch: HostBatch) -> int | None:
    """The buffer a batch's bytes lie in, None where they came the usual way."""
    starts = {b.data_ptr(): i for i, b in enumerate(slots.buffers)}
    return starts.get(batch.images.blob.data_ptr())  # type: ignore[union-attr]


def off_the_main_thread(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` in another thread, as the feed's host thread receives batches: a DataLoader first
    iterated on the main thread installs torch's SIGCHLD handler in the test process, which then
    raises in other tests, those that kill a worker on purpose."""

    @functools.wraps(test)
    def run(*args: object, **kwargs: object) -> None:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(test, *args, **kwargs).result()

    return run


@off_the_main_thread
def test_an_epochs_bytes_are_read_in_the_workers_buffers_and_each_is_used_again(tmp_path: Path) -> None:
    loader = train_loader(tmp_path)
    assert loader.slots is not None and len(loader.slots.buffers) == 2 * 3
    seen: dict[str, bytes] = {}
    used = []
    for batch in loader.host_batches():  # each dropped before the next, as the feed does
        seen.update(jpegs(batch))
        used.append(buffer_of(loader.slots, batch))
    loader.shut_down()
    assert seen == stored(tmp_path)  # every sample once, its bytes as stored
    # 30 batches, most in 6 buffers (one arriving while all 3 of its worker's are taken, two
    # waiting in the DataLoader and one in hand, crosses the usual way: 0-3 of them here)
    through = [u for u in used if u is not None]
    assert len(used) == 30 and len(through) >= 20 and set(through) == set(range(6))
    del batch  # the last one
    gc.collect()
    assert not loader.slots.held.any() and not loader.slots.reading


@off_the_main_thread
def test_batches_held_by_the_consumer_cross_the_usual_way_and_nothing_waits(tmp_path: Path) -> None:
    loader = train_loader(tmp_path)
    assert loader.slots is not None
    kept = list(loader.host_batches())  # every buffer stays taken
    loader.shut_down()
    ways = [buffer_of(loader.slots, batch) for batch in kept]
    assert None in ways and len({w for w in ways if w is not None}) == sum(w is not None for w in ways)
    assert {k: v for batch in kept for k, v in jpegs(batch).items()} == stored(tmp_path)
    assert set(loader.slots.reading) == {w for w in ways if w is not None}
    del kept
    gc.collect()
    assert not loader.slots.held.any() and not loader.slots.reading


@off_the_main_thread
def test_a_batch_larger_than_a_buffer_crosses_the_usual_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.Slots, "for_batches", classmethod(lambda cls, workers, *_: cls(workers, 64)))
    loader = train_loader(tmp_path, samples=30)
    assert loader.slots is not None
    seen = {}
    for batch in loader.host_batches():
        assert buffer_of(loader.slots, batch) is None
        seen.update(jpegs(batch))
    loader.shut_down()
    assert seen == stored(tmp_path) and not loader.slots.held.any()


@off_the_main_thread
def test_workers_ended_midway_leave_only_the_buffers_still_read_taken(tmp_path: Path) -> None:
    """A resumed run ends the workers with batches written but never received: their buffers are
    free again; the one whose batch the training process still holds stays taken until dropped."""
    loader = train_loader(tmp_path)
    assert loader.slots is not None
    batches = loader.host_batches()
    kept = next(batches)
    next(batches)
    batches.close()
    loader.shut_down()
    index = buffer_of(loader.slots, kept)
    assert index is not None
    gc.collect()
    assert loader.slots.held.nonzero().flatten().tolist() == [index]
    del kept
    gc.collect()
    assert not loader.slots.held.any()
    # and the workers started again hand over through the buffers, every sample of the epoch
    assert {k for batch in loader.host_batches() for k in batch.keys} == set(stored(tmp_path))
    loader.shut_down()


def test_only_trainings_jpeg_bytes_from_workers_to_a_gpu_cross_in_buffers(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": [20]})
    split, gpu = manifest.split("train"), LoaderSpec(1, 0, 5, 7, 32, "gpu")
    assert (
        TrainLoader(one_source(split, str(tmp_path)), "exact", gpu, Feeding(2, shared_buffers=True), 16).slots
        is not None
    )
    not_here = [
        TrainLoader(
            one_source(split, str(tmp_path)), "exact", LoaderSpec(1, 0, 5, 7, 32), Feeding(2, shared_buffers=True), 16
        ),
        TrainLoader(one_source(split, str(tmp_path)), "exact", gpu, Feeding(0, shared_buffers=True), 16),  # no workers
        TrainLoader(
            one_source(split, str(tmp_path)), "exact", gpu, Feeding(2), 16
        ),  # not to a GPU: the device path is a test's
        engine.ValLoader(one_source(split, str(tmp_path)), gpu, Feeding(2, shared_buffers=True)),
    ]
    assert all(loader.slots is None for loader in not_here)
