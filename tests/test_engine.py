"""The data pipeline on real tar shards with real DataLoader worker processes."""

from __future__ import annotations

import gc
import io
import itertools
import math
import multiprocessing.heap
import os
import pickle
import queue
import random
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import ROOT, child_pids, ended_as_dropped, outliving, relist, sparse_member, tiny_jpeg, write_shards
from PIL import Image

from imagenet_ais.loader.engine import Feeding, TrainLoader, ValLoader
from imagenet_ais.loader.failures import UnreadableData, WorkerDied
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.loader.sampling import contiguous_assignment, exact_assignment, split_among_workers
from imagenet_ais.loader.transforms import decode_on_cpu
from imagenet_ais.loader.worker import LoaderSpec
from imagenet_ais.shards import convert, synth
from imagenet_ais.shards.manifest import Manifest, load_manifest
from imagenet_ais.storage import open_store

UNEVEN = [3, 11, 7, 19, 8]  # 48 samples in 5 shards of unequal sizes


def spec(rank: int, world: int, batch: int, size: int = 32, decode: str = "cpu") -> LoaderSpec:
    return LoaderSpec(world, rank, batch, seed=7, image_size=size, decode=decode)


def loaders(
    root: Path, manifest: Manifest, mode: str, world: int, batch: int, workers: int, decode: str = "cpu"
) -> list[TrainLoader]:
    split = manifest.split("train")
    specs = [spec(r, world, batch, decode=decode) for r in range(world)]
    return [TrainLoader(one_source(split, str(root)), mode, s, Feeding(workers), 16) for s in specs]


@pytest.mark.parametrize(("world", "batch"), [(1, 5), (2, 4), (3, 4), (4, 2), (8, 1)])
def test_exact_assignment_is_balanced_disjoint_and_reshuffled(world: int, batch: int) -> None:
    total = sum(UNEVEN)
    orders = []
    for epoch in range(4):
        ranks, steps = exact_assignment(UNEVEN, world, batch, seed=1, epoch=epoch)
        assert steps == total // (world * batch)
        assert [sum(p.stop - p.start for p in r) for r in ranks] == [steps * batch] * world
        covered = Counter((p.shard, i) for r in ranks for p in r for i in range(p.start, p.stop))
        assert max(covered.values()) == 1
        assert total - len(covered) == total % (world * batch) < world * batch
        orders.append(tuple(p.shard for r in ranks for p in r))
    assert len(set(orders)) > 1, "the shard order must change from epoch to epoch"


def test_exact_assignment_refuses_less_than_one_global_batch() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        exact_assignment([3, 4], world=2, batch=4, seed=0, epoch=0)


def test_validation_assignment_covers_every_sample_once() -> None:
    for world in (1, 2, 3, 7, 64):
        ranks = contiguous_assignment(UNEVEN, world)
        sizes = [sum(p.stop - p.start for p in r) for r in ranks]
        assert sum(sizes) == sum(UNEVEN) and max(sizes) - min(sizes) <= 1
        covered = Counter((p.shard, i) for r in ranks for p in r for i in range(p.start, p.stop))
        assert len(covered) == sum(UNEVEN) and max(covered.values()) == 1


def test_fewer_pieces_than_workers_leaves_workers_idle() -> None:
    ranks = contiguous_assignment([10], 1)
    assert [len(w) for w in split_among_workers(ranks[0], 4)] == [1, 0, 0, 0]


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_exact_mode_two_ranks_see_every_key_once_per_epoch(decode: str, tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": UNEVEN})
    ranks = loaders(tmp_path, manifest, "exact", world=2, batch=4, workers=2, decode=decode)
    assert [len(r) for r in ranks] == [6, 6]
    epochs = []
    for epoch in range(2):
        keys: list[str] = []
        for loader in ranks:
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == 6
            for images, labels, batch_keys in batches:
                assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
                assert images.mean().abs() < 3 and labels.shape == (4,)  # normalised
                # each picture is one colour, red = 40 × its class: rows, labels and keys agree
                red = images[:, 0].mean((1, 2)) * 0.229 * 255 + 0.485 * 255
                assert ((red - 40 * labels).abs() < 10).all(), (red, labels)
                keys += batch_keys
        assert sorted(keys) == sorted(f"train-{s}-{i}" for s, n in enumerate(UNEVEN) for i in range(n))
        epochs.append(keys)
    assert epochs[0] != epochs[1]


def test_resampled_mode_has_nominal_length_and_full_batches(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": UNEVEN})
    ranks = loaders(tmp_path, manifest, "resampled", world=3, batch=5, workers=2)
    for loader in ranks:
        assert len(loader) == math.ceil(48 / 15)
        loader.set_epoch(0)
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(len(b.keys) == 5 for b in batches)
    rank0 = [k for b in list(ranks[0]) for k in b.keys]
    rank1 = [k for b in list(ranks[1]) for k in b.keys]
    assert rank0 != rank1, "ranks must not read the same stream"


def test_epoch_size_sets_a_resampled_epochs_length_and_exact_mode_refuses_it(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": UNEVEN})
    split = manifest.split("train")
    ranks = [
        TrainLoader(one_source(split, str(tmp_path)), "resampled", spec(r, 2, 5), Feeding(2), 16, epoch_size=100)
        for r in (0, 1)
    ]
    for loader in ranks:
        assert len(loader) == 10  # 100 samples over 2 ranks × 5, though the manifest lists 48
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert [len(b.keys) for b in loader] == [5] * 10
    with pytest.raises(ValueError, match=r"--epoch-size 100 with --epoch-mode exact: .* once \(48\)"):
        TrainLoader(one_source(split, str(tmp_path)), "exact", spec(0, 1, 5), Feeding(0), 16, epoch_size=100)


def test_a_resampled_epoch_of_which_nothing_decodes_ends_in_one_line(tmp_path: Path) -> None:
    # it trained on nothing, with no word, for ever (SIGTERM then said "stopped at step 0")
    manifest = write_shards(
        tmp_path, {"train": [600, 600]}, corrupt={f"train-{s}-{i}" for s in (0, 1) for i in range(600)}
    )
    (loader,) = loaders(tmp_path, manifest, "resampled", world=1, batch=8, workers=1)
    loader.set_epoch(0)
    with pytest.raises(UnreadableData, match=r"none of the last 1000 samples a loader worker read could be decoded"):
        next(iter(loader))
    assert str(tmp_path) in str(loader.signals.problems.get(timeout=10))


def test_corrupt_samples_are_skipped_counted_and_steps_kept(tmp_path: Path) -> None:
    bad = {"train-1-0", "train-1-5", "train-3-2"}
    manifest = write_shards(tmp_path, {"train": UNEVEN}, corrupt=bad)
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=8, workers=2)
    loader.set_epoch(0)
    keys = [k for b in loader for k in b.keys]
    assert len(keys) == 48  # 6 full batches: 3 slots padded with repeats
    assert not bad & set(keys)
    assert loader.signals.skipped.value == 3
    assert loader.padded == 3


def test_truncated_shard_is_reported_and_the_epoch_completes(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": UNEVEN})
    shard = tmp_path / "imagenet-train-000003.tar"
    shard.write_bytes(shard.read_bytes()[:6000])
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=8, workers=1)
    loader.set_epoch(0)
    assert len(list(loader)) == 6
    assert loader.signals.read_errors.value == 1
    assert loader.padded > 0


def test_a_member_that_is_no_regular_file_or_too_large_is_refused_unread(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": UNEVEN})
    # a header declaring 65 MiB of holes, stored in 512 bytes (one of 3 GiB took a worker to 3.6 GB)
    bad = {1: sparse_member("big.jpg", 65 * 2**20), 3: tar_member("huge.jpg", 65 * 2**20)}
    bad[4] = tar_member("k\udcff.jpg", 10)  # a name not in UTF-8 (verify passed it, training skipped its sample)
    for shard, member in bad.items():
        path = tmp_path / f"imagenet-train-{shard:06d}.tar"
        path.write_bytes(member + path.read_bytes())
    manifest = relist(tmp_path)  # as a converter's bug might have listed them
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=8, workers=1)
    loader.set_epoch(0)
    assert len(list(loader)) == 6
    assert loader.signals.read_errors.value == 3 and loader.signals.skipped.value == 0
    said = " ".join(loader.signals.problems.get(timeout=10) for _ in range(3))
    assert "member 'big.jpg' is a sparse file, not a regular file" in said
    assert "member 'huge.jpg' declares 68,157,440 bytes, over the 67,108,864 one sample may hold" in said
    assert "member name b'k\\xff.jpg' is not UTF-8, as sample keys must be: rename it" in said


def tar_member(name: str, size: int) -> bytes:
    """A regular member of ``size`` zero bytes, header and data."""
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT) + bytes(size) + bytes(-size % 512)


def test_a_shard_replaced_since_its_manifest_was_written_is_a_read_error_named_once(tmp_path: Path) -> None:
    # replaced under the same name, it was trained on, and the run said "every sample was read as the manifest lists it"
    manifest = write_shards(tmp_path, {"train": UNEVEN, "val": [8]})
    (tmp_path / "imagenet-train-000001.tar").write_bytes((tmp_path / "imagenet-val-000000.tar").read_bytes())
    same_size = tmp_path / "imagenet-train-000003.tar"
    data = bytearray(same_size.read_bytes())
    data[-2000] ^= 0xFF  # inside the last image's bytes: the size stays, the checksum does not
    same_size.write_bytes(bytes(data))
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=8, workers=1)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        keys = [k for b in loader for k in b.keys]
        assert not [k for k in keys if k.startswith("val-")], "nothing of the replacement trained"
    assert loader.signals.read_errors.value == 4  # each bad shard at each epoch
    said = [loader.signals.problems.get(timeout=10) for _ in range(2)]
    replaced = [line for line in said if "imagenet-train-000001.tar" in line]
    assert replaced and re.search(r"could not be read, skipped \(it is [\d,]+ bytes, the manifest lists", replaced[0])
    changed = [line for line in said if "imagenet-train-000003.tar" in line]
    assert changed and "its bytes are not the manifest's" in changed[0] and "19 samples" in changed[0]


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (Path(_Exploit.target),))


def test_pickles_inside_shards_are_never_loaded(tmp_path: Path) -> None:
    _Exploit.target = str(tmp_path / "pwned")
    manifest = write_shards(tmp_path, {"train": [4]})
    with wds.TarWriter(str(tmp_path / "imagenet-train-000000.tar")) as tar:
        for i in range(4):
            tar.write(
                {
                    "__key__": f"k{i}",
                    "jpg": tiny_jpeg(random.Random(i), 1),
                    "cls": b"1",
                    "pyd": pickle.dumps(_Exploit()),
                    "pth": pickle.dumps(_Exploit()),
                }
            )
    manifest = relist(tmp_path)
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=4, workers=0)
    loader.set_epoch(0)
    assert len(list(loader)) == 1
    assert not (tmp_path / "pwned").exists()


def test_validation_two_ranks_cover_the_split_exactly(tmp_path: Path) -> None:
    manifest = write_shards(tmp_path, {"train": [4], "val": [5, 2, 9]})
    split = manifest.split("val")
    keys: list[str] = []
    for rank in range(2):
        for batch in ValLoader(one_source(split, str(tmp_path)), spec(rank, 2, 3), Feeding(2)):
            assert batch.images.shape[1:] == (3, 32, 32)
            keys += batch.keys
    assert sorted(keys) == sorted(f"val-{s}-{i}" for s, n in enumerate([5, 2, 9]) for i in range(n))


def _photo(w: int, h: int) -> bytes:
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pixels = torch.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], dim=-1).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_reduced_scale_decoding_matches_a_full_decode() -> None:
    data = _photo(640, 480)
    # val: the centre crop of a full decode, resized, against the draft-mode path
    full = Image.open(io.BytesIO(data)).convert("RGB")
    side = 480 * 0.875
    box = ((640 - side) / 2, (480 - side) / 2, (640 + side) / 2, (480 + side) / 2)
    expected = torch.from_numpy(np.array(full.resize((56, 56), Image.Resampling.BILINEAR, box=box)))
    got = decode_on_cpu(data, 56, None)
    assert got.shape == (56, 56, 3)
    assert (got.int() - expected.int()).abs().float().mean() < 3.0
    crops = torch.stack([decode_on_cpu(data, 48, random.Random(i)) for i in range(20)])
    assert crops.shape == (20, 48, 48, 3) and crops.float().std() > 10


def test_gray_jpeg_decodes_to_three_channels() -> None:
    buf = io.BytesIO()
    Image.new("L", (200, 150), 128).save(buf, format="JPEG")
    assert decode_on_cpu(buf.getvalue(), 32, random.Random(0)).shape == (32, 32, 3)
    assert decode_on_cpu(buf.getvalue(), 32, None).shape == (32, 32, 3)


def test_a_process_exits_while_its_loader_workers_are_still_busy(tmp_path: Path) -> None:
    # Workers ignore SIGTERM (preemption is the trainer's to handle); exiting with a loader
    # never shut down must still end the process instead of waiting on them forever.
    write_shards(tmp_path, {"train": UNEVEN})
    script = f"""
from imagenet_ais.loader.engine import Feeding, TrainLoader
from imagenet_ais.loader.mixture import one_source
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.storage import open_store
from imagenet_ais.loader.worker import LoaderSpec
split = load_manifest(open_store({str(tmp_path)!r})).split("train")
spec = LoaderSpec(world=1, rank=0, batch=2, seed=0, image_size=32)
batches = iter(TrainLoader(one_source(split, {str(tmp_path)!r}), "resampled", spec, Feeding(2), 4))
next(batches)
print("leaving", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_an_epoch_holds_no_file_descriptor_per_batch(decode: str, tmp_path: Path) -> None:
    """What a batch leaves behind for the epoch (the ids of its samples, for resuming) must not
    keep a shared-memory file open: an ImageNet epoch has thousands of batches."""
    manifest = write_shards(tmp_path, {"train": [150]})
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=1, workers=2, decode=decode)
    loader.set_epoch(0)
    batches = iter(loader)
    next(batches)  # workers up
    before = len(os.listdir("/proc/self/fd"))
    assert sum(1 for _ in batches) == 149
    assert len(os.listdir("/proc/self/fd")) - before < 30
    assert len(loader.position()["delivered"][0]) == 150


@pytest.mark.dali
def test_a_samples_crop_and_flip_follow_seed_epoch_and_key_whatever_the_ranks_workers_or_decoder(
    tmp_path: Path,
) -> None:
    synth.make_tree(tmp_path / "tree", classes=3, train_per_class=10, val_per_class=0, seed=2)  # textured pictures
    convert.convert(tmp_path / "tree", str(tmp_path / "shards"), ["train"], 7, int(1e9), 1, 0)
    split = load_manifest(open_store(str(tmp_path / "shards"))).split("train")

    def images(world: int, workers: int, decode: str, epoch: int = 1) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for rank in range(world):
            loader = TrainLoader(
                one_source(split, str(tmp_path / "shards")),
                "exact",
                spec(rank, world, 2, decode=decode),
                Feeding(workers),
                16,
            )
            loader.set_epoch(epoch)
            for batch, _, keys in loader:
                out.update(zip(keys, batch, strict=True))
        return out

    alone = images(1, 1, "cpu")
    for other in (images(2, 2, "cpu"), images(3, 1, "cpu"), images(4, 2, "cpu")):
        common = alone.keys() & other.keys()  # exact mode leaves out a remainder that depends on the world
        assert len(common) >= 24 and all(torch.equal(alone[k], other[k]) for k in common)
    next_epoch = images(1, 1, "cpu", epoch=2)
    assert sum((alone[k] - next_epoch[k]).abs().mean() > 0.1 for k in alone) > len(alone) // 2, "new crops each epoch"
    for decoder in ("gpu", "dali"):  # the device paths, run on the CPU: same crops, other resamplers (DALI last)
        on_device = images(2, 1, decoder)
        common = alone.keys() & on_device.keys()
        assert len(common) >= 24
        assert max((alone[k] - on_device[k]).abs().mean() for k in common) < 0.1, decoder


def test_a_killed_worker_ends_the_epoch_in_one_line(tmp_path: Path) -> None:
    # torch's RuntimeError traceback ended the run (the OOM killer kills workers first)
    manifest = write_shards(tmp_path, {"train": [40] * 4})
    (loader,) = loaders(tmp_path, manifest, "resampled", world=1, batch=2, workers=2)
    loader.set_epoch(0)
    before = child_pids(os.getpid())
    batches = iter(loader)
    next(batches)
    workers = child_pids(os.getpid()) - before
    assert len(workers) == 2
    os.kill(min(workers), signal.SIGKILL)
    with pytest.raises(WorkerDied) as e:
        for _ in batches:
            pass
    assert re.fullmatch(
        rf"{tmp_path}: DataLoader worker \(pid\(s\) {min(workers)}\) exited unexpectedly \(killed\? the OOM killer "
        r"says so in dmesg\): lower --workers or --batch-size and continue with --resume auto",
        str(e.value),
    )


def test_a_process_that_never_reads_its_loaders_problems_still_exits() -> None:
    # more lines than the queue's pipe holds (64 KiB), put by the training process itself (the
    # decode stage names samples so) into a queue only it reads, and never drained (a library
    # user's loop): its sending thread waits on the full pipe, and the exit waited on it for ever
    code = (
        "from imagenet_ais.loader.signals import Signals\n"
        "signals = Signals(32)\n"
        "for i in range(1000):\n"
        "    signals.problems.put(f'sample {i}: ' + 'x' * 300)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_forked_child_that_collects_a_loader_leaves_its_workers_alone(tmp_path: Path) -> None:
    # a child forked from the training process (a library user's own, one of torch's) inherits
    # the loader but not its workers: collecting it there must not kill them
    dropped, workers = _with_workers(tmp_path)
    child = os.fork()
    if child == 0:  # its last reference goes (and a collection, for a cycle that would hold it)
        dropped.clear()
        gc.collect()
        os._exit(0)
    deadline = time.monotonic() + 30
    while os.waitpid(child, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if outliving({child}, 0):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child's collection did not end in 30 s")
    time.sleep(0.5)  # (a kill would have made zombies of them by now)
    assert outliving(workers, 0) == workers
    dropped[0].shut_down()
    assert not workers & child_pids(os.getpid())


def test_a_sample_the_devices_decoder_failed_and_libjpeg_decoded_is_named_once_and_trained(tmp_path: Path) -> None:
    # (on CUDA, device_decode._decode_one: torchvision's nvJPEG reports a device out of memory as
    # it does a broken JPEG; libjpeg decodes the sample instead, and the run is told, once)
    manifest = write_shards(tmp_path, {"train": [20]})
    (loader,) = loaders(tmp_path, manifest, "exact", world=1, batch=4, workers=0, decode="gpu")
    loader.set_epoch(0)
    error = "Error while decoding JPEG images: CUDA out of memory. Tried to allocate 20.00 MiB"
    named = []
    for batch in itertools.islice(loader.host_batches(), 2):
        decoded, _ = loader.to_device.decode([batch])[0]
        got, kept = loader.to_device._replaced(decoded._replace(rescued=(1, error)), batch)
        assert got.rows is None and kept.keys == batch.keys  # trained, not replaced
        named.append(batch.keys[1])
    problem = loader.signals.problems.get(timeout=5)
    assert problem == (
        f"nvJPEG: could not decode sample {named[0]!r} ({error}); libjpeg decoded it on the CPU, as it will any "
        "more nvJPEG fails (slower; not named again)"
    )
    with pytest.raises(queue.Empty):
        loader.signals.problems.get(timeout=0.5)
    assert loader.counters()["skipped"] == 0


def test_a_loader_dropped_between_epochs_ends_its_workers_at_once(tmp_path: Path) -> None:
    # not at some later collection, in whatever thread, lock or signal handler that runs in: a
    # closed feed lets go of the loader's batch generator, which held the loader in a cycle
    ended_as_dropped(*_with_workers(tmp_path))


def test_a_loader_collected_where_multiprocessings_heap_is_locked_ends_its_workers(tmp_path: Path) -> None:
    # A collection runs a dropped loader's __del__ in whichever thread allocates at the time,
    # inside multiprocessing's heap lock too (in mp.Value's malloc; the lock is not re-entrant):
    # a __del__ that made a new shared counter there waited for ever (a suite's test hung 600 s)
    dropped, workers = _with_workers(tmp_path)
    # its last reference goes (and a collection, for a cycle that would hold it): __del__ runs there
    drop = threading.Thread(target=lambda: (dropped.clear(), gc.collect()), daemon=True)
    with multiprocessing.heap.BufferWrapper._heap._lock:  # type: ignore[attr-defined]
        drop.start()
        drop.join(30)
        assert not drop.is_alive(), "the loader's __del__ waits on multiprocessing's heap lock"
    assert not workers & child_pids(os.getpid())


def _with_workers(tmp_path: Path) -> tuple[list[TrainLoader], set[int]]:
    """A loader of 2 workers, held alone in a list, one batch into its first epoch (the iterator
    gone; the workers stay, for the next epoch), and its workers' PIDs."""
    manifest = write_shards(tmp_path, {"train": [40] * 4})
    held = loaders(tmp_path, manifest, "resampled", world=1, batch=2, workers=2)
    held[0].set_epoch(0)
    before = child_pids(os.getpid())
    next(iter(held[0]))
    workers = child_pids(os.getpid()) - before
    assert len(workers) == 2
    return held, workers
