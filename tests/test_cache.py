"""The node-local shard cache and preload, against a real nginx (./run serve) and its access log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    TINY,
    QuietHandler,
    http_server,
    records,
    relist,
    shards_here,
    sparse_member,
    train_here,
    wait_until,
    write_shards,
)
from forked import Started, ranks

from imagenet_ais.loader import ShardLoader
from imagenet_ais.loader.read_cost import ReadCost
from imagenet_ais.loader.signals import Signals
from imagenet_ais.shards.cache import FETCHED, REFETCHED, usage


@pytest.mark.slow
def test_two_ranks_two_workers_fetch_each_shard_once_and_a_bad_copy_again(serve, tmp_path: Path) -> None:
    data, cache = tmp_path / "shards", tmp_path / "cache"
    manifest = write_shards(data, {"train": [9, 14, 7, 12, 10, 8], "val": [6, 5]})
    shards = [s.name for split in manifest.splits.values() for s in split.shards]
    server = serve(data)
    common = ["--data", server.url, *TINY, "--workers", "2", "--cache-dir", cache]

    # cold cache, two epochs: both ranks and all their workers want the shards
    for mode in ("exact", "resampled"):
        ranks(2, *common, "--output", tmp_path / mode, "--epochs", "2", "--epoch-mode", mode)
    gets = server.gets()
    assert {name: gets[name] for name in shards} == dict.fromkeys(shards, 1), "one download each, for all runs"
    # what each epoch cost: every shard fetched whole in the first, then read from the cache
    listed = sum(s.bytes for split in manifest.splits.values() for s in split.shards)
    first, second = epoch_costs(tmp_path / "exact", server.url)
    assert (first["read_bytes"], first["reread_bytes"], second["read_bytes"], second["read_requests"]) == (
        listed,
        0,
        0,
        0,
    )
    assert first["read_requests"] >= len(shards) and second["cache_bytes"] >= listed
    cached = sorted(cache.rglob("imagenet-*.tar"))
    assert [p.name for p in cached] == sorted(shards)
    assert not list(cache.rglob("*.partial"))

    bad = cached[2]
    blob = bytearray(bad.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    bad.write_bytes(bytes(blob))
    out = ranks(2, *common, "--output", tmp_path / "again", "--epochs", "1", "--epoch-mode", "exact")
    assert f"cached {bad} differs from the manifest: fetching it again" in out.stderr
    gets = server.gets()
    assert {name: gets[name] for name in shards} == {name: 1 + (name == bad.name) for name in shards}
    assert bad.read_bytes() == (data / bad.name).read_bytes()
    (again,) = epoch_costs(tmp_path / "again", server.url)
    assert again["read_bytes"] == again["reread_bytes"] == bad.stat().st_size, "the bad copy, fetched again"


@pytest.mark.parametrize(("came_from", "again"), [(FETCHED, 300), (REFETCHED, 1000)])
def test_bytes_read_again_count_once(came_from: str, again: int) -> None:
    """A resumed epoch reads 300 bytes of samples it trained before: read again, unless the whole
    shard is counted so already, its cached copy being bad."""
    signals = Signals(image_size=32)
    cost = ReadCost(signals, 0, lambda: 1)
    cost.fetching(1000)
    cost.opened(came_from, 1000)
    cost.update(1000, 300, 0.01, last=True)
    (counted,) = signals.read_counts()
    assert (counted["read_bytes"], counted["reread_bytes"]) == (1000, again)


def epoch_costs(output: Path, location: str) -> list[dict[str, int]]:
    """What reading ``location`` cost in each epoch of the run in ``output`` (its metrics' epoch records)."""
    return [r["data"][location] for r in records(output, "epoch")]


def test_the_cache_stays_within_its_size_bound(serve, tmp_path: Path) -> None:
    data, cache = tmp_path / "shards", tmp_path / "cache"
    manifest = write_shards(data, {"train": [10] * 8, "val": [6]})
    bound = manifest.splits["train"].bytes // 2
    server = serve(data)
    # someone's own files in the cache folder, older than any shard: not the cache's to evict
    (cache / "mydata").mkdir(parents=True)
    theirs = [cache / "notes.txt", cache / "mydata" / "important.bin"]
    for path in theirs:
        path.write_bytes(os.urandom(bound))
        os.utime(path, (0, 0))
    proc = Started(
        "--data", server.url, "--output", tmp_path / "run", *TINY,
        "--epochs", "3", "--workers", "2", "--cache-dir", cache, "--cache-size", str(bound), merged=True,
    )  # fmt: skip
    largest = 0
    while proc.poll() is None:  # watch the cache while it fills and evicts
        largest = max(largest, usage(cache) if cache.exists() else 0)
        time.sleep(0.005)
    assert proc.returncode == 0, proc.communicate()[0]
    assert 0 < largest <= bound
    assert usage(cache) <= bound
    cached = [f for f in cache.rglob("*") if f.is_file() and f.suffix != ".lock" and f not in theirs]
    assert sum(f.stat().st_size for f in cached) <= bound, "counted here without the cache's own accounting"
    assert sum(server.gets().values()) > len(manifest.splits["train"].shards) + 2, "evicted shards came again"
    assert all(path.stat().st_size == bound for path in theirs), "their files are still there, whole"


def test_a_dataset_converted_again_is_fetched_again_not_read_from_the_cache(serve, tmp_path: Path) -> None:
    data, cache = tmp_path / "shards", tmp_path / "cache"
    sizes = {"train": [8, 8], "val": [4]}
    write_shards(data, sizes)
    server = serve(data)
    common = ["--data", server.url, *TINY, "--workers", "1", "--cache-dir", cache, "--epochs", "1"]
    train_here(*common, "--output", tmp_path / "first")
    write_shards(data, sizes, classes=3)  # converted again: the same names, other pictures and labels
    out = train_here(*common, "--output", tmp_path / "second")
    cached = sorted(cache.rglob("imagenet-*.tar"))
    assert len(cached) == 3
    for copy in cached:
        assert f"cached {copy} differs from the manifest: fetching it again" in out.stderr
        assert copy.read_bytes() == (data / copy.name).read_bytes()


def test_preload_killed_midway_and_rerun_ends_with_a_verified_copy(serve, tmp_path: Path) -> None:
    data, dest = tmp_path / "shards", tmp_path / "local"
    manifest = write_shards(data, {"train": [40] * 6, "val": [20, 20]})
    server = serve(data, SERVE_RATE="200k")
    args = ["imagenet_shards.py", "preload", server.url, dest, "--workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until(proc, lambda: len(list(dest.glob("imagenet-*.tar"))) >= 3, "3 shards preloaded", poll=0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (dest / "manifest.json").exists(), "no manifest: not a dataset yet"
    done = {p.name for p in dest.glob("imagenet-*.tar")}
    for name in done:  # what is under a final name is whole
        assert (dest / name).read_bytes() == (data / name).read_bytes()

    out = shards_here(*args[1:])  # (run again: in this process)
    assert f"{dest}: train: 6 shards, 240 samples" in out.stdout
    assert "all shards match" in shards_here("verify", dest).stdout
    gets = server.gets()
    assert all(gets[name] == 1 for name in done), "what was there already was not fetched again"
    assert not list(dest.glob(".*.partial"))
    shards = sorted(s.name for split in manifest.splits.values() for s in split.shards)
    assert sorted(p.name for p in dest.glob("imagenet-*.tar")) == shards


def test_preload_of_a_split_that_is_not_there_names_the_splits(serve, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    write_shards(data, {"train": [4], "val": [4]})
    server = serve(data)
    out = shards_here("preload", server.url, tmp_path / "x", "--splits", "test", check=False)
    assert out.returncode == 1
    assert out.stderr.strip() == f"Error: {server.url}/manifest.json has no split 'test' (it has train, val)"
    assert not (tmp_path / "x").exists()


def test_preload_judges_each_copys_members_as_training_would(tmp_path: Path) -> None:
    # a shard holding a sparse member declaring 3 GiB was copied without a word (training then refused it)
    src, dest = tmp_path / "src", tmp_path / "dest"
    write_shards(src, {"train": [4, 4]})
    bad = src / "imagenet-train-000001.tar"
    bad.write_bytes(sparse_member("big.jpg", 3 * 2**30) + bad.read_bytes())
    relist(src)  # as a converter's bug might have listed it
    proc = shards_here("preload", src, dest, "--workers", "1", check=False)
    error = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert error.startswith(f"Error: {src}/imagenet-train-000001.tar: member 'big.jpg' is a sparse file, not a regular")
    assert sorted(p.name for p in dest.iterdir()) == ["imagenet-train-000000.tar"], "the bad copy is not kept"


def test_preload_leaves_a_manifest_json_that_is_not_ours_alone(serve, tmp_path: Path) -> None:
    data, dest = tmp_path / "shards", tmp_path / "local"
    write_shards(data, {"train": [4]})
    server = serve(data)
    dest.mkdir()
    (dest / "manifest.json").write_text('{"my": "own"}')
    out = shards_here("preload", server.url, dest, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"Error: {dest}/manifest.json is not a shard manifest (not a imagenet-ais-shards manifest): "
        "preload into another DEST"
    )
    assert (dest / "manifest.json").read_text() == '{"my": "own"}' and not list(dest.glob("*.tar"))


def test_a_shard_in_a_subfolder_of_its_location_is_cached_there(serve, tmp_path: Path) -> None:
    # it trained fine uncached, but the cache's lock file was made beside the subfolder, not in it
    data, cache = tmp_path / "shards", tmp_path / "cache"
    manifest = write_shards(data, {"train": [6, 6], "val": [4]})
    shard = manifest.splits["train"].shards[1]
    (data / "sub").mkdir()
    (data / shard.name).rename(data / "sub" / shard.name)
    shard.name = f"sub/{shard.name}"
    (data / "manifest.json").write_text(manifest.to_json())
    server = serve(data)
    args = ["--data", server.url, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "1"]
    train_here(*args, "--cache-dir", cache)
    cached = next(cache.rglob(shard.name.split("/")[1]))
    assert cached.parent.name == "sub" and cached.read_bytes() == (data / shard.name).read_bytes()


@contextlib.contextmanager
def cut_server(root: Path, shard: str) -> Iterator[tuple[str, list[int]]]:
    """An HTTP server of ``root`` that sends half of ``shard`` and breaks off (``sent``: the bytes
    of each GET of it), and answers the read resumed from there with a 200 and no bytes (not the
    part asked for: a server that cannot resume)."""
    sent: list[int] = []

    class Handler(QuietHandler):
        def copyfile(self, source, outputfile) -> None:
            if not self.path.endswith(shard):
                return super().copyfile(source, outputfile)
            if self.headers.get("Range"):
                return None  # (its reader gives up at the 200, before any byte)
            half = source.read(os.fstat(source.fileno()).st_size // 2)
            outputfile.write(half)
            sent.append(len(half))
            self.close_connection = True
            return None

    with http_server(root, Handler) as url:
        yield url, sent


def test_a_fetch_into_the_cache_that_breaks_off_counts_what_it_read(tmp_path: Path) -> None:
    data = tmp_path / "shards"
    good, cut = (s for s in write_shards(data, {"train": [8, 8]}).splits["train"].shards)
    with (
        cut_server(data, cut.name) as (url, sent),
        ShardLoader(url, "train", 4, image_size=16, workers=1, epoch_mode="exact", device="cpu",
                    cache_dir=str(tmp_path / "cache")) as loader,
    ):  # fmt: skip
        with pytest.warns(UserWarning, match=f"8 of {url}/{cut.name}"):
            assert len(list(loader)) == 4, "the epoch's steps, the cut shard's samples padded"
        (cost,) = loader.reads().values()
    kept = [p.name for p in (tmp_path / "cache").rglob("*.tar*") if not p.name.endswith(".lock")]
    assert len(sent) == 1 and kept == [good.name], "nothing kept of the broken fetch"
    assert cost["read_bytes"] == good.bytes + sent[0], "the broken fetch's bytes cost as much"
