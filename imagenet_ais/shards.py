"""Shard writing: an ImageFolder tree → shuffled WebDataset tar shards + manifest, and verify.

Shards are planned up front (a seeded shuffle cut by --maxcount/--maxsize), so each one can be
built in its own process, named before it exists, and skipped on a re-run when a complete,
checksum-verified copy with the same plan is already at the destination.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import tarfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from imagenet_ais.manifest import MANIFEST, Manifest, ShardInfo, SplitInfo, load_manifest
from imagenet_ais.storage import Store, open_store, stream_sha256

JOURNAL = "_progress"  # per-shard records of a conversion in flight; removed once the manifest is written
TAR_OVERHEAD = 1536  # header + padding for the two members of a sample, for --maxsize planning
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass
class ShardPlan:
    name: str
    items: list[tuple[str, str, int]]  # (path relative to SRC, key, class index)

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self.items).encode()).hexdigest()[:16]


def shard_name(split: str, index: int) -> str:
    return f"imagenet-{split}-{index:06d}.tar"


def list_classes(src: Path) -> list[str]:
    train = src / "train"
    if not train.is_dir():
        raise FileNotFoundError(f"{train} not found: SRC must hold train/<wnid>/ folders (ImageFolder layout)")
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    if not classes:
        raise FileNotFoundError(f"{train} has no class folders")
    return classes


def plan_split(src: Path, split: str, classes: list[str], seed: int, maxcount: int, maxsize: int) -> list[ShardPlan]:
    root = src / split
    if not root.is_dir():
        raise FileNotFoundError(f"{root} not found: create it or leave {split!r} out of --splits")
    index = {wnid: i for i, wnid in enumerate(classes)}
    files: list[tuple[str, int, int]] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name not in index:
            raise ValueError(f"{folder}: class {folder.name!r} is not among the train classes")
        for f in sorted(folder.iterdir()):
            if f.is_file():
                files.append((f"{split}/{folder.name}/{f.name}", index[folder.name], f.stat().st_size))
    random.Random(f"{seed}:{split}").shuffle(files)

    plans: list[ShardPlan] = []
    used: set[str] = set()
    items: list[tuple[str, str, int]] = []
    size = 0
    for rel, cls, nbytes in files:
        if items and (len(items) >= maxcount or size + nbytes + TAR_OVERHEAD > maxsize):
            plans.append(ShardPlan(shard_name(split, len(plans)), items))
            items, size = [], 0
        items.append((rel, unique_key(rel, used), cls))
        size += nbytes + TAR_OVERHEAD
    if items:
        plans.append(ShardPlan(shard_name(split, len(plans)), items))
    return plans


def unique_key(rel: str, used: set[str]) -> str:
    """A member-safe key: no '/', '..' or '.' (webdataset splits keys at the first dot)."""
    base = re.sub(r"[^A-Za-z0-9_-]", "_", Path(rel).name.split(".")[0]) or "sample"
    key, n = base, 1
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


def as_training_jpeg(data: bytes) -> bytes:
    """The bytes to store for an input image: the original when it is an RGB or gray JPEG,
    else an RGB JPEG re-encoding. Raises ValueError with the reason when it is unreadable."""
    if not data:
        raise ValueError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format == "JPEG" and img.mode in ("RGB", "L"):
                # Reduced-scale decoding still walks the whole scan, so truncation shows.
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
                return data
            if img.mode.startswith("I"):
                # 16-bit gray (PNG, TIFF): Pillow's convert clips at 255, i.e. nearly all white
                img = Image.fromarray((np.asarray(img, dtype=np.int64).clip(0, 65535) // 257).astype(np.uint8))
            rgb = img.convert("RGB")
    except UnidentifiedImageError as e:
        raise ValueError("not an image format Pillow can read") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=95)
    return out.getvalue()


def file_sha256(path: Path) -> str:
    return stream_sha256(path.open("rb"))


def write_shard(src: Path, dest_url: str, plan: ShardPlan) -> tuple[ShardInfo, list[dict[str, str]]]:
    """Build one shard in scratch space, then publish it under its final name."""
    store = open_store(dest_url)
    rejected: list[dict[str, str]] = []
    tmp = store.scratch_file(plan.name)
    try:
        count = 0
        with tmp.open("wb") as f, wds.TarWriter(f, mtime=0) as tar:
            for rel, key, cls in plan.items:
                try:
                    jpeg = as_training_jpeg((src / rel).read_bytes())
                except (OSError, ValueError) as e:
                    rejected.append({"path": rel, "reason": str(e)})
                    continue
                tar.write({"__key__": key, "jpg": jpeg, "cls": str(cls).encode()})
                count += 1
        info = ShardInfo(plan.name, count, tmp.stat().st_size, file_sha256(tmp), plan.digest)
        # The record goes first: a shard under its final name always has one, so a re-run
        # can verify it instead of rebuilding it (a record without its shard is just ignored).
        record = {"shard": asdict(info), "rejected": rejected}
        store.write_bytes(f"{JOURNAL}/{plan.name}.json", json.dumps(record).encode())
        store.put_file(tmp, plan.name)
    finally:
        tmp.unlink(missing_ok=True)
    return info, rejected


def _our_manifest(store: Store) -> Manifest | None:
    """DEST's manifest, if any; one that this tool did not write stops the run, untouched."""
    if not store.exists(MANIFEST):
        return None
    try:
        return load_manifest(store)
    except ValueError as e:
        raise ValueError(
            f"{store.url}/{MANIFEST} is not a manifest written by imagenet_shards.py ({e}): "
            "convert into an empty DEST (nothing was changed)"
        ) from None


def _refuse_foreign(store: Store, known: dict[str, object]) -> None:
    """Files in DEST that no manifest or journal of ours names are someone else's: refuse."""
    ours = re.compile(rf"{JOURNAL}/imagenet-\w+-\d{{6}}\.tar\.json")  # records, also ones cut short
    foreign = [n for n in store.list() if n != MANIFEST and n not in known and not ours.fullmatch(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(
            f"{store.url} holds files imagenet_shards.py did not write ({shown}): "
            "convert into an empty DEST, or into one this tool made (nothing was changed)"
        )


def _known_records(store: Store, old: Manifest | None) -> dict[str, tuple[ShardInfo, list[dict[str, str]]]]:
    """Shards a previous run finished: from its manifest and from its journal."""
    known: dict[str, tuple[ShardInfo, list[dict[str, str]]]] = {}
    if old:
        for split in old.splits.values():
            for shard in split.shards:
                mine = [r for r in split.rejected if r.get("shard") == shard.name]
                known[shard.name] = (shard, mine)
    for name in store.list(f"{JOURNAL}/"):
        try:
            record = json.loads(store.read_bytes(name))
            info = ShardInfo(**record["shard"])
        except (ValueError, KeyError, TypeError):
            continue  # a record cut short by a kill: the shard is simply rebuilt
        known[info.name] = (info, record["rejected"])
    return known


def _still_good(store: Store, info: ShardInfo) -> bool:
    if not store.exists(info.name) or store.size(info.name) != info.bytes:
        return False
    return stream_sha256(store.open(info.name)) == info.sha256


def convert(
    src: Path, dest_url: str, splits: list[str], maxcount: int, maxsize: int, workers: int, seed: int
) -> Manifest:
    if not splits:
        raise ValueError("--splits names no split: give the split folders of SRC, e.g. --splits train,val")
    store = open_store(dest_url)
    old = _our_manifest(store)
    known = _known_records(store, old)
    _refuse_foreign(store, known)
    classes = list_classes(src)
    # splits of an earlier run that this one does not convert stay as they are
    kept = {name: info for name, info in (old.splits.items() if old else []) if name not in splits}
    if kept and old and old.classes != classes:
        raise ValueError(
            f"{store.url}/{MANIFEST} holds {', '.join(kept)} labelled with other classes than {src} has: "
            f"convert those splits too (--splits {','.join([*kept, *splits])}) or use another DEST "
            "(nothing was changed)"
        )
    plans = {split: plan_split(src, split, classes, seed, maxcount, maxsize) for split in splits}
    if old:
        # The old manifest may name shards this run rewrites: readers must not see it meanwhile.
        store.delete(MANIFEST)
    results: dict[str, tuple[ShardInfo, list[dict[str, str]]]] = {}
    todo: list[ShardPlan] = []
    for plan in (p for ps in plans.values() for p in ps):
        record = known.get(plan.name)
        if record and record[0].plan == plan.digest and _still_good(store, record[0]):
            results[plan.name] = record
        else:
            todo.append(plan)
    total = sum(len(p.items) for p in todo)
    with (
        tqdm(total=total, unit="img", desc=f"convert → {dest_url}", disable=total == 0) as bar,
        ProcessPoolExecutor(max_workers=max(1, workers)) as pool,
    ):
        futures = {pool.submit(write_shard, src, dest_url, plan): plan for plan in todo}
        for future in as_completed(futures):
            results[futures[future].name] = future.result()
            bar.update(len(futures[future].items))

    manifest = Manifest(classes, dict(kept), {"seed": seed, "maxcount": maxcount, "maxsize": maxsize})
    for split, split_plans in plans.items():
        info = SplitInfo()
        for plan in split_plans:
            shard, rejected = results[plan.name]
            info.shards.append(shard)
            info.rejected.extend({**r, "shard": plan.name} for r in rejected)
        manifest.splits[split] = info
    store.write_bytes(MANIFEST, manifest.to_json().encode())
    # Only now is it safe to drop what no manifest names any more.
    wanted = {s.name for split in manifest.splits.values() for s in split.shards}
    for name in store.list("imagenet-"):
        if name in known and name not in wanted:  # ours (refused otherwise), named by no manifest now
            store.delete(name)
    for name in store.list(f"{JOURNAL}/"):
        store.delete(name)
    return manifest


def iter_members(stream: io.BufferedIOBase) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            f = tar.extractfile(member)
            yield member.name, f.read() if f else b""


def check_shard(dest_url: str, info: ShardInfo, num_classes: int) -> str | None:
    """None when the shard matches its manifest entry and every image decodes; else the problem."""
    store = open_store(dest_url)
    if not store.exists(info.name):
        return "missing"
    if (size := store.size(info.name)) != info.bytes:
        return f"size {size} != manifest {info.bytes}"
    if (digest := stream_sha256(store.open(info.name))) != info.sha256:
        return f"sha256 {digest[:12]}… != manifest {info.sha256[:12]}…"
    samples: dict[str, set[str]] = {}
    try:
        with store.open(info.name) as f:
            for name, data in iter_members(f):
                key, _, ext = name.partition(".")
                if "/" in name or ".." in name or not key:
                    return f"bad member name {name!r}"
                if ext == "jpg":
                    with Image.open(io.BytesIO(data)) as img:
                        img.load()
                elif ext == "cls" and not 0 <= int(data) < num_classes:
                    return f"{name}: class {int(data)} out of range"
                samples.setdefault(key, set()).add(ext)
    except (OSError, ValueError, tarfile.TarError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if incomplete := [k for k, exts in samples.items() if exts != {"jpg", "cls"}]:
        return f"sample {incomplete[0]!r} lacks .jpg or .cls"
    if len(samples) != info.samples:
        return f"{len(samples)} samples != manifest {info.samples}"
    return None


def verify(dest_url: str, workers: int) -> dict[str, str]:
    """Problems by shard name (empty when all is well)."""
    store = open_store(dest_url)
    manifest = load_manifest(store)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    problems: dict[str, str] = {}
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(check_shard, dest_url, s, len(manifest.classes)): s for s in shards}
        for future in tqdm(as_completed(futures), total=len(futures), unit="shard", desc=f"verify {dest_url}"):
            if problem := future.result():
                problems[futures[future].name] = problem
    return problems
