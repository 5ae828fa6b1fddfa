"""imagenet_shards.py against real trees and real tar files."""

from __future__ import annotations

import io
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import (
    ROOT,
    child_pids,
    members,
    outliving,
    run_cli,
    shards_here,
    sparse_member,
    tiny_jpeg,
    wait_until,
    write_shards,
)
from PIL import Image

from imagenet_ais import ShardLoader
from imagenet_ais.cli import shards as shards_cli
from imagenet_ais.shards import convert, synth
from imagenet_ais.shards.convert import file_sha256
from imagenet_ais.shards.manifest import Manifest
from imagenet_ais.shards.synth import wnid
from imagenet_ais.storage import LocalStore


def test_convert_accepts_quirks_rejects_bad_and_shuffles(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    out = shards_here("convert", tree, dest, "--maxcount", "10", "--workers", "2", "--seed", "3")
    manifest = json.loads((dest / "manifest.json").read_text())
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert manifest["classes"] == [wnid(k) for k in range(6)]
    assert train["samples"] == 72 and val["samples"] == 24

    rejected = {Path(r["path"]).name: r["reason"] for r in train["rejected"]}
    assert set(rejected) == {f"{wnid(0)}_{bad}.JPEG" for bad in ("truncated", "empty", "notimage")}
    assert "truncated" in rejected[f"{wnid(0)}_truncated.JPEG"]
    assert rejected[f"{wnid(0)}_empty.JPEG"] == "empty file"
    assert f"{wnid(0)}_notimage.JPEG" in out.stdout  # listed for the user too

    samples: dict[str, bytes] = {}
    for shard in train["shards"]:
        found = members(dest / shard["name"])
        assert all("/" not in n and ".." not in n for n in found)
        assert len(found) == 2 * shard["samples"]
        samples.update(found)
        labels = {int(v) for n, v in found.items() if n.endswith(".cls")}
        assert len(labels) > 1, f"{shard['name']} holds a single class: shards must be shuffled"

    def stored(key: str) -> Image.Image:
        img = Image.open(io.BytesIO(samples[f"{key}.jpg"]))
        assert img.format == "JPEG"
        return img

    # quirks: the last training image of classes 0, 1, 2 is CMYK, gray, PNG (see synth.QUIRKS)
    assert stored(f"{wnid(0)}_11").mode == "RGB"  # CMYK re-encoded
    gray_src = (tree / "train" / wnid(1) / f"{wnid(1)}_11.JPEG").read_bytes()
    assert samples[f"{wnid(1)}_11.jpg"] == gray_src  # a gray JPEG keeps its bytes
    assert stored(f"{wnid(2)}_11").mode == "RGB"  # PNG re-encoded
    plain_src = (tree / "train" / wnid(3) / f"{wnid(3)}_0.JPEG").read_bytes()
    assert samples[f"{wnid(3)}_0.jpg"] == plain_src
    assert samples[f"{wnid(3)}_0.cls"] == b"3"

    verified = shards_here("verify", dest)
    assert "all shards match" in verified.stdout
    summary = shards_here("summary", dest).stdout
    assert "train: imagenet-train-{000000..000007}.tar  shards=8 samples=72" in summary
    assert "val: imagenet-val-{000000..000002}.tar  shards=3 samples=24" in summary
    assert not list(dest.glob(".*")), "scratch files left behind"


def test_verify_names_the_shard_with_a_flipped_byte(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "20", "--workers", "2")
    victim = dest / "imagenet-train-000002.tar"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = shards_here("verify", dest, check=False)
    assert proc.returncode == 1
    assert "imagenet-train-000002.tar: sha256" in proc.stderr
    assert proc.stderr.count("BAD") == 1


def test_verify_of_an_unreadable_manifest_is_one_line(tmp_path: Path) -> None:
    """Owned by a user outside the user namespace verify runs in, so not even root can read it."""
    if not shutil.which("unshare") or run_cli("unshare", "-r", "true", check=False).returncode:
        pytest.skip("no unshare, or user namespaces are not allowed here")
    write_shards(tmp_path, {"train": [1]})
    os.chown(tmp_path / "manifest.json", 12345, 12345)
    os.chmod(tmp_path / "manifest.json", 0o600)
    proc = run_cli("unshare", "-r", sys.executable, ROOT / "imagenet_shards.py", "verify", tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"Error: [Errno 13] Permission denied: '{tmp_path / 'manifest.json'}'"]


def test_verify_and_summary_refuse_a_missing_manifest(tmp_path: Path) -> None:
    for verb in ("verify", "summary"):
        proc = shards_here(verb, tmp_path, check=False)
        assert proc.returncode == 1
        assert f"no manifest.json in {tmp_path}: give the location of shards made by" in proc.stderr
        assert "--data" not in proc.stderr, "verify and summary take no --data"


def test_killed_conversion_leaves_no_partial_shard_and_resumes(tree: Path, tmp_path: Path) -> None:
    args = ["--maxcount", "1", "--workers", "1", "--seed", "5"]
    reference = tmp_path / "reference"
    shards_here("convert", tree, reference, *args)

    dest = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, ROOT / "imagenet_shards.py", "convert", tree, dest, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until(proc, lambda: len(list(dest.glob("imagenet-*.tar"))) >= 10, "10 shards written", poll=0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    assert not (dest / "manifest.json").exists()
    finished = sorted(dest.glob("imagenet-*.tar"))
    assert 10 <= len(finished) < 96
    for shard in finished:  # whatever has a final name is complete
        assert shard.read_bytes() == (reference / shard.name).read_bytes(), shard.name
    before = {p.name: p.stat().st_mtime_ns for p in finished}
    (dest / ".imagenet-train-000000.tar.x1y2z3.partial").write_bytes(b"half a shard")  # as a kill leaves it

    shards_here("convert", tree, dest, *args)
    assert {p.name: p.stat().st_mtime_ns for p in finished} == before, "finished shards were rewritten"
    assert (dest / "manifest.json").read_text() == (reference / "manifest.json").read_text()
    assert sorted(p.name for p in dest.glob("imagenet-*.tar")) == sorted(p.name for p in reference.glob("*.tar"))
    assert not (dest / "_progress").exists() and not list(dest.glob(".*.partial"))
    shards_here("verify", dest)


def test_rerun_rebuilds_only_a_damaged_shard(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    args = ["--maxcount", "20", "--workers", "2"]
    shards_here("convert", tree, dest, *args)
    good = (dest / "imagenet-train-000001.tar").read_bytes()
    (dest / "imagenet-train-000001.tar").write_bytes(good[:1000])  # a damaged copy under the final name
    mtimes = {p.name: p.stat().st_mtime_ns for p in dest.glob("*.tar")}
    err = shards_here("convert", tree, dest, *args).stderr
    assert f"convert → {dest}: {len(mtimes) - 1} shards kept (verified, from the same inputs), 1 rebuilt, 0 new" in err
    assert (dest / "imagenet-train-000001.tar").read_bytes() == good
    changed = [p.name for p in dest.glob("*.tar") if p.stat().st_mtime_ns != mtimes[p.name]]
    assert changed == ["imagenet-train-000001.tar"]


def test_changed_plan_replaces_old_shards(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "5", "--splits", "train")
    shards_here("convert", tree, dest, "--maxcount", "30", "--splits", "train")
    names = sorted(p.name for p in dest.glob("*.tar"))
    assert names == [f"imagenet-train-{i:06d}.tar" for i in range(3)]
    manifest = json.loads((dest / "manifest.json").read_text())
    counts = [s["samples"] for s in manifest["splits"]["train"]["shards"]]
    assert sum(counts) == 72 and max(counts) <= 30  # 75 files planned 30/30/15, 3 of them rejected
    shards_here("verify", dest)


def test_convert_rejects_a_tree_without_train(tmp_path: Path) -> None:
    (tmp_path / "src" / "val").mkdir(parents=True)
    proc = shards_here("convert", tmp_path / "src", tmp_path / "out", check=False)
    assert proc.returncode == 1
    assert "train not found" in proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_synth_pictures_have_varied_sizes(tmp_path: Path) -> None:
    shards_here("synth", tmp_path, "--classes", "2", "--train-per-class", "8", "--val-per-class", "1")
    sizes = [Image.open(p).size for p in (tmp_path / "train").rglob("*.JPEG")]
    assert len(sizes) == 16
    assert all(150 <= s <= 600 for wh in sizes for s in wh)
    assert len(set(sizes)) > 8
    shutil.rmtree(tmp_path / "train")


def test_converting_one_split_keeps_the_others(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "20")
    before = json.loads((dest / "manifest.json").read_text())
    train = {p.name: p.read_bytes() for p in dest.glob("imagenet-train-*.tar")}
    shards_here("convert", tree, dest, "--maxcount", "10", "--splits", "val")
    after = json.loads((dest / "manifest.json").read_text())
    assert after["splits"]["train"] == before["splits"]["train"], "train kept as it was"
    assert {p.name: p.read_bytes() for p in dest.glob("imagenet-train-*.tar")} == train
    assert len(after["splits"]["val"]["shards"]) == 3 and len(before["splits"]["val"]["shards"]) == 2
    shards_here("verify", dest)


@pytest.mark.parametrize(
    ("foreign", "says"),
    [
        ({"manifest.json": b'{"hello": "world"}'}, "manifest.json is not a manifest written by imagenet_shards.py"),
        ({"notes.txt": b"mine"}, "holds files imagenet_shards.py did not write (notes.txt)"),
        ({"imagenet-train-000042.tar": b"not ours"}, "did not write (imagenet-train-000042.tar)"),
    ],
)
def test_a_dest_with_files_not_ours_is_refused_untouched(
    foreign: dict[str, bytes], says: str, tree: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "shards"
    for name, data in foreign.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    proc = shards_here("convert", tree, dest, "--maxcount", "20", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1] and "nothing was changed" in proc.stderr
    assert {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == foreign


def test_no_splits_is_refused(tree: Path, tmp_path: Path) -> None:
    proc = shards_here("convert", tree, tmp_path / "out", "--splits", ",", check=False)
    assert proc.returncode == 1 and "--splits names no split" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_16_bit_gray_png_keeps_its_tones(tmp_path: Path) -> None:
    """A 16-bit grayscale PNG (named .JPEG, as ImageNet's odd files are) is scaled to 8 bits,
    not clipped: Pillow's plain conversion turns nearly every pixel white."""
    folder = tmp_path / "src" / "train" / "n00000001"
    folder.mkdir(parents=True)
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (64, 1))  # black to white, left to right
    Image.fromarray(ramp).save(folder / "ramp.JPEG", format="PNG")
    assert Image.open(folder / "ramp.JPEG").mode.startswith("I")
    dest = tmp_path / "shards"
    shards_here("convert", tmp_path / "src", dest, "--splits", "train")
    (stored,) = [v for k, v in members(dest / "imagenet-train-000000.tar").items() if k.endswith(".jpg")]
    gray = np.asarray(Image.open(io.BytesIO(stored)).convert("L"), dtype=np.float64)
    assert abs(gray.mean() - 127.5) < 4 and gray[:, :16].mean() < 12 and gray[:, -16:].mean() > 243


def start_convert(src: Path, dest: str | Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, ROOT / "imagenet_shards.py", "convert", src, dest, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_shard_goes_up_while_the_worker_builds_the_next(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one worker, the first shard's upload waits until the next shard is being built: an
    upload that held up the building (a build then its upload, in turn) never sees that."""
    dest = tmp_path / "shards"
    put_file, waited = LocalStore.put_file, tmp_path / "waited"  # a file: uploads run in processes of their own

    def slow_put_file(self: LocalStore, src: Path, name: str, **kw: bool) -> None:
        if name.endswith(".tar") and not waited.exists():
            deadline = time.monotonic() + 60
            while not [p for p in self.root.glob(".imagenet-*.partial") if p != src]:
                assert time.monotonic() < deadline, "the next shard was not built while this one went up"
                time.sleep(0.01)
            waited.write_text(name)
        put_file(self, src, name, **kw)

    monkeypatch.setattr(LocalStore, "put_file", slow_put_file)
    manifest = convert.convert(tree, str(dest), ["train"], 10, int(1e9), 1, 0)
    assert waited.exists() and len(manifest.splits["train"].shards) >= 7
    assert not list(dest.glob(".*.partial")), "no scratch file left"
    assert all(file_sha256(dest / s.name) == s.sha256 for s in manifest.splits["train"].shards)


def test_an_upload_process_killed_outright_leaves_no_scratch_file(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "shards"
    put_file = LocalStore.put_file

    def killed(self: LocalStore, src: Path, name: str, **kw: bool) -> None:
        # an upload process, as the OOM killer would: as it puts up a shard's record, which goes
        # first from a scratch file of its own (its shard, built, is never put up either)
        if name.startswith(convert.JOURNAL) and name.endswith(".tar.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        put_file(self, src, name, **kw)

    monkeypatch.setattr(LocalStore, "put_file", killed)
    with pytest.raises(BrokenProcessPool):
        convert.convert(tree, str(dest), ["train"], 10, int(1e9), 2, 0)
    assert not list(dest.glob(".*.partial")), "no scratch file: of shards built, nor of records never put up"
    assert not list(dest.glob("imagenet-*.tar"))


def test_a_convert_killed_outright_leaves_no_pool_workers(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    proc = start_convert(tree, dest, "--maxcount", "1", "--workers", "2")
    wait_until(proc, lambda: len(list(dest.glob("imagenet-*.tar"))) >= 4, "4 shards written", poll=0.002)
    workers = child_pids(proc.pid)
    assert len(workers) >= 2
    proc.kill()  # the parent alone, as the OOM killer would
    proc.wait()
    assert not (alive := outliving(workers, 3)), f"pool workers {sorted(alive)} outlived their convert"


def test_a_second_convert_into_the_same_dest_is_refused(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    dest.mkdir()
    (dest / "_convert.lock").write_text("x" * 1000)  # left by a holder killed before it deleted it
    args = ["--maxcount", "1", "--workers", "1"]
    first = start_convert(tree, dest, *args)
    wait_until(first, lambda: len(list(dest.glob("imagenet-*.tar"))) >= 2, "2 shards written", poll=0.002)
    os.killpg(first.pid, signal.SIGSTOP)  # mid-run for as long as the second one takes
    try:
        second = shards_here("convert", tree, dest, *args, check=False)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line == (
        f"Error: {dest} is being converted by PID {first.pid} on {socket.gethostname()}: "
        "wait for it to finish (nothing was changed)"
    )
    assert first.wait() == 0, first.stderr.read()
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 72 and manifest["splits"]["val"]["samples"] == 24
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["manifest.json", *(s["name"] for split in manifest["splits"].values() for s in split["shards"])]
    ), "no lock or journal left behind"
    shards_here("verify", dest)


def test_a_failed_run_publishes_no_manifest_and_the_next_keeps_the_other_splits(tree: Path, tmp_path: Path) -> None:
    """The manifest a run starts from is set aside, not lost: killed while rewriting val, DEST has
    no manifest (readers see no dataset), and the next run still knows train is ours and keeps it."""
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "20")
    before = json.loads((dest / "manifest.json").read_text())
    train = {p.name: p.read_bytes() for p in dest.glob("imagenet-train-*.tar")}

    args = ["--splits", "val", "--maxcount", "1", "--workers", "1"]
    killed = start_convert(tree, dest, *args)
    wait_until(killed, lambda: (dest / "imagenet-val-000005.tar").exists(), "6 val shards written", poll=0.002)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not (dest / "manifest.json").exists(), "a manifest describing shards being rewritten"

    shards_here("convert", tree, dest, *args)
    after = json.loads((dest / "manifest.json").read_text())
    assert after["splits"]["train"] == before["splits"]["train"]
    assert len(after["splits"]["val"]["shards"]) == 24
    assert {p.name: p.read_bytes() for p in dest.glob("imagenet-train-*.tar")} == train
    assert not (dest / "_progress").exists() and not (dest / "_convert.lock").exists()
    shards_here("verify", dest)


def test_a_split_being_rewritten_when_a_run_stopped_is_not_kept(tree: Path, tmp_path: Path) -> None:
    """Killed while rewriting val (maxcount 20 → 1), a run converting train alone must not keep
    val from the set-aside manifest: some of its shards are already the new ones."""
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "20")
    killed = start_convert(tree, dest, "--splits", "val", "--maxcount", "1", "--workers", "1")
    record = dest / "_progress" / "imagenet-val-000003.tar.json"  # so val 0..2 are rewritten
    wait_until(killed, record.exists, "4 val shards begun", poll=0.002)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    assert refused(tree, dest, "--splits", "train", "--maxcount", "20") == (
        "Error: val was being rewritten when a run stopped: add it to --splits "
        "(--splits train,val; nothing was changed)"
    )
    shards_here("convert", tree, dest, "--splits", "train,val", "--maxcount", "20")
    shards_here("verify", dest)


def this_machine() -> dict:
    """Host, boot and pid namespace: where a lock's pid can be checked."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"host": socket.gethostname(), "boot": boot, "pidns": os.stat("/proc/self/ns/pid").st_ino}


@pytest.mark.parametrize("holder", ["alive", "dead", "dead in another pid namespace", "malformed"])
def test_an_object_store_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(
    holder: str, gcs, tmp_path: Path
) -> None:
    """A dead pid counts only on the same host, boot and pid namespace: containers often share a
    hostname, and a pid of another namespace tells nothing here. A malformed lock names no one."""
    from imagenet_ais.storage import GCSStore

    src = tmp_path / "src"
    synth.make_tree(src, classes=2, train_per_class=2, val_per_class=1, seed=0)
    url = f"gs://{gcs.make_bucket()}/shards"
    store = GCSStore(url)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = os.getpid() if holder == "alive" else int(gone.stdout)
    lock = {"pid": pid, **this_machine(), "time": time.time(), "token": "theirs"}
    if holder == "dead in another pid namespace":
        lock["pidns"] += 1
    if holder == "malformed":
        lock["time"] = "yesterday"
    store.write_bytes("_convert.lock", json.dumps(lock).encode())

    proc = shards_here("convert", src, url, "--workers", "1", check=False)
    if holder in ("alive", "dead in another pid namespace"):
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            f"Error: {url} is being converted by PID {pid} on {socket.gethostname()}: "
            "wait for it to finish (nothing was changed)"
        )
        assert store.list() == ["_convert.lock"]
    else:
        assert proc.returncode == 0, proc.stderr
        who = "another process" if holder == "malformed" else f"PID {pid} on {socket.gethostname()}"
        assert f"_convert.lock of {who} is stale" in proc.stderr and "Traceback" not in proc.stderr
        assert "_convert.lock" not in store.list() and store.exists("manifest.json")


def test_an_object_lock_is_refreshed_by_a_heartbeat_and_knows_when_it_is_lost(
    gcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.api_core.exceptions import NotFound

    from imagenet_ais.storage import GCSStore, locks

    store = GCSStore(f"gs://{gcs.make_bucket()}/shards")

    def lock_time() -> float:
        while True:
            try:
                return json.loads(store.read_bytes("_convert.lock"))["time"]
            except NotFound:  # read while the heartbeat replaced it
                time.sleep(0.01)

    monkeypatch.setattr(locks, "REFRESH_S", 0.05)
    with locks.lock_dest(store) as lock:
        first, deadline = lock_time(), time.monotonic() + 30
        while lock_time() == first:  # no work done, no call made: the heartbeat alone
            assert time.monotonic() < deadline, "the lock was never refreshed"
            time.sleep(0.05)
        lock.check()

    monkeypatch.setattr(locks, "REFRESH_S", 3600)  # no heartbeat to race with the takeover below
    with locks.lock_dest(store) as lock:
        theirs = {"pid": 1, "host": "elsewhere", "time": time.time(), "token": "theirs"}
        store.write_bytes("_convert.lock", json.dumps(theirs).encode())  # taken over, as if stale
        with pytest.raises(ValueError, match=r"_convert.lock is no longer this run's \(PID 1 on elsewhere holds it"):
            lock.check()
    assert json.loads(store.read_bytes("_convert.lock")) == theirs, "their lock was deleted on the way out"


def test_a_stale_lock_is_deleted_only_while_it_is_the_one_seen(gcs) -> None:
    from imagenet_ais.storage import GCSStore

    store = GCSStore(f"gs://{gcs.make_bucket()}/shards")
    store.write_bytes("_convert.lock", b"stale")
    store.write_bytes("_convert.lock", b"new holder")  # taken over by a third run meanwhile
    assert not store.delete_if("_convert.lock", b"stale")
    assert store.read_bytes("_convert.lock") == b"new holder"
    assert store.delete_if("_convert.lock", b"new holder") and not store.exists("_convert.lock")
    assert not store.delete_if("_convert.lock", b"new holder")


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_run_that_lost_its_lock_publishes_and_deletes_nothing(
    where: str, tree: Path, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is taken from under the run after its last shard: no manifest goes up, and the
    shards of the manifest it started from (which it would tidy away) stay."""
    from imagenet_ais.shards import convert
    from imagenet_ais.storage import open_store

    dest = str(tmp_path / "shards") if where == "local" else f"gs://{request.getfixturevalue('gcs').make_bucket()}/s"
    convert.convert(tree, dest, ["train", "val"], 20, int(1e9), 1, 0)
    store = open_store(dest)
    before = store.list()
    checked = convert._check_published

    theirs = {"pid": 1, "host": "elsewhere", "time": 0, "token": "x"}

    def and_lock_lost(store, manifest) -> None:
        checked(store, manifest)
        store.delete("_convert.lock")  # another run, seeing it stale, takes it over
        store.write_bytes("_convert.lock", json.dumps(theirs).encode())

    monkeypatch.setattr(convert, "_check_published", and_lock_lost)
    lost = r"_convert.lock is no longer this run's \((PID 1 on elsewhere|another process)"
    with pytest.raises(ValueError, match=lost):
        convert.convert(tree, dest, ["train", "val"], 10, int(1e9), 1, 0)  # other shards: the old ones go
    assert not store.exists("manifest.json")
    assert set(before) - {"manifest.json"} <= set(store.list()), "shards deleted"


def test_a_rerun_rereads_inputs_that_changed(tree: Path, tmp_path: Path) -> None:
    """A fixed image is no longer rejected and a replaced one (same name, same size) is stored
    anew; shards whose inputs did not change are kept as they are."""
    src, dest = tmp_path / "src", tmp_path / "shards"
    shutil.copytree(tree, src)
    args = ["--maxcount", "10", "--workers", "2"]
    shards_here("convert", src, dest, *args)
    mtimes = {p.name: p.stat().st_mtime_ns for p in dest.glob("*.tar")}

    fixed = src / "train" / wnid(0) / f"{wnid(0)}_truncated.JPEG"
    fixed.write_bytes((src / "train" / wnid(0) / f"{wnid(0)}_0.JPEG").read_bytes())
    replaced = src / "train" / wnid(3) / f"{wnid(3)}_0.JPEG"
    data = bytearray(replaced.read_bytes())
    data[len(data) // 2] ^= 0x01  # other bytes, the same size
    replaced.write_bytes(bytes(data))
    shards_here("convert", src, dest, *args)

    train = json.loads((dest / "manifest.json").read_text())["splits"]["train"]
    assert train["samples"] == 73
    assert {Path(r["path"]).name for r in train["rejected"]} == {f"{wnid(0)}_{b}.JPEG" for b in ("empty", "notimage")}
    stored = {n: v for s in train["shards"] for n, v in members(dest / s["name"]).items()}
    assert stored[f"{wnid(3)}_0.jpg"] == bytes(data)
    assert stored[f"{wnid(0)}_truncated.jpg"] == fixed.read_bytes()
    rewritten = [p.name for p in dest.glob("*.tar") if p.stat().st_mtime_ns != mtimes[p.name]]
    assert 1 <= len(rewritten) <= 2, rewritten


def small_tree(root: Path, layout: dict[str, str | None]) -> Path:
    """Files (a tiny JPEG each) and symlinks (``"-> target"``) under ``root``; None: an empty folder."""
    rng = random.Random(0)
    for rel, what in layout.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if what is None:
            path.mkdir()
        elif what.startswith("-> "):
            path.symlink_to(what[3:])
        else:
            path.write_bytes(tiny_jpeg(rng, 1) if what == "jpeg" else what.encode())
    return root


def test_every_input_file_is_in_a_shard_or_listed_with_a_reason(tmp_path: Path) -> None:
    src = small_tree(
        tmp_path / "src",
        {
            "train/n1/a.JPEG": "jpeg",
            "train/n1/sub/deeper/b.JPEG": "jpeg",  # nested: read, as ImageFolder does
            "train/n1/loop": "-> .",  # a folder symlink loop
            "train/n1/up": "-> ../..",  # a link to SRC
            "train/n1/sub/again": "-> ../../n2",  # a link to another class folder
            "train/n1/dangling.JPEG": "-> nowhere.JPEG",
            "train/n1/self.JPEG": "-> self.JPEG",
            "train/n2/c.JPEG": "jpeg",
            "train/stray.JPEG": "jpeg",
            "val/n1/d.JPEG": "jpeg",
            "val/n2/e.JPEG": "jpeg",
        },
    )
    dest = tmp_path / "shards"
    out = shards_here("convert", src, dest, "--workers", "1").stdout
    train = json.loads((dest / "manifest.json").read_text())["splits"]["train"]
    stored = members(dest / "imagenet-train-000000.tar")
    assert sorted(n for n in stored if n.endswith(".cls")) == ["a.cls", "b.cls", "c.cls"]
    assert stored["b.cls"] == b"0" and stored["c.cls"] == b"1"
    reasons = {r["path"]: r["reason"] for r in train["rejected"]}
    assert reasons == {
        "train/n1/loop": "a link to the folder train/n1 inside SRC: links within SRC are not followed",
        "train/n1/up": "a link to the folder . inside SRC: links within SRC are not followed",
        "train/n1/sub/again": "a link to the folder train/n2 inside SRC: links within SRC are not followed",
        "train/n1/dangling.JPEG": "a broken symlink (to nowhere.JPEG): point it at an image or remove it",
        "train/n1/self.JPEG": "a symlink loop: point it at an image or remove it",
        "train/stray.JPEG": "not in a class folder: move it into train/<wnid>/",
    }
    for path, reason in reasons.items():
        assert f"rejected {path}: {reason}" in out
    assert "train: 3 samples in 1 shard, 6 rejected" in out and "val: 2 samples" in out


def test_a_source_file_larger_than_a_sample_or_not_a_file_is_refused_unread(tmp_path: Path) -> None:
    # a sparse file of 1 GiB took the converter to 1.3 GB before Pillow refused it (a pipe is left out unread)
    src = small_tree(tmp_path / "src", {"train/n1/a.JPEG": "jpeg", "train/n2/c.JPEG": "jpeg"})
    with (src / "train/n1/big.JPEG").open("wb") as big:
        big.truncate(3 * 2**30)  # declares 3 GiB, holds nothing
    os.mkfifo(src / "train/n2/pipe.JPEG")
    dest = tmp_path / "shards"
    shards_here("convert", src, dest, "--workers", "1", "--splits", "train")
    reasons = {
        r["path"]: r["reason"] for r in json.loads((dest / "manifest.json").read_text())["splits"]["train"]["rejected"]
    }
    assert reasons == {
        "train/n1/big.JPEG": f"{3 * 2**30:,} bytes, over the {64 * 2**20:,} a sample may have: not read",
        "train/n2/pipe.JPEG": "not a regular file (a pipe, socket or device)",
    }


def test_an_image_reached_twice_is_stored_once_under_the_class_it_is_in(tmp_path: Path) -> None:
    """Links (and hard links) must not put an image under another label, in two splits, or twice:
    a folder link within SRC is not followed, and a file met twice is stored where it really is."""
    src = small_tree(
        tmp_path / "src",
        {
            "train/n1/a.JPEG": "jpeg",
            "train/n1/x": "-> ../n2/x",  # would give n2's subfolder the label n1
            "train/n1/c.JPEG": "-> ../n2/c.JPEG",  # a file link across classes, met first
            "train/n2/x/y.JPEG": "jpeg",
            "train/n2/c.JPEG": "jpeg",
            "val/n1/v.JPEG": "jpeg",
            "val/n2/w.JPEG": "jpeg",
        },
    )
    os.link(src / "train/n1/a.JPEG", src / "val/n1/a.JPEG")  # the same image in train and val
    dest = tmp_path / "shards"
    shards_here("convert", src, dest, "--workers", "1")
    manifest = json.loads((dest / "manifest.json").read_text())
    train = members(dest / "imagenet-train-000000.tar")
    assert {n: v for n, v in train.items() if n.endswith(".cls")} == {"a.cls": b"0", "y.cls": b"1", "c.cls": b"1"}
    assert sorted(n for n in members(dest / "imagenet-val-000000.tar") if n.endswith(".cls")) == ["v.cls", "w.cls"]
    reasons = {r["path"]: r["reason"] for split in manifest["splits"].values() for r in split["rejected"]}
    assert reasons == {
        "train/n1/x": "a link to the folder train/n2/x inside SRC: links within SRC are not followed",
        "train/n1/c.JPEG": "the same file as train/n2/c.JPEG (a link): stored once, there",
        "val/n1/a.JPEG": "the same file as train/n1/a.JPEG (a link): stored once, there",
    }


def test_an_unreadable_subfolder_is_listed_as_rejected(tmp_path: Path) -> None:
    """Owned by a user outside the user namespace convert runs in, so not even root can read it."""
    if not shutil.which("unshare") or run_cli("unshare", "-r", "true", check=False).returncode:
        pytest.skip("no unshare, or user namespaces are not allowed here")
    src = small_tree(tmp_path / "src", {**CLASSES, "train/n1/locked/z.JPEG": "jpeg"})
    os.chown(src / "train/n1/locked", 12345, 12345)
    os.chmod(src / "train/n1/locked", 0o700)
    dest = tmp_path / "shards"
    convert = [sys.executable, ROOT / "imagenet_shards.py", "convert", src, dest, "--workers", "1"]
    proc = run_cli("unshare", "-r", *convert, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    train = json.loads((dest / "manifest.json").read_text())["splits"]["train"]
    assert train["rejected"] == [{"path": "train/n1/locked", "reason": "PermissionError: Permission denied"}]
    assert train["samples"] == 2


def refused(src: Path, dest: Path, *args: str) -> str:
    """convert's one-line error; DEST is left as it was (absent here) and no manifest is written."""
    proc = shards_here("convert", src, dest, "--workers", "1", *args, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (dest / "manifest.json").exists()
    return proc.stderr.strip().splitlines()[-1]


CLASSES = {"train/n1/a.JPEG": "jpeg", "train/n2/b.JPEG": "jpeg", "val/n1/c.JPEG": "jpeg", "val/n2/d.JPEG": "jpeg"}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"train/n3": None, "val/n3/f.JPEG": "jpeg"}, "Error: train/n3 has no samples (the folder is missing"),
        ({"train/n3/x.JPEG": "", "val/n3/f.JPEG": "jpeg"}, "Error: train/n3 has no samples"),  # rejected
        ({"train/n3/x.JPEG": "jpeg"}, "Error: val/n3 has no samples"),
        ({"val/n2/d.JPEG": "-> gone.JPEG"}, "Error: val/n2 has no samples"),
    ],
)
def test_a_class_with_no_samples_is_an_error_unless_allowed(extra: dict, says: str, tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src", {**CLASSES, **extra})
    dest = tmp_path / "shards"
    line = refused(src, dest)
    assert line.startswith(says) and line.endswith("or pass --allow-empty to convert without them")
    shards_here("convert", src, dest, "--workers", "1", "--allow-empty")
    assert (dest / "manifest.json").exists()


def test_an_empty_split_is_an_error_unless_allowed(tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src", {"train/n1/a.JPEG": "jpeg", "val": None})
    assert refused(src, tmp_path / "shards") == (
        "Error: val has no samples: add images to val/<wnid>/, or pass --allow-empty to convert without them"
    )
    shards_here("convert", src, tmp_path / "shards", "--allow-empty")
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["splits"]["val"]["shards"] == []


def test_the_raw_flat_val_layout_is_refused_with_how_to_arrange_it(tmp_path: Path) -> None:
    layout = {"train/n1/a.JPEG": "jpeg", **{f"val/ILSVRC2012_val_{i:08d}.JPEG": "jpeg" for i in range(1, 4)}}
    src = small_tree(tmp_path / "src", layout)
    assert refused(src, tmp_path / "shards") == (
        f"Error: {src / 'val'} holds 3 files and no class folders (the raw ILSVRC2012 val layout?): "
        "arrange them as val/<wnid>/<file> (e.g. with ILSVRC2012's valprep.sh), or leave 'val' out of --splits"
    )


@pytest.mark.parametrize(("link", "splits"), [("train/n3", "train,val"), ("val/n2", "train,val"), ("val/n2", "val")])
def test_a_class_folder_linked_to_another_is_refused(link: str, splits: str, tmp_path: Path) -> None:
    """Refused even when the folder linked to is in a split not converted now (--splits val)."""
    src = small_tree(tmp_path / "src", {**CLASSES, "train/n3/e.JPEG": "jpeg", "val/n3/f.JPEG": "jpeg"})
    shutil.rmtree(src / link)
    (src / link).symlink_to(src / "train" / "n1")
    assert refused(src, tmp_path / "shards", "--splits", splits) == (
        f"Error: {src / link} is the same folder as {src / 'train' / 'n1'} (a symlink): its images would be "
        "read twice, under two labels or in two splits; make it a folder of its own (nothing was changed)"
    )
    assert not (tmp_path / "shards").exists()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        # an empty class list gave "IndexError: Target 2 is out of bounds" in training
        (lambda m: m.__setitem__("classes", []), '"classes" is [], not a list of class names'),
        (lambda m: m["splits"]["train"]["shards"][1].update(samples=-3), "shard 1 of 'train': -3 samples in"),
        # 10**12 samples listed for a shard of a few KB: exact epochs of padding, and a worker's
        # loop over the listed samples that never ended
        (
            lambda m: m["splits"]["train"]["shards"][1].update(samples=10**12),
            "shard 1 of 'train': 1000000000000 samples in ",
        ),
        (
            lambda m: m["splits"]["train"]["shards"][1].update(name=m["splits"]["train"]["shards"][0]["name"]),
            "shard 1 of 'train': 'imagenet-train-000000.tar' is listed twice",
        ),
        # an absolute name: a cache over http(s) made its reservation at the file system's root
        (
            lambda m: m["splits"]["train"]["shards"][0].update(name="/x.tar"),
            "shard 0 of 'train': '/x.tar' is no name of a file",
        ),
        (
            lambda m: m["splits"]["train"]["shards"][1].update(name="a/../../x.tar"),
            "'a/../../x.tar' is no name of a file",
        ),
        (lambda m: m["splits"]["train"]["shards"][1].update(name="x\n.tar"), "'x\\n.tar' is no name of a file"),
    ],
)
def test_a_manifest_whose_counts_cannot_be_trusted_is_refused(edit, says: str, tmp_path: Path) -> None:
    write_shards(tmp_path, {"train": [3, 3]})
    doc = json.loads((tmp_path / "manifest.json").read_text())
    edit(doc)
    with pytest.raises(ValueError, match=re.escape(says)):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda m: m["splits"]["train"]["shards"][1].update(samples="16"),
            "shard 1 of 'train': 'samples' is \"16\", not int",
        ),
        (
            lambda m: m["splits"]["train"]["shards"][0].update(bytes=True),
            "shard 0 of 'train': 'bytes' is true, not int",
        ),
        (lambda m: m.update(classes="c0 c1"), '"classes" is "c0 c1", not a list of class names'),
        (
            lambda m: m["splits"]["train"].update(rejected="none"),
            '"rejected" of \'train\' is "none", not a list of objects',
        ),
        (lambda m: ["a"], 'the file is ["a"], not an object'),
        (lambda m: m.update(splits=[]), '"splits" is [], not an object'),
        (lambda m: m["splits"].update(train=5), "split 'train' is 5, not an object"),
        (lambda m: m["splits"]["train"].update(shards={}), "\"shards\" of 'train' is {}, not a list"),
        (lambda m: m["splits"]["train"]["shards"].__setitem__(1, "x"), "shard 1 of 'train' is \"x\", not an object"),
        (lambda m: m["splits"]["train"]["shards"][0].__delitem__("plan"), "shard 0 of 'train': no 'plan'"),
        (lambda m: m["splits"]["train"]["shards"][0].update(extra=1), "shard 0 of 'train': unknown field 'extra'"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_is_one_line(edit, says: str, tmp_path: Path) -> None:
    write_shards(tmp_path, {"train": [3, 3]})
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc = edit(doc) or doc  # (an edit returns a whole new document, or changes this one)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    for verb in ("summary", "verify"):
        proc = shards_here(verb, tmp_path, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"Error: {tmp_path / 'manifest.json'}: unreadable manifest ({says}); re-run `imagenet_shards.py convert`"
        ]


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` × ``height`` pixels (it holds none): PIL refuses it when opened."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


HOLDS = "a sample holds an image (.jpg, .jpeg, .png, .webp) and text (.cls, .txt, .json) only"


def shard_holding(dest: Path, names: list[str], samples: int) -> Path:
    """A set of one shard holding members ``names`` (``NAME=VALUE``: VALUE's bytes, or a bomb, a
    sparse member, a PNG; else a JPEG or "1"), its manifest entry saying ``samples`` and its size
    and checksum as they are: only reading it can tell what is wrong in it."""
    write_shards(dest, {"train": [1]})
    shard = dest / "imagenet-train-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for name in names:
            name, _, value = name.partition("=")
            if value == "sparse":
                continue  # put in front below
            if value in ("bomb", "png"):
                data = bomb_png(20000, 20000) if value == "bomb" else photo_bytes((60, 40), "PNG")
            else:
                jpeg = name.lower().endswith((".jpg", ".jpeg")) and not value
                data = tiny_jpeg(random.Random(0), 1) if jpeg else (value or "1").encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    if sparse := [n.partition("=")[0] for n in names if n.endswith("=sparse")]:
        shard.write_bytes(sparse_member(sparse[0], 65 * 2**20) + shard.read_bytes())
    doc = json.loads((dest / "manifest.json").read_text())
    doc["splits"]["train"]["shards"][0].update(samples=samples, bytes=shard.stat().st_size, sha256=file_sha256(shard))
    (dest / "manifest.json").write_text(json.dumps(doc))
    return shard


@pytest.mark.parametrize(
    ("names", "samples", "says"),
    [
        (
            ["k0.jpg", "k0.cls", "k1.jpg", "k1.cls", "k0.jpg", "k0.cls"],
            2,
            "duplicate key 'k0': k0.jpg is in the shard twice",
        ),
        (["k0.jpg", "k0.cls", "k0.pyd"], 1, f"unexpected member 'k0.pyd': {HOLDS}"),
        (["k0.pickle", "k0.jpg", "k0.cls"], 1, f"unexpected member 'k0.pickle': {HOLDS}"),
        (["k0.json", "k0.cls"], 1, "sample 'k0' lacks its image (.jpg, .jpeg, .png, .webp)"),
        (["k0.jpg", "k0.cls=99"], 1, "k0.cls: label '99' is not a class of the manifest (0..3)"),
        (["k0.jpg", "k0.cls=-1"], 1, "k0.cls: label '-1' is not a class of the manifest (0..3)"),
        (["k0.jpg", "k0.cls=one"], 1, "k0.cls: label 'one' is not a class of the manifest (0..3)"),
        (["k0.jpg", "k0.cls", "k1.jpg"], 2, "sample 'k1' lacks its .cls"),
        (  # a decompression bomb aborted verify with a traceback, hiding the other shards' results
            ["k0.jpg=bomb", "k0.cls"],
            1,
            "unreadable (DecompressionBombError: Image size (400000000 pixels) exceeds limit of "
            f"{2 * Image.MAX_IMAGE_PIXELS} pixels, could be decompression bomb DOS attack.)",
        ),
        (  # a header declaring 65 MiB of holes in 512 bytes: refused unread (3 GiB took verify to 3.4 GB)
            ["big.jpg=sparse", "k0.jpg", "k0.cls"],
            1,
            "unreadable (BadMember: member 'big.jpg' is a sparse file, not a regular file)",
        ),
        (  # verify passed it and training skipped its sample: they agree now
            ["k\udcff.jpg", "k\udcff.cls"],
            1,
            "unreadable (BadMember: member name b'k\\xff.jpg' is not UTF-8, as sample keys must be: rename it)",
        ),
        (  # passed verify, and --log-keys wrote two lines for its key
            ["k\n0.jpg", "k\n0.cls"],
            1,
            "unreadable (BadMember: member name 'k\\n0.jpg' holds control characters or is over 1024 characters: "
            "rename it)",
        ),
        (
            ["k" * 1100 + ".jpg", "k" * 1100 + ".cls"],
            1,
            f"unreadable (BadMember: member name '{'k' * 80}…' holds control characters or is over 1024 characters: "
            "rename it)",
        ),
    ],
)
def test_verify_names_what_is_wrong_inside_a_shard(names: list[str], samples: int, says: str, tmp_path: Path) -> None:
    """Shards whose size and checksum match the manifest, so only reading them can tell."""
    shard_holding(tmp_path, names, samples)
    proc = shards_here("verify", tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"BAD {tmp_path}/imagenet-train-000000.tar: {says}"


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ('{"shard": SHARD, "rejected": 5}', '"rejected" is 5, not a list of objects'),
        ('{"rejected": []}', '"shard" is null, not an object'),
        ('{"shard": SHARD, "rejected": [], "x": 1', "Expecting ',' delimiter: line 1 column"),
        ("[]", "the file is [], not an object"),
    ],
)
def test_a_malformed_journal_record_is_one_line(record: str, says: str, tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    shards_here("convert", tree, dest, "--maxcount", "20")
    shard = json.loads((dest / "manifest.json").read_text())["splits"]["train"]["shards"][0]
    path = dest / "_progress" / "imagenet-train-000000.tar.json"
    path.parent.mkdir()
    path.write_text(record.replace("SHARD", json.dumps(shard)))
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    proc = shards_here("convert", tree, dest, "--maxcount", "20", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: {path}: unreadable journal record ({says}")
    assert line.endswith("): remove it and the shard it names, then run convert again")
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before


def test_a_split_named_with_a_dash_resumes_after_a_kill(tree: Path, tmp_path: Path) -> None:
    """Everything under _progress/ is the converter's own, whatever the split's name."""
    src, dest = tmp_path / "src", tmp_path / "shards"
    shutil.copytree(tree, src)
    shutil.copytree(src / "val", src / "mini-val")
    args = ["--splits", "mini-val", "--maxcount", "1", "--workers", "1"]
    killed = start_convert(src, dest, *args)
    record = dest / "_progress" / "imagenet-mini-val-000003.tar.json"
    wait_until(killed, record.exists, "4 shards begun", poll=0.002)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    shards_here("convert", src, dest, *args)
    assert len(json.loads((dest / "manifest.json").read_text())["splits"]["mini-val"]["shards"]) == 24
    shards_here("verify", dest)


def test_a_split_named_twice_is_refused(tree: Path, tmp_path: Path) -> None:
    assert refused(tree, tmp_path / "shards", "--splits", "train,val,train") == (
        "Error: --splits names train more than once: name each split once"
    )


def test_a_file_size_limit_is_one_line_and_publishes_nothing(tree: Path, tmp_path: Path) -> None:
    dest, limit = tmp_path / "shards", 1 << 20  # the first shard (all of train) is larger

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, ROOT / "imagenet_shards.py", "convert", tree, dest, "--workers", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=limited)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: {dest}/.imagenet-train-000000.tar.") and ".partial: file too large for DEST" in line
    assert line.endswith("(a file-size limit, see ulimit -f, or the file system's): raise the limit or lower --maxsize")
    assert not (dest / "manifest.json").exists() and not list(dest.glob(".*.partial"))


def test_a_full_disk_is_one_line_and_publishes_nothing(tree: Path, tmp_path: Path) -> None:
    """DEST on a 256 KiB tmpfs, mounted in a user and mount namespace of the convert's own."""
    dest = tmp_path / "shards"
    dest.mkdir()
    mount = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    convert = [sys.executable, ROOT / "imagenet_shards.py", "convert", tree, dest, "--workers", "1"]
    if not shutil.which("unshare") or run_cli("unshare", "-rm", "true", check=False).returncode:
        pytest.skip("no unshare, or user namespaces are not allowed here")
    proc = run_cli("unshare", "-rm", "sh", "-c", mount, dest, *convert, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    # whichever of the two shards built at once (train's and val's) met the full disk first
    written = rf"{re.escape(str(dest))}/\.imagenet-(train|val)-000000\.tar\.\w+\.partial"
    assert re.fullmatch(
        rf"Error: no space left on DEST {re.escape(str(dest))} writing {written}: free some space or convert elsewhere",
        line,
    ), line


@pytest.mark.parametrize("inside", [".", "train/shards", "elsewhere/shards"])
def test_a_dest_inside_src_is_refused(inside: str, tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src", CLASSES)
    before = sorted(src.rglob("*"))
    dest = src / inside
    assert refused(src, dest) == (
        f"Error: DEST {dest} is inside SRC {src}: its files would be read as inputs on the next run; "
        "choose a DEST outside SRC (nothing was changed)"
    )
    assert sorted(src.rglob("*")) == before


def test_scratch_files_of_a_process_killed_outright_are_removed_by_the_next_one(tmp_path: Path) -> None:
    """A converter into a remote store builds whole shards in TMPDIR; SIGKILL leaves them there."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    build = (
        "import sys, time\n"
        "from imagenet_ais.storage.scratch import scratch_file\n"
        "p = scratch_file('imagenet-train-000000.tar'); p.write_bytes(b'x' * 100_000)\n"
        "print(p, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
    )

    def builder(seconds: float) -> tuple[subprocess.Popen, Path]:
        proc = subprocess.Popen([sys.executable, "-c", build, str(seconds)], env=env, stdout=subprocess.PIPE, text=True)
        return proc, Path(proc.stdout.readline().strip())  # type: ignore[union-attr]

    (alive, kept), (killed, left) = builder(60), builder(60)
    try:
        killed.kill()
        killed.wait()
        assert left.exists() and kept.exists()
        finished, done = builder(0)
        finished.wait()
        assert not left.parent.exists(), "the killed builder's folder is swept"
        assert kept.exists(), "a live builder's file stays"
        assert not done.parent.exists(), "a process that exits removes its own folder"
    finally:
        alive.kill()
        alive.wait()
    last, _ = builder(0)
    last.wait()
    assert [p.name for p in (tmp_path / "imagenet-ais-scratch").iterdir()] == []


def test_worker_processes_remove_their_scratch_folders_when_they_exit(tmp_path: Path) -> None:
    """The converter's building workers are multiprocessing children, where atexit does not run."""
    # (which of the two workers gets the tasks is the scheduler's business: under load one may get all)
    pool = (
        "import os\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from pathlib import Path\n"
        "from imagenet_ais.storage.scratch import scratch_file\n"
        "def build(i):\n"
        "    return str(scratch_file(f'imagenet-train-{i:06d}.tar').parent)\n"
        "if __name__ == '__main__':\n"
        "    with ProcessPoolExecutor(2) as pool:\n"
        "        folders = set(pool.map(build, range(4)))\n"
        "        assert all(Path(f).is_dir() for f in folders)\n"
        "    assert 1 <= len(folders) <= 2 and not any(Path(f).name.startswith(f'{os.getpid()}-') for f in folders)\n"
    )
    script = tmp_path / "pool.py"
    script.write_text(pool)
    subprocess.run([sys.executable, script], env={**os.environ, "TMPDIR": str(tmp_path)}, check=True)
    assert list((tmp_path / "imagenet-ais-scratch").iterdir()) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--classes", "0"], "Invalid value for '--classes': 0 is not in the range x>=1."),
        (["--train-per-class", "-1"], "Invalid value for '--train-per-class': -1 is not in the range x>=0."),
        (["--size", "0", "0"], "Invalid value for '--size': 0 is not in the range x>=1."),
    ],
)
def test_synth_refuses_counts_and_sizes_it_cannot_draw(args: list[str], says: str, tmp_path: Path) -> None:
    # each gave a ValueError traceback
    result = CliRunner().invoke(shards_cli.cli, ["synth", str(tmp_path / "tree"), *args])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


def test_the_shard_tools_write_plain_lines_into_a_log(tmp_path: Path) -> None:
    # tqdm's frames in a log that is no terminal: 32 carriage returns in a ./run local1 log
    tree, dest, copy = tmp_path / "tree", tmp_path / "shards", tmp_path / "copy"
    for args in (
        ("synth", tree, "--classes", "2", "--train-per-class", "12", "--val-per-class", "0", "--workers", "1"),
        ("convert", tree, dest, "--splits", "train", "--maxcount", "2", "--workers", "1"),
        ("verify", dest, "--workers", "auto"),
        ("preload", dest, copy, "--workers", "2"),
    ):
        err = shards_here(*args).stderr
        assert "\r" not in err, args[0]
        assert re.search(rf"^{args[0]} .*: \S+( images| shards|B) of \S+ in \d+s$", err, re.M), err
        if args[0] == "verify":  # 12 shards: a line at each tenth of the way, then the end's
            assert len(re.findall(r"^verify .*: \d+ shards? of 12 \(\d0%\)$", err, re.M)) == 9, err


def test_every_shard_tool_takes_workers_auto_as_its_default() -> None:
    # train.py's --workers was auto; synth's, convert's and verify's the machine's count, preload's 8
    for verb in ("synth", "convert", "verify", "preload"):
        (option,) = [p for p in shards_cli.cli.commands[verb].params if p.name == "workers"]
        assert option.default == "auto", verb
    result = CliRunner().invoke(shards_cli.cli, ["verify", "x", "--workers", "0"])
    assert result.exit_code == 2 and "'0' is neither 'auto' nor a count of 1 or more" in result.output


def test_a_manifest_nested_past_the_stack_and_a_bad_bucket_name_are_one_line(tmp_path: Path) -> None:
    # a RecursionError from summary and train; botocore's ParamValidationError
    (tmp_path / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    manifest = tmp_path / "manifest.json"
    deep = f"Error: {manifest}: unreadable manifest (nested too deep); re-run `imagenet_shards.py convert`"
    for verb in ("summary", "verify"):
        proc = shards_here(verb, tmp_path, check=False)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [deep], proc.stderr
    proc = shards_here("summary", "s3://Bad_Bucket!/x", check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "Error: bad storage URL 's3://Bad_Bucket!/x': 'Bad_Bucket!' is no S3 bucket name (3-63 of a-z, 0-9, '.', "
        "'-', starting and ending with a letter or digit)"
    ]


def photo_bytes(size: tuple[int, int], fmt: str = "JPEG") -> bytes:
    """A picture with detail in it (gradients and noise), as ``fmt``."""
    width, height = size
    x, y = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    noise = np.random.default_rng(width * height).integers(0, 40, (height, width))
    pixels = np.stack([x, y, (x + y) / 2], axis=-1) + noise[..., None]
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format=fmt, quality=95)
    return out.getvalue()


def test_convert_max_side_stores_large_images_smaller_and_keeps_small_ones_as_they_are(tmp_path: Path) -> None:
    tree, dest = tmp_path / "tree", tmp_path / "shards"
    inputs = {"wide.JPEG": ((640, 480), "JPEG"), "tall.JPEG": ((300, 900), "JPEG"), "small.JPEG": ((200, 150), "JPEG")}
    inputs["flat.JPEG"] = ((480, 360), "PNG")  # (ImageNet's PNG named .JPEG)
    for cls in ("n0", "n1"):
        (tree / "train" / cls).mkdir(parents=True)
        for name, (size, fmt) in inputs.items():
            (tree / "train" / cls / name).write_bytes(photo_bytes(size, fmt))

    def stored() -> dict[str, bytes]:
        shard = next(dest.glob("imagenet-train-*.tar"))
        return {n.split("/")[-1].split(".")[0]: b for n, b in members(shard).items() if n.endswith(".jpg")}

    def sides(images: dict[str, bytes]) -> dict[str, tuple[int, int]]:
        return {k: Image.open(io.BytesIO(b)).size for k, b in images.items()}

    out = shards_here(
        "convert", tree, dest, "--splits", "train", "--max-side", "320", "--quality", "90", "--workers", "1"
    )
    assert "images stored at most 320 px a side, JPEG quality 90" in out.stdout
    first = stored()
    assert sorted(sides(first).values()) == sorted([(320, 240), (107, 320), (200, 150), (320, 240)] * 2)
    small = [b for b in first.values() if Image.open(io.BytesIO(b)).size == (200, 150)]
    assert small == [(tree / "train" / "n0" / "small.JPEG").read_bytes()] * 2, "within N: the original bytes"
    manifest = json.loads((dest / "manifest.json").read_text())
    assert (manifest["source"]["max_side"], manifest["source"]["quality"]) == (320, 90)
    assert "images stored at most 320 px a side, JPEG quality 90" in shards_here("summary", dest).stdout
    assert "JPEG quality 90" in shards_here("verify", dest).stdout

    before = {p.name: p.stat().st_mtime_ns for p in dest.glob("*.tar")}
    shards_here("convert", tree, dest, "--splits", "train", "--max-side", "320", "--quality", "90", "--workers", "1")
    assert {p.name: p.stat().st_mtime_ns for p in dest.glob("*.tar")} == before, "the same settings: kept"
    shards_here("convert", tree, dest, "--splits", "train", "--max-side", "256", "--workers", "1")
    assert max(max(size) for size in sides(stored()).values()) == 256, "another N: rebuilt"
    assert json.loads((dest / "manifest.json").read_text())["source"]["max_side"] == 256


def test_a_decompression_bomb_under_max_side_is_rejected_and_named_by_convert_and_summary(tmp_path: Path) -> None:
    tree, dest = tmp_path / "tree", tmp_path / "shards"
    small_tree(tree, {f"train/{cls}/{i}.JPEG": "jpeg" for cls in ("n0", "n1") for i in range(2)})
    (tree / "train" / "n0" / "bomb.png").write_bytes(bomb_png(20000, 20000))
    bomb = "DecompressionBombError: Image size (400000000 pixels) exceeds limit of"
    out = shards_here("convert", tree, dest, "--splits", "train", "--max-side", "64", "--workers", "1")
    assert out.returncode == 0, "as for any other input that cannot be read: listed, and the rest converted"
    lines = out.stdout.strip().splitlines()
    assert lines[-2].startswith(f"  rejected train/n0/bomb.png: {bomb}")
    assert lines[-1] == "train: 4 samples in 1 shard, 1 rejected (listed above and in the manifest)", "said last"
    manifest = json.loads((dest / "manifest.json").read_text())
    assert [r["path"] for r in manifest["splits"]["train"]["rejected"]] == ["train/n0/bomb.png"]
    summary = shards_here("summary", dest).stdout.splitlines()
    train = next(i for i, line in enumerate(summary) if line.startswith("train: imagenet-train-"))
    assert summary[train].endswith("rejected=1")
    assert summary[train + 1].startswith(f"  rejected train/n0/bomb.png: {bomb}"), "summary names it too"


def test_the_quality_of_re_encoded_images_is_recorded_and_used_without_max_side(tmp_path: Path) -> None:
    tree, dest = tmp_path / "tree", tmp_path / "shards"
    for split, cls in [(s, c) for s in ("train", "val") for c in ("n0", "n1")]:
        (tree / split / cls).mkdir(parents=True)
        (tree / split / cls / "flat.JPEG").write_bytes(photo_bytes((300, 200), "PNG"))  # re-encoded
        (tree / split / cls / "photo.JPEG").write_bytes(photo_bytes((300, 200)))  # kept as it is
    out = shards_here("convert", tree, dest, "--quality", "10", "--workers", "1")
    source = json.loads((dest / "manifest.json").read_text())["source"]
    assert source["quality"] == 10 and "max_side" not in source
    said = "images stored as they are, those re-encoded (no RGB or gray JPEG) at JPEG quality 10"
    for text in (out.stdout, shards_here("summary", dest).stdout, shards_here("verify", dest).stdout):
        assert said in text
    at_10 = io.BytesIO()
    Image.open(tree / "train" / "n0" / "flat.JPEG").convert("RGB").save(at_10, format="JPEG", quality=10)
    for shard in dest.glob("imagenet-*.tar"):
        for name, data in members(shard).items():
            if name.startswith("flat") and name.endswith(".jpg"):
                assert Image.open(io.BytesIO(data)).quantization == Image.open(at_10).quantization, "quality 10"
            elif name.endswith(".jpg"):
                assert data == (tree / "train" / "n0" / "photo.JPEG").read_bytes(), "an RGB JPEG keeps its bytes"
    proc = shards_here("convert", tree, dest, "--splits", "val", "--quality", "50", "--workers", "1", check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: {dest}/manifest.json holds train stored with --quality 10 (not --quality 50): convert those splits "
        "too (--splits train,val) or give the same settings (nothing was changed)"
    ]


def test_verify_passes_every_member_training_reads_or_passes_over(tmp_path: Path) -> None:
    # PNG and JPEG images under any of their names, other tools' .json and .txt notes beside them
    names = ["k0.png=png", "k0.cls=1", "k1.jpeg", "k1.cls=2", "k1.json={}", "k1.txt=x", "k2.JPG", "k2.cls=3"]
    shard_holding(tmp_path, [*names, "notes.json={}"], 3)
    assert "all shards match" in shards_here("verify", tmp_path).stdout
    with ShardLoader(str(tmp_path), "train", 3, image_size=32, workers=1, epoch_mode="exact", device="cpu") as loader:
        assert [sorted(batch.labels.tolist()) for batch in loader] == [[1, 2, 3]], "training reads the same 3 samples"


def _rechecked(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header)


def _pax_zero_length() -> bytes:
    body = b"0 path=x\n"
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(body)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + body.ljust(512, b"\0")


def _negative_size() -> bytes:
    header = bytearray(tarfile.TarInfo("k.txt").tobuf(format=tarfile.USTAR_FORMAT))
    header[124:136] = b"\xff" * 12  # base-256: -1
    return _rechecked(header)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [_pax_zero_length, _negative_size])
def test_a_tar_header_that_would_loop_or_read_the_rest_is_a_read_error(make) -> None:
    # a PAX record of length 0 read the same record for ever; a size below 0 read to the stream's end
    from imagenet_ais.shards.members import members

    tail = tarfile.TarInfo("k.jpg").tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 2048
    with pytest.raises(tarfile.ReadError):
        list(members(io.BytesIO(make() + tail)))
