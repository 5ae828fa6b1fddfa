"""What each DataLoader worker does: read its samples of the epoch and make batches of them.

A worker's share of the epoch comes from sampling.py (exact or resampled plans); it reads those
samples from their shards (through the node's cache for remote ones), mixes them in a shuffle
buffer and decodes them: to uint8 pixels (decode "cpu"), or to JPEG bytes plus the crop to
take (decode "gpu": the device decodes; a share of training's samples cropped here all the same,
cpu_share.py). Whole batches cross to the training process (engine.py).
Only image members and the one the manifest's label rule names (``.cls``, ``.txt``, ``.json``)
are read: nothing in a shard is unpickled.
"""

from __future__ import annotations

import functools
import gc
import io
import itertools
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from typing import BinaryIO, cast

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.filters import shuffle
from webdataset.tariterators import group_by_keys

from imagenet_ais.children import exit_with_parent
from imagenet_ais.errors import ConfigError, DataError, StorageError
from imagenet_ais.loader.augment import NO_AUGMENT, Augment
from imagenet_ais.loader.cpu_share import CpuShare, offload
from imagenet_ais.loader.failures import TransformFailed, UnreadableData, raised, shown, transform_name
from imagenet_ais.loader.mixture import Shards, one_source
from imagenet_ais.loader.read_cost import STORE, ReadCost
from imagenet_ais.loader.sampling import (
    Done,
    Piece,
    contiguous_assignment,
    exact_assignment,
    resampled_pieces,
    split_among_workers,
)
from imagenet_ais.loader.signals import Signals
from imagenet_ais.loader.transforms import (
    VAL_CROP,
    augment_on_cpu,
    augment_rng,
    decode_on_cpu,
    encode_for_device,
    pixels_of,
)
from imagenet_ais.shards.cache import ShardCache
from imagenet_ais.shards.labels import LabelRule, image_member
from imagenet_ais.shards.manifest import SplitInfo
from imagenet_ais.shards.members import members
from imagenet_ais.storage import HashingReader, process_store

DECODERS = ("cpu", "gpu", "dali")  # "gpu" and "dali" hand over JPEG bytes and crops
FAILED_IN_A_ROW = 50  # shard reads of a worker that may fail one after another before it gives up
SKIPPED_IN_A_ROW = 1000  # its samples that may fail to decode one after another (none are images?)


def _files(stream: HashingReader, where: str, errors: list[Exception], rule: LabelRule) -> Iterator[dict]:
    """The members ``rule`` reads (images and labels) as webdataset's grouping takes them; a
    member that cannot be read (or must not be: members.py) ends them, its error in ``errors``."""
    try:
        for name, data in members(cast(BinaryIO, stream), rule.wanted):  # (tarfile only reads it)
            yield {"fname": name, "data": data, "__url__": where}
    except Exception as e:  # each storage SDK raises its own errors mid-read (GCS: GoogleAPICallError)
        errors.append(e)


@dataclass
class CacheSpec:
    """Where the node's shard cache lives and how large it may grow (``--cache-dir/--cache-size``)."""

    root: str
    max_bytes: int | None = None


@dataclass
class LoaderSpec:
    """What one rank's loader reads and makes of it (its train and val loaders differ in size only):
    ShardLoader says what to make, the engine adds the split's shards, and each
    worker gets a copy (picklable, for spawned workers too)."""

    world: int
    rank: int
    batch: int
    seed: int
    image_size: int
    decode: str = "cpu"  # or "gpu"/"dali": workers hand over JPEG bytes, the device decodes
    classes: int = 0  # labels must be below this (0: not checked)
    cache: CacheSpec | None = None  # keep remote shards on the node's disk
    val_crop: float = VAL_CROP  # validation's centre square, of the short side (--val-resize-size)
    augment: Augment = NO_AUGMENT  # training only: --auto-augment, --random-erase
    # the split's shards (one source's or a mixture's), where a worker finds its samples; each
    # shard's bytes and SHA-256 in its manifest are checked as it streams
    shards: Shards = field(default_factory=lambda: one_source(SplitInfo(), ""), kw_only=True)
    # per source: the node's cache for remote shards, or None (the engine sets one for each)
    caches: list[ShardCache | None] = field(default_factory=lambda: [None], kw_only=True)
    shuffle: int = field(default=0, kw_only=True)  # samples each worker mixes before batching (0: stored order)
    # of training's samples, cropped in the workers (cpu_share.py): a share or "auto"
    cpu_share: float | str = field(default=0.0, kw_only=True)
    # the caller's own, in place of the crop, flip and augment: the decoded PIL image → the sample's
    transform: Callable[[Image.Image], object] | None = field(default=None, kw_only=True)

    @property
    def counts(self) -> list[int]:
        return self.shards.counts

    @property
    def location(self) -> str:
        """Where the shards are (the sources' locations, for messages)."""
        return " + ".join(self.shards.locations)


class ShardStream(IterableDataset):
    """The samples of this rank for the current epoch, split among DataLoader workers.

    ``signals`` (signals.py) is what it shares with the training process: the epoch and image
    size it sets, the counts the workers keep, and what was wrong, named once per shard and worker.
    """

    def __init__(self, spec: LoaderSpec, mode: str):
        if mode not in ("resampled", "exact", "val"):
            raise ConfigError(f"unknown epoch mode {mode!r}")
        if spec.decode not in DECODERS:
            raise ConfigError(f"unknown decode {spec.decode!r}: one of {', '.join(DECODERS)}")
        self.spec, self.mode = spec, mode
        self.signals = Signals(spec.image_size, len(spec.shards.locations))  # shared with the training process
        self._failing = 0  # (per worker) shard reads that failed in a row, nothing read from them
        self._worker = 0  # (per worker) its index among the loader's workers
        self._told: set[str] = set()  # (per worker) shards already reported
        # a resumed epoch: (epoch, samples trained before the restart, the name that makes its
        # resampled streams fresh ones); set before the workers start, so even persistent
        # workers see it
        self.resumed: tuple[int, Done, str] = (-1, {}, "")
        # (per worker, kept from epoch to epoch)
        self.share = CpuShare(spec.cpu_share, step_wait=self.signals.step_wait)

    def _done(self) -> tuple[Done, str]:
        """What a resumed epoch leaves out, and how its resampled streams are told apart."""
        epoch, done, restart = self.resumed
        return (done, restart) if epoch == self.signals.epoch.value else ({}, "")

    def _pieces(self, worker: int, workers: int) -> Iterator[Piece]:
        s, epoch = self.spec, self.signals.epoch.value
        done, restart = self._done()
        if self.mode == "resampled":
            yield from resampled_pieces(s.counts, f"{s.seed}:{epoch}:{restart}:{s.rank}:{worker}", s.shards.draws)
        if self.mode == "exact":
            mine = exact_assignment(s.counts, s.world, s.batch, s.seed, epoch, done, s.shards.runs)[0][s.rank]
        else:
            mine = contiguous_assignment(s.counts, s.world)[s.rank]
        yield from split_among_workers(mine, workers)[worker]

    def report(self, where: str, problem: str, counter: Synchronized[int] | None) -> None:
        """Name ``where``'s problem once, and count it in ``counter`` (if any) every time."""
        # the line goes first, so that the training process has it once it sees the count
        if where not in self._told:
            self._told.add(where)
            self.signals.problems.put(f"{where}: {problem}")
        if counter is not None:
            self.signals.add(counter)

    def _read_failed(self, where: str, problem: str, unread: int, read_any: bool) -> None:
        """A shard read that failed: reported, its unread samples counted; too many in a row
        with nothing read (the data is gone: a deleted bucket or folder) end the worker."""
        self.report(where, problem, self.signals.read_errors)
        self.signals.add(self.signals.unread, unread)
        self._failing = 0 if read_any else self._failing + 1
        # validation's pieces end: what it misses counts against --max-bad after the epoch is saved
        if self._failing >= FAILED_IN_A_ROW and self.mode != "val":
            raise UnreadableData(
                f"{self.spec.location}: the last {self._failing} shard reads of a loader worker failed, the last "
                f"{where}: {problem}; is the data there? Restore it and continue with --resume auto"
            )

    def _samples(self, piece: Piece) -> Iterator[tuple[int, dict]]:
        shards = self.spec.shards
        where = shards.where(piece.shard)
        errors: list[Exception] = []
        done = self._done()[0].get(piece.shard, set())
        drawn = sum(i not in done for i in range(piece.start, piece.stop))
        self.signals.add(self.signals.drawn, drawn)
        size, sha256 = shards.listed[piece.shard]
        self.signals.read_start(self._worker, piece.shard)
        cost = ReadCost(self.signals, shards.source[piece.shard], functools.partial(self._requests_sent, piece.shard))
        try:
            stream, came_from = self._open(piece.shard, size, cost.fetching)
        except Exception as e:  # after the storage client's own retries
            cost.update(0, 0, 0.0, last=True)  # (the requests it took)
            self.signals.read_start(self._worker, -1)
            self._read_failed(where, f"could not be read, skipped ({e})", drawn, read_any=False)
            return
        cost.opened(came_from, size)
        end = piece.start  # one past the last sample seen
        again = 0  # bytes of samples trained before a resume, read again to reach the others
        with stream:
            hashed = HashingReader(stream)
            # past a broken member nothing is trusted: the rest of the shard is skipped
            rule = shards.rule(piece.shard)
            grouped = group_by_keys(_files(hashed, where, errors, rule), handler=errors.append)
            # (the samples its manifest counts: those its index, or convert, found whole)
            usable = (sample for sample in grouped if rule.problem(sample) is None)
            samples = itertools.islice(enumerate(usable), piece.start, piece.stop)
            try:
                for i, sample in samples:
                    end = i + 1
                    if i not in done:
                        yield i, sample
                    else:
                        again += sum(len(v) for v in sample.values() if isinstance(v, bytes))
                    cost.update(hashed.count, again, hashed.waited)
                if not errors and end == piece.stop:
                    hashed.read_to_end()  # the bytes past this piece, for the shard's checksum
            finally:  # (also when the epoch ends before this piece does)
                cost.update(hashed.count, again, hashed.waited, last=True)
                self.signals.read_start(self._worker, -1)
        unread, read_any = sum(i not in done for i in range(end, piece.stop)), end > piece.start
        if errors:
            self._read_failed(where, f"read failed at sample {end}, the rest skipped ({errors[0]})", unread, read_any)
        elif end < piece.stop:
            listed = self.spec.counts[piece.shard]
            self._read_failed(where, f"ends after {end} samples, the manifest lists {listed}", unread, read_any)
        elif (hashed.count, hashed.sha.hexdigest()) != (size, sha256):
            problem = (
                f"its bytes are not the manifest's ({hashed.count:,} bytes, SHA-256 {hashed.sha.hexdigest()[:12]}…): "
                f"replaced or damaged since it was converted; its {drawn} samples read before the end, where "
                "this can be told, were trained on"
            )
            self._read_failed(where, problem, drawn, read_any)
        else:
            self._failing = 0

    def _open(self, shard: int, size: int, fetching: Callable[[int], object]) -> tuple[BinaryIO, str]:
        """Shard ``shard``, once its size is the manifest's (a copy in the node's cache was
        checked when it was made), and where it came from (read_cost.STORE, or cache.py's HIT...);
        a fetch into the node's cache tells ``fetching`` its bytes as they come."""
        shards = self.spec.shards
        name, source = shards.names[shard], shards.source[shard]
        if cache := self.spec.caches[source]:
            return cache.open(name, fetching)
        store = process_store(shards.locations[source])
        if (stored := store.size(name)) != size:
            raise StorageError(
                f"it is {stored:,} bytes, the manifest lists {size:,}: replaced or damaged since it was converted"
            )
        return store.open(name), STORE

    def _requests_sent(self, shard: int) -> int:
        """The requests this worker's stores of ``shard``'s source have sent (its cache's too)."""
        source = self.spec.shards.source[shard]
        cache = self.spec.caches[source]
        return cache.requests if cache else process_store(self.spec.shards.locations[source]).requests

    def __iter__(self) -> Iterator[tuple[torch.Tensor | tuple, int, str, int, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        self._worker = worker
        self._failing = 0  # (a persistent worker's count starts again each epoch)
        samples = self._decoded(self._pieces(worker, workers))
        if self.spec.shuffle > 1 and self.mode != "val":
            seed = f"buffer:{self.spec.seed}:{self.signals.epoch.value}:{self.spec.rank}:{worker}"
            samples = shuffle(self.spec.shuffle, self.spec.shuffle, seed=seed)(samples)
        if self.mode != "val" and self.spec.decode != "cpu" and self.spec.cpu_share:
            samples = offload(samples, self.share, self.signals.size.value, self.signals.cropped, self._crop_failed)
        return samples

    def _decoded(self, pieces: Iterator[Piece]) -> Iterator[tuple[torch.Tensor | tuple, int, str, int, int]]:
        train, size = self.mode != "val", self.signals.size.value
        skipped = 0  # in a row: a resampled epoch of images none can decode would wait for ever
        for piece in pieces:
            for index, sample in self._samples(piece):
                try:
                    image, label = self._decode(sample, train, size, piece.shard)
                except (StopIteration, KeyError, ValueError, OSError, SyntaxError, Image.DecompressionBombError) as e:
                    what = "no image member" if isinstance(e, StopIteration) else f"{type(e).__name__}: {e}"
                    self._skip(piece.shard, sample["__key__"], what)
                    skipped += 1
                    if skipped >= SKIPPED_IN_A_ROW and train:
                        raise UnreadableData(
                            f"{self.spec.location}: none of the last {skipped} samples a loader worker read could be "
                            f"decoded, the last {sample['__key__']!r}: {what}; are these the shards convert wrote? "
                            "Check them with imagenet_shards.py verify"
                        ) from None
                    continue
                skipped = 0
                if self.spec.transform is not None:
                    image = self._transformed(image, sample["__key__"], piece.shard)  # type: ignore[arg-type]
                yield image, label, sample["__key__"], piece.shard, index

    def _transformed(self, image: Image.Image, key: str, shard: int) -> torch.Tensor:
        """The caller's transform of a decoded image, as the batch takes it: uint8 H×W×3 (from a
        PIL image or a uint8 3×H×W tensor: normalised later as the loader's own crops are), or a
        float 3×H×W tensor, taken as it is."""
        where = f"{self.spec.shards.where(shard)}: the transform {transform_name(self.spec.transform)}"
        try:
            out = self.spec.transform(image)  # type: ignore[misc]
        except BaseException as e:
            # SystemExit or KeyboardInterrupt would end a worker with no word (a worker "killed"), but
            # in this process (no workers) they are the caller's to have
            if not isinstance(e, Exception) and get_worker_info() is None:
                raise
            raise TransformFailed(f"{where} raised on sample {key!r}: {raised(e)}") from None
        if isinstance(out, Image.Image):
            return pixels_of(out.convert("RGB"))
        if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[0] == 3:
            if out.dtype == torch.uint8:
                return out.permute(1, 2, 0).contiguous()
            if out.is_floating_point():
                return out.float().contiguous()
        raise TransformFailed(
            f"{where} gave {shown(out)} for sample {key!r}: return a PIL image, or a uint8 or float 3×H×W tensor"
        )

    def _skip(self, shard: int, key: str, what: str) -> None:
        """A sample that cannot be decoded: named once, counted, not trained on."""
        self.report(self.spec.shards.where(shard), f"sample {key!r} skipped ({what})", self.signals.skipped)

    def _crop_failed(self, sample: tuple, what: str) -> None:
        self._skip(sample[3], sample[2], what)  # (image, label, key, shard, index)

    def _decode(self, sample: dict, train: bool, size: int, shard: int) -> tuple[torch.Tensor | tuple, int]:
        data = image_member(sample)
        label = self.spec.shards.label_of(shard, sample)  # (a mixture's: mapped to the merged classes)
        if self.spec.classes and not 0 <= label < self.spec.classes:
            raise DataError(f"label {label} is not among the manifest's {self.spec.classes} classes")
        drawn_as = self.spec.shards.drawn_as(shard, sample["__key__"])  # (a mixture's second pass: its own crop)
        rng = augment_rng(self.spec.seed, self.signals.epoch.value, drawn_as) if train else None
        augment = self.spec.augment  # drawn and applied only with rng, i.e. in training
        if self.spec.transform is not None:  # the whole picture: the caller's transform crops
            with Image.open(io.BytesIO(data)) as img:
                return img.convert("RGB"), label
        if self.spec.decode != "cpu":
            raw, box = encode_for_device(data, rng, self.spec.val_crop)
            # drawn after the crop, from the same generator, as on the CPU path
            return (raw, box, augment.draw(rng, size) if rng and augment else []), label
        pixels = decode_on_cpu(data, size, rng, self.spec.val_crop)
        if rng and augment:
            pixels = augment_on_cpu(pixels, augment, augment.draw(rng, size))
        return pixels, label


def worker_init(_: int, parent: int) -> None:
    # Preemption signals and Ctrl-C (sent to the terminal's whole process group) are the training
    # process's to handle (checkpoint, then exit); a worker dying of one first would only turn
    # that into a DataLoader error.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    exit_with_parent(parent)  # ignoring SIGTERM, a worker must still end with a training killed outright
    # What it starts with (forked: the training process's torch and model, some 430,000 objects on
    # a GPU host) lives as long as it does; each full collection walked it all, 220-340 ms, and
    # every worker started one at about the same step, stalling the feed (bench/RESULTS.md run BE).
    gc.freeze()
