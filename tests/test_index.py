"""Shards another tool made: indexed in place (a directory, AIStore, HTTP), trained on with every
guarantee, and class-sorted ones found out and resharded. Real tars in the hub's and the
webdataset project's layouts, with real JPEG, PNG and WebP bytes."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import webdataset as wds
from conftest import (
    ROOT,
    TINY,
    members,
    picture,
    shards_here,
    train_here,
    write_hub_shards,
    write_shards,
    write_sorted_shards,
)

from imagenet_ais import ShardLoader, ShuffleWarning
from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.shards.quality import split_quality
from imagenet_ais.storage import AISStore, open_store

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]
OPTIONS = {"image_size": 32, "workers": 2, "epoch_mode": "exact", "device": "cpu"}


def files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}


def all_members(folder: Path) -> dict[str, bytes]:
    """Every member of every tar in ``folder``, by name (each name once)."""
    found: dict[str, bytes] = {}
    for shard in sorted(folder.glob("*.tar")):
        for name, data in members(shard).items():
            assert name not in found, f"{name} twice"
            found[name] = data
    return found


def test_the_hubs_layout_is_indexed_in_place_then_trained_on_and_verified(tmp_path: Path) -> None:
    data, wnids = tmp_path / "hub", tmp_path / "wnids.txt"
    exts = {"train-0-1": "png", "train-1-2": "webp"}
    classes_of = write_hub_shards(data, {"train": [10, 9, 11], "val": [6, 6]}, exts=exts, info=False)
    with wds.TarWriter(str(data / "imagenet1k-train-0003.tar")) as tar:  # one sample lost its label
        tar.write({"__key__": "train-3-0", "jpg": picture(random.Random(0), 1)})
        tar.write({"__key__": "train-3-1", "jpg": picture(random.Random(1), 2), "cls": b"2"})
    wnids.write_text("\n".join(WNIDS) + "\n")
    before = files(data)
    refused = train_here("--data", data, "--output", tmp_path / "refused", *TINY, check=False)
    assert refused.returncode == 1 and "write one with `imagenet_shards.py index LOCATION`" in refused.stderr

    out = shards_here("index", data, "--classes", wnids, "--workers", "2").stdout
    assert "made by index (timm/imagenet-1k-wds (Hugging Face hub), split names in the shards' names)" in out
    assert "train: 31 samples in 4 shards, 1 rejected" in out
    assert "rejected imagenet1k-train-0003.tar#train-3-0: no .cls member" in out
    assert "val: 12 samples in 2 shards, 0 rejected" in out, "the hub's 'validation' is the val split"
    after = files(data)
    assert after.pop("manifest.json") and after == before, "no shard written, moved or deleted"
    manifest = load_manifest(open_store(str(data)))
    assert manifest.classes == WNIDS and manifest.source["made_by"] == "index"

    assert "all shards match the manifest and decode" in shards_here("verify", data).stdout, ".json members pass"
    ours = tmp_path / "converted"
    write_shards(ours, {"train": [4]}, names=[WNIDS[2], "n09999999"], prefix="ours-")
    with ShardLoader([(str(ours), 1), (str(data), 1)], "train", 5, **OPTIONS) as loader:
        assert loader.classes == [WNIDS[2], "n09999999", WNIDS[0], WNIDS[1], WNIDS[3]], "merged by the names given"
        labels = {key: int(label) for _, batch, keys in loader for key, label in zip(keys, batch, strict=True)}
    assert all(loader.classes[labels[key]] == WNIDS[cls] for key, cls in classes_of.items() if key in labels)
    assert "made by index" in shards_here("summary", data).stdout
    run = train_here("--data", data, "--output", tmp_path / "run", *TINY, "--epochs", "1", "--workers", "2").stdout
    assert "over 12 images" in run and "every sample was read as the manifest lists it" in run, "PNG and WebP decoded"


def test_class_sorted_shards_are_told_and_a_reshard_mixes_them_moving_bytes_as_they_are(tmp_path: Path) -> None:
    src, dst = tmp_path / "sorted", tmp_path / "mixed"
    write_sorted_shards(src, classes=30, per_class=260, per_shard=260)
    out = shards_here("index", src, "--workers", "2").stdout
    assert "webdataset's ImageNet example" in out
    figure = re.search(r"train: shuffle quality (\d\.\d\d) ", out)
    assert figure and float(figure[1]) < 0.2 and f"imagenet_shards.py reshard {src} DEST" in out
    with pytest.warns(ShuffleWarning, match=rf"shuffle quality {figure[1]} .* reshard") as warned:
        ShardLoader(str(src), "train", 8).close()
    assert warned[0].filename == __file__, "the warning names the caller's line, not the loader's"
    run = train_here("--data", src, "--output", tmp_path / "run", *TINY, "--max-steps", "1", "--workers", "1")
    assert f"note: shuffle quality {figure[1]}" in run.stderr, "the run says so too"

    out = shards_here("reshard", src, dst, "--maxcount", "1000", "--workers", "2").stdout
    assert f"{dst}: train: 7800 samples in 8 shards" in out and "reshard" not in out.partition("train:")[2]
    assert all_members(dst) == all_members(src), "each sample once, every member's name and bytes as they were"
    manifest = load_manifest(open_store(str(dst)))
    quality = split_quality(manifest.class_counts["train"])
    assert quality is not None and quality >= 0.95
    assert "all shards match" in shards_here("verify", dst).stdout
    again = shards_here("reshard", src, dst, check=False)
    assert again.returncode == 1 and again.stderr.strip().endswith("holds a manifest already: reshard to an empty one")


def test_an_interrupted_reshard_goes_on_to_the_same_shards(tmp_path: Path) -> None:
    src, once, resumed = tmp_path / "sorted", tmp_path / "once", tmp_path / "resumed"
    write_sorted_shards(src, classes=10, per_class=100, per_shard=100)
    shards_here("index", src)
    shards_here("reshard", src, once, "--maxcount", "10")
    cmd = [sys.executable, ROOT / "imagenet_shards.py", "reshard", src, resumed, "--maxcount", "10", "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = resumed / "_reshard"
    while proc.poll() is None and len(list(journal.glob("*.json"))) < 5:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "killed before it ended"
    assert not (resumed / "manifest.json").exists()
    out = shards_here("reshard", src, resumed, "--maxcount", "10").stdout
    assert "1000 samples in 100 shards" in out
    assert load_manifest(open_store(str(resumed))).splits == load_manifest(open_store(str(once))).splits
    assert not journal.exists() or not list(journal.iterdir()), "its records are gone with the manifest up"


def test_a_reshard_of_shards_that_number_their_samples_each_from_0_keeps_every_sample(tmp_path: Path) -> None:
    # each source shard's keys 0..9: two of one key side by side in a new shard were grouped as one
    src, dst = tmp_path / "numbered", tmp_path / "mixed"
    src.mkdir()
    for s in range(3):
        with wds.TarWriter(str(src / f"imagenet-train-{s:06d}.tar")) as tar:
            for i in range(10):
                tar.write({"__key__": f"{i:06d}", "jpg": picture(random.Random(s), s), "cls": str(s).encode()})
    shards_here("index", src)
    refused = shards_here("reshard", src, src, check=False)
    assert refused.returncode == 1 and "it holds the shards to reshard" in refused.stderr
    shards_here("reshard", src, dst, "--maxcount", "30")
    with ShardLoader(str(dst), "train", 5, **OPTIONS) as loader:
        read = [(key, int(label)) for _, labels, keys in loader for key, label in zip(keys, labels, strict=True)]
    assert len(read) == 30 and len(set(read)) == 30, "every sample once, none merged with another"
    assert Counter(label for _, label in read) == {0: 10, 1: 10, 2: 10}


def test_labels_from_json_names_merge_with_converted_shards_by_class_name(tmp_path: Path) -> None:
    theirs, ours = tmp_path / "img2dataset", tmp_path / "converted"
    classes_of = write_hub_shards(theirs, {"train": [12, 12]}, labels=("json",), names=WNIDS[1:], classes=3, info=False)
    write_shards(ours, {"train": [8, 8]}, names=[WNIDS[0], WNIDS[2], "n09999999"], prefix="ours-")
    out = shards_here("index", theirs, "--label", "json:label").stdout
    assert f"{theirs}: 3 classes" in out and "labels from json:label" in out
    assert load_manifest(open_store(str(theirs))).classes == sorted(WNIDS[1:]), "the names the labels are, sorted"

    with ShardLoader([(str(ours), 1), (str(theirs), 1)], "train", 8, **OPTIONS) as loader:
        merged = loader.classes
        assert merged == [WNIDS[0], WNIDS[2], "n09999999", WNIDS[1], WNIDS[3]], "merged by name"
        seen = {key: int(label) for _, labels, keys in loader for key, label in zip(keys, labels, strict=True)}
    assert len(seen) == 40, "every sample of both once"
    for key, cls in classes_of.items():
        assert merged[seen[key]] == WNIDS[1:][cls], f"{key}: its json's class, by name"


def test_an_exact_epoch_of_indexed_shards_resumes_on_two_ranks_with_each_sample_once(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    keys = set(write_hub_shards(data, {"train": [20, 13, 7, 24], "val": [4]}))
    shards_here("index", data)
    with ShardLoader(str(data), "train", 8, **OPTIONS) as loader:
        first = [k for i, (_, _, batch) in zip(range(3), loader, strict=False) for k in batch]
        state = loader.state_dict()
    rest: list[str] = []
    for rank in (0, 1):
        with ShardLoader(str(data), "train", 8, rank=rank, world_size=2, **OPTIONS) as loader:
            loader.load_state_dict(state)
            rest += [k for _, _, batch in loader for k in batch]
    trained = Counter(first + rest)
    assert set(trained.values()) == {1} and len(trained) == 56 and set(trained) <= keys, "no sample twice"


def test_a_shard_changed_after_it_was_indexed_is_caught_as_it_streams(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    write_hub_shards(data, {"train": [8, 8], "val": [4]})
    shards_here("index", data)
    shard = data / "imagenet1k-train-0001.tar"
    with tarfile.open(shard) as tar:
        first = tar.getmembers()[0]
    raw = bytearray(shard.read_bytes())
    raw[first.offset_data + 5] ^= 0xFF  # one byte of a picture: the same size, other bytes
    shard.write_bytes(bytes(raw))
    out = train_here("--data", data, "--output", tmp_path / "run", *TINY, "--epochs", "1", check=False)
    assert f"{shard}: its bytes are not the manifest's" in out.stdout + out.stderr


def test_an_http_location_is_indexed_into_a_manifest_elsewhere_and_an_interrupted_index_goes_on(
    serve, tmp_path: Path
) -> None:
    data, manifest_at, fresh = tmp_path / "hub", tmp_path / "manifest", tmp_path / "fresh"
    write_hub_shards(data, {"train": [6] * 24, "val": [4, 4]})
    server = serve(data, SERVE_RATE="60k")  # slow enough to stop it midway
    cmd = [sys.executable, ROOT / "imagenet_shards.py", "index", server.url, "--manifest-to", manifest_at]
    proc = subprocess.Popen([*map(str, cmd), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = manifest_at / "_index"
    while proc.poll() is None and len(list(journal.glob("*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "killed before it ended"
    indexed = [json.loads(p.read_text())[1]["name"] for p in journal.glob("*.json")]
    changed = data / indexed[0]
    with wds.TarWriter(str(changed)) as tar:  # another tool wrote it again meanwhile, with twice the samples
        for i in range(12):
            tar.write({"__key__": f"again-{i}", "jpg": picture(random.Random(i), 1), "cls": b"1"})

    out = shards_here("index", server.url, "--manifest-to", manifest_at).stdout
    assert f"{len(indexed) - 1} shards indexed before" in out
    assert f"{server.url}/{indexed[0]} changed since it was indexed: reading it again" in out
    assert f"train with --data {manifest_at}" in out
    made = load_manifest(open_store(str(manifest_at)))
    assert made.shards_at == server.url and not (manifest_at / indexed[0]).exists(), "the shards stay where they are"
    shards_here("index", server.url, "--manifest-to", fresh, "--split", "train=imagenet1k-train-{0000..0023}.tar")
    assert made.splits["train"] == load_manifest(open_store(str(fresh))).splits["train"], "as if read in one go"
    with ShardLoader(str(manifest_at), "train", 8, **OPTIONS) as loader:
        assert sum(len(keys) for _, _, keys in loader) == 144 and loader.samples == 150


def test_what_index_cannot_do_is_one_line(serve, tmp_path: Path) -> None:
    data, converted = tmp_path / "hub", tmp_path / "converted"
    write_hub_shards(data, {"train": [4]}, info=False)
    write_shards(converted, {"train": [4]})
    server = serve(converted)  # (./run serve: a folder with a manifest)
    cases = {
        (server.url,): f"{server.url} is read-only: give --manifest-to",
        (str(converted),): "holds a manifest index did not write",
        (str(data), "--label", "xml"): "label rule 'xml': give cls, txt or json:FIELD",
        (str(data), "--split", "train"): "--split 'train': give NAME=PATTERN",
        (str(data), "--split", "train=nothing-*.tar"): "no shard matches 'nothing-*.tar'",
        (str(data), "--label", "txt"): "the train split has no sample the label rule txt can read",
    }
    for args, says in cases.items():
        out = shards_here("index", *args, check=False)
        assert out.returncode == 1 and says in out.stderr.strip().splitlines()[-1], (args, out.stderr)
    assert not (data / "manifest.json").exists()


@pytest.mark.xdist_group("ais")
def test_shards_in_aistore_are_indexed_in_place_and_trained_on(ais, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIS_ENDPOINT", ais.endpoint)
    data, url = tmp_path / "hub", f"ais://test-{uuid.uuid4().hex[:8]}/hub"
    write_hub_shards(data, {"train": [10, 14], "val": [5]})
    store = AISStore(url)
    for path in data.iterdir():
        store.put_file(path, path.name, keep=True)
    names = sorted(store.list())
    assert "4 classes" in shards_here("index", url).stdout
    assert sorted(store.list()) == sorted([*names, "manifest.json"]), "only the manifest added"
    resampled = ["--epoch-mode", "resampled", "--epochs", "1", "--workers", "2"]
    out = train_here("--data", url, "--output", tmp_path / "run", *TINY, *resampled).stdout
    assert "over 5 images" in out and "every sample was read as the manifest lists it" in out
