"""Shard writing: an ImageFolder tree → shuffled WebDataset tar shards + manifest.

Shards are planned up front (inputs.py), so each one can be built in its own process, named
before it exists, and skipped on a re-run when a complete, checksum-verified copy with the same
plan is already at the destination.
"""

from __future__ import annotations

import errno
import io
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, UnidentifiedImageError

from imagenet_ais.children import worker_pool
from imagenet_ais.errors import ConfigError, DataError, StorageError
from imagenet_ais.shards import progress, synth
from imagenet_ais.shards.inputs import AS_GIVEN, Seen, ShardPlan, Stored, check_counts, list_classes, plan_split
from imagenet_ais.shards.manifest import (
    MANIFEST,
    Manifest,
    ShardInfo,
    SplitInfo,
    load_manifest,
    parse_record,
    record_json,
)
from imagenet_ais.shards.members import MAX_MEMBER_BYTES
from imagenet_ais.storage import LocalStore, Store, open_store, process_store, stream_sha256
from imagenet_ais.storage.locks import LOCK, lock_dest

JOURNAL = "_progress/"  # all ours: per-shard records of a conversion in flight, gone once the manifest is up
SET_ASIDE = f"{JOURNAL}{MANIFEST}"  # the manifest a run started from, kept out of readers' sight meanwhile

SCRATCH = (".imagenet-*.partial", f".{MANIFEST}.*.partial")  # LocalStore.scratch_file's names for ours
Record = tuple[ShardInfo, list[dict[str, str]]]  # a shard built, and the inputs it rejected
DISK_FULL = (errno.ENOSPC, errno.EFBIG)


def as_training_jpeg(data: bytes, stored: Stored = AS_GIVEN) -> bytes:
    """The bytes to store for an input image: the original when it is an RGB or gray JPEG within
    ``stored.max_side``, else an RGB JPEG re-encoding (resized to the max side, with Pillow's
    LANCZOS filter). Raises ValueError with the reason when it is unreadable."""
    if not data:
        raise DataError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as img:
            side = stored.max_side
            target = None if side is None or max(img.size) <= side else _within(img.size, side)
            if img.format == "JPEG" and img.mode in ("RGB", "L") and target is None:
                # Reduced-scale decoding still walks the whole scan, so truncation shows.
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
                return data
            if target and img.format == "JPEG":
                img.draft(img.mode, target)  # decoded at a power-of-2 scale no smaller than the target
            pixels: Image.Image = img
            if img.mode.startswith("I"):
                # 16-bit gray (PNG, TIFF): Pillow's convert clips at 255, i.e. nearly all white
                pixels = Image.fromarray((np.asarray(img, dtype=np.int64).clip(0, 65535) // 257).astype(np.uint8))
            rgb = pixels.convert("RGB")
            if target:
                rgb = rgb.resize(target, Image.Resampling.LANCZOS)
    except UnidentifiedImageError as e:
        raise DataError("not an image format Pillow can read") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{type(e).__name__}: {e}") from e
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=stored.quality)
    return out.getvalue()


def _within(size: tuple[int, int], side: int) -> tuple[int, int]:
    """``size`` scaled so that its longer side is ``side``, the aspect kept."""
    scale = side / max(size)
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def file_sha256(path: Path) -> str:
    return stream_sha256(path.open("rb"))


def _disk_full(e: OSError, path: object, store: Store) -> StorageError:
    """ENOSPC or EFBIG while writing ``path`` for ``store``, as one line saying what to do."""
    where = f"DEST {store.url}" if isinstance(store, LocalStore) else f"the scratch disk of {store.url} (see TMPDIR)"
    if e.errno == errno.ENOSPC:
        return StorageError(f"no space left on {where} writing {path}: free some space or convert elsewhere")
    return StorageError(
        f"{path}: file too large for {where} (a file-size limit, see ulimit -f, or the file system's): "
        "raise the limit or lower --maxsize"
    )


def _source_bytes(path: Path) -> bytes:
    """A source image's bytes; one larger than a sample may be (a sparse file declaring gigabytes)
    is refused unread, as in shards (the plan already left out what is no regular file)."""
    if (size := path.stat().st_size) > MAX_MEMBER_BYTES:
        raise DataError(f"{size:,} bytes, over the {MAX_MEMBER_BYTES:,} a sample may have: not read")
    return path.read_bytes()


def build_shard(src: Path, dest_url: str, plan: ShardPlan) -> tuple[Path, Record]:
    """Build one shard in ``dest_url``'s scratch space (in a worker process): the file, and what
    it holds and what was rejected."""
    store = process_store(dest_url)
    rejected: list[dict[str, str]] = []
    tmp = store.scratch_file(plan.name)
    try:
        count = 0
        with tmp.open("wb") as f, wds.TarWriter(f, mtime=0) as tar:
            for item in plan.items:
                try:
                    jpeg = as_training_jpeg(_source_bytes(src / item.rel), plan.stored)
                except (OSError, ValueError) as e:
                    rejected.append({"path": item.rel, "reason": str(e)})
                    continue
                tar.write({"__key__": item.key, "jpg": jpeg, "cls": str(item.cls).encode()})
                count += 1
        return tmp, (ShardInfo(plan.name, count, tmp.stat().st_size, file_sha256(tmp), plan.digest), rejected)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise _disk_full(e, tmp, store) from None
        raise


def publish_shard(dest_url: str, tmp: Path, record: Record, read_back: bool = False) -> Record:
    """Put a built shard under its final name (in an upload process; its scratch file is gone
    after); with ``read_back``, read the published copy in full and compare its SHA-256 too
    (stores already compare a checksum the storage computed: this also covers a storage that
    computed one over the wrong bytes)."""
    store = process_store(dest_url)
    info, rejected = record
    try:
        # The record goes first: a shard under its final name always has one, so a re-run
        # can verify it instead of rebuilding it (a record without its shard is just ignored).
        store.write_bytes(f"{JOURNAL}{info.name}.json", record_json(info, rejected))
        store.put_file(tmp, info.name)
        if read_back and info.problem(store):
            store.delete(info.name)
            raise StorageError(f"{store.url}/{info.name}: read back, it differs from the shard written; deleted")
    except OSError as e:
        if e.errno in DISK_FULL:
            raise _disk_full(e, tmp, store) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return record


def _read_manifests(store: Store) -> tuple[Manifest | None, Manifest | None]:
    """DEST's published manifest and the one a run in progress set aside, if any. A published
    one that this tool did not write stops the run, untouched."""
    try:
        published = load_manifest(store) if store.exists(MANIFEST) else None
    except ValueError as e:
        raise DataError(
            f"{store.url}/{MANIFEST} is not a manifest written by imagenet_shards.py ({e}): "
            "convert into an empty DEST (nothing was changed)"
        ) from None
    set_aside = None
    if store.exists(SET_ASIDE):
        set_aside = Manifest.from_json(store.read_bytes(SET_ASIDE).decode(), f"{store.url}/{SET_ASIDE}")
    return published, set_aside


def _refuse_foreign(store: Store, known: dict[str, Record]) -> None:
    """Files in DEST that no manifest or journal of ours names are someone else's: refuse."""
    foreign = [n for n in store.list() if n not in (MANIFEST, LOCK) and n not in known and not n.startswith(JOURNAL)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataError(
            f"{store.url} holds files imagenet_shards.py did not write ({shown}): "
            "convert into an empty DEST, or into one this tool made (nothing was changed)"
        )


def _journal(store: Store) -> dict[str, Record]:
    """The shards runs built since the last manifest went up, by name (a record goes up before its shard)."""
    records: dict[str, Record] = {}
    for name in store.list(JOURNAL):
        if name != SET_ASIDE:  # records go up whole (a rename, a PUT): a malformed one is no kill's doing
            info, rejected = parse_record(store.read_bytes(name), f"{store.url}/{name}")
            records[info.name] = (info, rejected)
    return records


def _known_records(manifests: list[Manifest], journal: dict[str, Record]) -> dict[str, Record]:
    """Shards earlier runs finished: from their manifests and from the journal (newer)."""
    known: dict[str, Record] = {}
    for manifest in manifests:
        for split in manifest.splits.values():
            for shard in split.shards:
                mine = [r for r in split.rejected if r.get("shard") == shard.name]
                known[shard.name] = (shard, mine)
    return {**known, **journal}


def _refuse_rewritten(kept: dict[str, SplitInfo], journal: dict[str, Record], converting: list[str]) -> None:
    """A split kept from the manifest of a run that stopped may have had shards rewritten since."""
    for split, info in kept.items():
        if any(journal.get(s.name, (s,))[0] != s for s in info.shards):
            raise DataError(
                f"{split} was being rewritten when a run stopped: add it to --splits "
                f"(--splits {','.join([*converting, split])}; nothing was changed)"
            )


def _tidy(store: Store, manifest: Manifest, known: dict[str, Record], check_lock: Callable[[], None]) -> None:
    """After ``manifest`` is published: drop shards of ours it does not name, then the journal."""
    check_lock()
    wanted = {s.name for split in manifest.splits.values() for s in split.shards}
    for name in store.list("imagenet-"):
        if name in known and name not in wanted:  # ours (refused otherwise), named by no manifest now
            store.delete(name)
    for name in store.list(JOURNAL):
        if name != SET_ASIDE:
            store.delete(name)
    store.delete(SET_ASIDE)  # last: until here it names shards that may still be there


def _check_published(store: Store, manifest: Manifest) -> None:
    """Just before the manifest goes up: every shard it names is there at its size, and is the
    one its journal record (if any: the last one put under that name) describes."""
    journal = _journal(store)
    for shard in (s for split in manifest.splits.values() for s in split.shards):
        problem = shard.size_problem(store)
        if not problem and shard.name in journal and journal[shard.name][0] != shard:
            problem = "its journal record describes another shard"
        if problem:
            raise StorageError(
                f"{store.url}/{shard.name}: {problem} at the end of the run (changed by something else "
                "meanwhile?): no manifest was written; run convert again"
            )


def _labels(plans: list[ShardPlan], results: dict[str, Record] | None = None) -> Iterator[int]:
    """The class of each sample planned, or (given the results) of each sample written."""
    for plan in plans:
        dropped = {r["path"] for r in results[plan.name][1]} if results else set()
        yield from (item.cls for item in plan.items if item.rel not in dropped)


def convert(
    src: Path,
    dest_url: str,
    splits: list[str],
    maxcount: int,
    maxsize: int,
    workers: int,
    seed: int,
    allow_empty: bool = False,
    read_back: bool = False,
    stored: Stored = AS_GIVEN,
) -> Manifest:
    if not splits:
        raise ConfigError("--splits names no split: give the split folders of SRC, e.g. --splits train,val")
    if twice := sorted({s for s in splits if splits.count(s) > 1}):
        raise ConfigError(f"--splits names {', '.join(twice)} more than once: name each split once")
    store = open_store(dest_url)
    if isinstance(store, LocalStore) and store.root.resolve().is_relative_to(src.resolve()):
        raise ConfigError(
            f"DEST {store.url} is inside SRC {src}: its files would be read as inputs on the next run; "
            "choose a DEST outside SRC (nothing was changed)"
        )
    classes = list_classes(src)
    seen = Seen(src)  # across splits: nothing is read twice
    plans = {split: plan_split(src, split, classes, seed, maxcount, maxsize, seen, stored) for split in splits}
    for split, (split_plans, _) in plans.items():
        if not allow_empty:
            check_counts(split, classes, _labels(split_plans))
    # the quality too where no image is resized: CMYK, PNG and other files are re-encoded at it
    source: dict[str, object] = {"seed": seed, "maxcount": maxcount, "maxsize": maxsize, "quality": stored.quality}
    if stored.max_side is not None:
        source["max_side"] = stored.max_side
    if made := synth.description(src):
        source["synthetic"] = made
    try:
        with lock_dest(store) as lock:
            return _convert_locked(store, src, classes, plans, source, workers, read_back, allow_empty, lock.check)
    except OSError as e:  # the journal, the manifest: small files, but a full disk is a full disk
        if e.errno in DISK_FULL:
            raise _disk_full(e, store.url, store) from None
        raise


def _settings(source: dict[str, object]) -> str:
    """How a manifest's ``source`` says its images were stored, as convert's options (a manifest
    made before the quality was recorded without --max-side: at the default, as far as it says)."""
    side = f"--max-side {source['max_side']} " if source.get("max_side") else ""
    return f"{side}--quality {source.get('quality', AS_GIVEN.quality)}"


def _convert_locked(
    store: Store,
    src: Path,
    classes: list[str],
    plans: dict[str, tuple[list[ShardPlan], list[dict[str, str]]]],
    source: dict[str, object],
    workers: int,
    read_back: bool,
    allow_empty: bool,
    check_lock: Callable[[], None],
) -> Manifest:
    published, set_aside = _read_manifests(store)
    journal = _journal(store)
    known = _known_records([m for m in (set_aside, published) if m], journal)
    _refuse_foreign(store, known)
    old = published or set_aside
    # splits of an earlier run that this one does not convert stay as they are
    kept = {name: info for name, info in (old.splits.items() if old else []) if name not in plans}
    if kept and old and old.classes != classes:
        raise DataError(
            f"{store.url}/{MANIFEST} holds {', '.join(kept)} labelled with other classes than {src} has: "
            f"convert those splits too (--splits {','.join([*kept, *plans])}) or use another DEST "
            "(nothing was changed)"
        )
    if kept and old and (was := _settings(old.source)) != (now := _settings(source)):
        raise DataError(
            f"{store.url}/{MANIFEST} holds {', '.join(kept)} stored with {was} (not {now}): convert those splits "
            f"too (--splits {','.join([*kept, *plans])}) or give the same settings (nothing was changed)"
        )
    _refuse_rewritten(kept, journal, list(plans))
    _remove_scratch(store)  # a killed run's
    if published:
        _tidy(store, published, known, check_lock)  # a run killed while tidying up: finish that first
        # Readers must not see a manifest naming shards this run may rewrite; the journal keeps
        # it (a run that fails still knows the shards, and the splits it keeps, next time).
        store.write_bytes(SET_ASIDE, store.read_bytes(MANIFEST))
        store.delete(MANIFEST)
    results = _build(store, src, [p for ps, _ in plans.values() for p in ps], known, workers, read_back)

    kept_counts = {name: c for name, c in old.class_counts.items() if name in kept} if old else {}
    manifest = Manifest(classes, dict(kept), source, class_counts=kept_counts)
    for split, (split_plans, unread) in plans.items():
        if not allow_empty:  # again: every file of a class may have been rejected
            check_counts(split, classes, _labels(split_plans, results))
        info = SplitInfo(rejected=list(unread))
        manifest.class_counts[split] = []
        for plan in split_plans:
            shard, rejected = results[plan.name]
            info.shards.append(shard)
            info.rejected.extend({**r, "shard": plan.name} for r in rejected)
            per_class = Counter(str(c) for c in _labels([plan], results))  # (the shuffle-quality figure's)
            manifest.class_counts[split].append(dict(sorted(per_class.items(), key=lambda kv: int(kv[0]))))
        manifest.splits[split] = info
    _check_published(store, manifest)
    check_lock()
    store.write_bytes(MANIFEST, manifest.to_json().encode())
    _tidy(store, manifest, known, check_lock)
    return manifest


def _build(
    store: Store, src: Path, plans: list[ShardPlan], known: dict[str, Record], workers: int, read_back: bool
) -> dict[str, Record]:
    """Every planned shard: kept when a verified copy built from the same inputs is there, else built.

    Worker processes build shards while as many other processes put the built ones up, so
    uploads overlap the building of the next shards; at most twice ``workers`` shards are built or
    going up at once (scratch space). Processes, not threads here: 16 uploading threads sharing
    this process's interpreter lock were the conversion's limit."""
    results: dict[str, Record] = {}
    todo: list[ShardPlan] = []
    for plan in plans:
        record = known.get(plan.name)
        if record and record[0].plan == plan.digest and not record[0].problem(store):
            results[plan.name] = record
        else:
            todo.append(plan)
    rebuilt = sum(plan.name in known for plan in todo)
    print(
        f"convert → {store.url}: {len(results)} shards kept (verified, from the same inputs), {rebuilt} rebuilt, "
        f"{len(todo) - rebuilt} new",
        file=sys.stderr,
    )
    total = sum(len(p.items) for p in todo)
    queued = iter(todo)
    building: dict[Future, ShardPlan] = {}
    publishing: dict[Future, tuple[ShardPlan, Path]] = {}
    try:
        with (
            progress.bar(total, f"convert → {store.url}", "images") as bar,
            worker_pool(workers) as pool,
            worker_pool(workers) as uploads,
        ):
            try:
                while True:
                    while len(building) + len(publishing) < 2 * max(1, workers) and (step := next(queued, None)):
                        building[pool.submit(build_shard, src, store.url, step)] = step
                    if not building and not publishing:
                        break
                    for future in wait([*building, *publishing], return_when=FIRST_COMPLETED).done:
                        if future in building:
                            plan = building.pop(future)
                            tmp, record = future.result()
                            try:
                                upload = uploads.submit(publish_shard, store.url, tmp, record, read_back)
                                publishing[upload] = (plan, tmp)
                            except BaseException:
                                tmp.unlink(missing_ok=True)
                                raise
                        else:
                            plan, _ = publishing[future]
                            results[plan.name] = future.result()  # if it raises, its scratch file is removed below
                            del publishing[future]
                            bar.update(len(plan.items))
            except BaseException:
                for future in [*building, *publishing]:  # fail now, not after building every shard still queued
                    future.cancel()
                raise
    except BaseException:
        # scratch files of shards built but never put up
        for future in building:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result()[0].unlink(missing_ok=True)
        # the pools are shut down by now: an upload that ran removed its own; one cancelled, or
        # lost with its process (killed, or its error unpicklable), did not
        for _, tmp in publishing.values():
            tmp.unlink(missing_ok=True)
        _remove_scratch(store)  # those of uploads whose process was killed, or terminated with its broken pool
        raise
    return results


def _remove_scratch(store: Store) -> None:
    """This tool's scratch files in a local DEST, while none of its processes writes there (DEST's
    lock keeps other runs out). An object store's are in the temp directory."""
    if isinstance(store, LocalStore):
        for pattern in SCRATCH:
            for left in store.root.glob(pattern):
                left.unlink(missing_ok=True)
