"""The data pipeline: manifest shards → per-rank, per-epoch sample streams → batches.

Two epoch modes, both giving every rank the same number of steps so DDP never hangs (the
plans are in sampling.py):

- resampled: each DataLoader worker draws shards with replacement (weighted by their sample
  counts) forever; an epoch is a nominal ceil(N / (world × batch)) steps, N the manifest's
  count or ``--epoch-size`` (the old ``ResizedDataset(..., nominal=N)``).
- exact: every sample is read at most once per epoch, in steps = N // (world × batch) steps;
  fewer than one global batch sit each epoch out, other ones every epoch. A resumed epoch
  trains what the interrupted one had not, on any topology.

Each DataLoader worker reads its share of the epoch and hands over whole batches (worker.py).
In the training process one feed thread receives them (wire.py: training's JPEG bytes in place,
in the workers' page-locked buffers; others it pins), pooling workers' short last batches, while
others make them ready on the device (decode, then crop: device_decode.py), ahead of the step
(device_feed.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.signal_handling import _remove_worker_pids as remove_worker_pids

from imagenet_ais.errors import DataError
from imagenet_ais.loader import wire
from imagenet_ais.loader.cpu_share import AUTO, LIMIT
from imagenet_ais.loader.dali_decode import DaliCrops, DaliFailed
from imagenet_ais.loader.device_decode import Decoded, crop_decoded, decode_encoded, decode_together
from imagenet_ais.loader.device_feed import DeviceFeed, Merged, Stage, close_all
from imagenet_ais.loader.failures import Stalled, TransformFailed, UnreadableData, WorkerDied
from imagenet_ais.loader.mixture import Shards
from imagenet_ais.loader.sampling import Done, exact_assignment, trained
from imagenet_ais.loader.transforms import memory_format, normalize
from imagenet_ais.loader.wire import Encoded, HostBatch, Slots
from imagenet_ais.loader.worker import (
    LoaderSpec,
    ShardStream,
    worker_init,
)
from imagenet_ais.shards.cache import ShardCache
from imagenet_ais.storage import is_local

CPU = torch.device("cpu")


def nominal_steps(samples: int, world: int, batch: int) -> int:
    """Steps of a resampled epoch of ``samples`` (webdataset's ``with_epoch``): the ranks' batches
    together cover it, the last step's maybe partly twice."""
    return math.ceil(samples / (world * batch))


class Batch(NamedTuple):
    images: torch.Tensor  # normalised float N × 3 × H × W, on the device
    labels: torch.Tensor  # int64, N, on the device
    keys: list[str]


def _stop_at_exit() -> None:
    """Registered once a loader exists (not on import): for loaders never shut down (say, still
    referenced by a crashed run), feed threads first, as a thread still inside torch at
    interpreter shutdown aborts the process; then our DataLoader workers (only ours), which ignore
    SIGTERM (worker.worker_init), so multiprocessing's own exit hook, which terminates daemonic
    children and joins them, would wait forever. Runs before it (atexit is LIFO); the workers end
    even where a signal cuts the threads' wait short."""
    try:
        close_all()
    finally:
        ours = [child for child in _workers if child.is_alive()]
        if ours:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's handler would report the kills
        for child in ours:
            child.kill()


_workers: set[mp.process.BaseProcess] = set()  # our loaders' DataLoader workers (theirs outlive them)


@functools.cache
def _exit_hook() -> None:
    atexit.register(_stop_at_exit)


def _loader(dataset: ShardStream, batch: int, workers: int, slots: Slots | None) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        collate_fn=functools.partial(wire.pack, slots=slots),
        worker_init_fn=functools.partial(worker_init, parent=os.getpid()),
    )


class _OnDevice:
    """The feed's stages from host batch to Batch on the device (each runs in a thread of its own)."""

    def __init__(self, dataset: ShardStream, device: torch.device, channels_last: bool):
        self.dataset, self.device, self.channels_last = dataset, device, channels_last
        self.signals = dataset.signals
        self.dali = DaliCrops(device) if dataset.spec.decode == "dali" else None

    def stages(self) -> list[Stage]:
        if self.dataset.spec.decode == "cpu":
            return [("copy", self.copy)]
        # DALI one batch a call, each one's copy out of its pipelines synchronised before the next runs
        return [("decode", self.dali_decode if self.dali else Merged(self.decode)), ("crop", self.crop)]

    def copy(self, batch: HostBatch) -> tuple[Batch, torch.Tensor]:
        images: torch.Tensor = batch.images  # type: ignore[assignment]
        if images.is_floating_point():  # a caller's transform made them whole (worker._transformed)
            x = images.to(self.device, non_blocking=True).contiguous(memory_format=memory_format(self.channels_last))
        else:
            x = normalize(images, self.device, self.channels_last)
        return Batch(x, batch.labels.to(self.device, non_blocking=True), batch.keys), batch.ids

    def decode(self, batches: list[HostBatch]) -> list[tuple[Decoded, HostBatch]]:
        """The batches waiting for the decoder, in one nvJPEG call (device_feed.Merged)."""
        encoded: list[Encoded] = [batch.images for batch in batches]  # type: ignore[misc]
        decoded = decode_together(encoded, self.device)
        return [self._replaced(one, batch) for one, batch in zip(decoded, batches, strict=True)]

    def dali_decode(self, batch: HostBatch) -> tuple[Decoded, HostBatch]:
        encoded: Encoded = batch.images  # type: ignore[assignment]
        if self.dali and encoded.sizes:
            try:
                crops = self.dali(encoded, self.signals.size.value).permute(0, 3, 1, 2)
                return Decoded(crops, encoded.boxes, encoded.plans, None, encoded.pixels), batch
            except DaliFailed as e:  # nvJPEG's path finds and replaces the samples that failed
                self.dataset.report("DALI", f"could not decode a batch ({e}): nvJPEG decodes such batches", None)
        return self._replaced(decode_encoded(encoded, self.device), batch)

    def _replaced(self, decoded: Decoded, batch: HostBatch) -> tuple[Decoded, HostBatch]:
        """``batch`` with the samples that failed to decode replaced by others of it, as ``decoded`` has them."""
        if decoded.rescued:  # once a run: a device short of memory would take this path every batch
            i, error = decoded.rescued
            problem = f"could not decode sample {batch.keys[i]!r} ({error}); libjpeg decoded it on the CPU, as it "
            self.dataset.report("nvJPEG", f"{problem}will any more nvJPEG fails (slower; not named again)", None)
        if rows := decoded.rows:
            for i in (i for i, r in enumerate(rows) if r != i):
                problem = f"could not be decoded on {self.device}, replaced by another of its batch"
                self.dataset.report(f"sample {batch.keys[i]!r}", problem, self.signals.skipped)
            batch = batch._replace(labels=batch.labels[rows], keys=[batch.keys[r] for r in rows])
        return decoded, batch

    def crop(self, item: tuple[Decoded, HostBatch]) -> tuple[Batch, torch.Tensor]:
        decoded, batch = item
        x = crop_decoded(decoded, self.signals.size.value, self.device, self.channels_last, self.dataset.spec.augment)
        return Batch(x, batch.labels.to(self.device, non_blocking=True), batch.keys), batch.ids


@dataclass(frozen=True)
class Feeding:
    """How a rank's loader feeds its device: DataLoader workers, the device, the memory layout."""

    workers: int
    device: torch.device = CPU
    channels_last: bool = False
    # training's JPEG bytes cross in the workers' shared buffers (wire.py); None: on CUDA,
    # where the GPU copies from them directly (elsewhere the device path is the tests')
    shared_buffers: bool | None = None
    # of training's samples, cropped in the workers (cpu_share.py): a share, or "auto": on CUDA
    # only (elsewhere the device is the CPU too); nothing without workers
    cpu_share: float | str = AUTO
    # seconds the step may wait for a batch before the loader gives up (Stalled); None: for ever
    data_timeout: float | None = 600.0

    def share(self) -> float | str:
        """The share of training's samples the workers crop, or "auto" (cpu_share.py)."""
        if not self.workers or (self.cpu_share == AUTO and self.device.type != "cuda"):
            return 0.0
        return self.cpu_share


class _ShardLoader:
    """What the train and val loaders share: the worker stream and the feed to the device."""

    def __init__(self, shards: Shards, mode: str, spec: LoaderSpec, feeding: Feeding, shuffle: int = 0):
        caches = [
            ShardCache(Path(spec.cache.root), location, spec.cache.max_bytes, infos)
            if spec.cache and not is_local(location)  # a local location is on disk already
            else None
            for location, infos in zip(shards.locations, shards.infos, strict=True)
        ]
        encoded = spec.decode != "cpu" and mode != "val"  # training's batches cross as JPEG bytes and crops
        self.spec = dataclasses.replace(
            spec, shards=shards, caches=caches, shuffle=shuffle, cpu_share=feeding.share() if encoded else 0.0
        )
        self.dataset = ShardStream(self.spec, mode)
        self.mode, self.signals = mode, self.dataset.signals  # (what the workers and this process share)
        self.owner = os.getpid()  # (a forked child inherits the loader, not its workers)
        _exit_hook()
        self.device, self.pin = feeding.device, feeding.device.type == "cuda"
        self.slots = None  # training's JPEG bytes cross in place (validation's the usual way: it is rare)
        shared = self.pin if feeding.shared_buffers is None else feeding.shared_buffers
        if shared and feeding.workers and encoded:
            share = self.spec.cpu_share
            cropped = (LIMIT if share == AUTO else float(share)) * 3 * spec.image_size**2  # (cpu_share.py's pixels)
            sample_bytes = shards.bytes / max(1, sum(shards.counts)) + cropped
            self.slots = Slots.for_batches(feeding.workers, spec.batch, sample_bytes)
        self.loader = _loader(self.dataset, self.spec.batch, feeding.workers, self.slots)
        self.to_device = _OnDevice(self.dataset, feeding.device, feeding.channels_last)
        self.feed: DeviceFeed | None = None  # the epoch's, while it is iterated
        self.padded = 0  # samples repeated to fill an epoch's last batches when decodes failed
        self.interrupted: Callable[[float], bool] | None = None  # ends a wait for a batch (failures.Interrupted)
        self.timeout = feeding.data_timeout

    def received(self) -> Iterator[HostBatch]:
        """The workers' batches as they arrive; a worker that died ends them in one line."""
        try:
            before = set(mp.active_children())
            if self.slots and self.slots.registered and getattr(self.loader, "_iterator", None) is None:
                # workers start again: buffers page-locked before they fork would not be theirs
                self.slots = self.slots.renewed()
                self.loader = _loader(self.dataset, self.spec.batch, self.loader.num_workers, self.slots)
            try:
                batches = iter(self.loader)  # (the first time, its workers start)
            finally:  # also those started before the rest failed to (too many open files, processes)
                after = set(mp.active_children())
                _workers.intersection_update(after)  # (those gone need no killing)
                _workers.update(after - before)
            if self.slots and self.pin:
                self.slots.pin()
            yield from map(functools.partial(wire.unpack, self.slots), batches)
        except (UnreadableData, TransformFailed) as e:  # a worker's: torch raises it again, its traceback the message
            # the worker's message follows the first line that starts with its type (a caller's
            # exception quoted in it may name the type too); raised in this process, it is the message
            raised = f"\n{type(e).__module__}.{type(e).__name__}: "
            raise type(e)(str(e).partition(raised)[2].strip() or str(e)) from None
        except RuntimeError as e:  # torch's "DataLoader worker (pid(s) 1234) exited unexpectedly"
            if not str(e).startswith("DataLoader worker"):
                raise
            raise WorkerDied(
                f"{self.spec.location}: {e} (killed? the OOM killer says so in dmesg): lower --workers or "
                "--batch-size and continue with --resume auto"
            ) from None

    def busy(self) -> dict[str, float]:
        """Seconds each of the feed's threads worked since the last call (see device_feed.py)."""
        return self.feed.busy() if self.feed else {}

    def counters(self) -> dict[str, int]:
        """Samples that failed to decode, shards that failed to read and the samples they listed
        unread, the samples listed by every shard the workers set out to read, samples repeated to pad,
        samples the workers cropped themselves (cpu_share.py)."""
        return {**self.signals.counts(), "padded": self.padded}

    def in_reading(self) -> list[tuple[str, float]]:
        """The shards this loader's workers are reading (where, from its source's location), each
        with the seconds it has been read."""
        return [(self.spec.shards.where(shard), seconds) for shard, seconds in self.signals.in_reading()]

    def reads(self) -> dict[str, dict[str, int]]:
        """What reading the shards has cost so far, by source location (signals.READS)."""
        return dict(zip(self.spec.shards.locations, self.signals.read_counts(), strict=True))

    def shut_down(self) -> None:
        """Stop the feed's threads and end this loader's DataLoader workers at once, ready for
        the next epoch's: the counters' locks renewed, the buffers the workers held reclaimed."""
        if self._end_workers():
            self.signals.renew_locks()  # (theirs: one killed holding one)
            if self.slots:
                self.slots.reclaim()

    def _end_workers(self) -> bool:
        """Stop the feed's threads and kill the DataLoader's workers, if it has any (whether it had):
        they hold nothing that must outlive them (worker.worker_init), and torch's own shutdown waits
        5 s for each that is busy (a read in progress, batches prefetched), wherever it is collected."""
        if self.feed:
            self.feed.close(timeout=5)
        iterator = getattr(self.loader, "_iterator", None)  # torch keeps no public handle on its workers
        if iterator is None:
            return False
        if iterator._worker_pids_set:  # else its SIGCHLD handler reports the kills as workers that crashed
            remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for worker in iterator._workers:
            worker.kill()
        # each worker checks this event in its loop, under the event's lock: one killed holding it
        # would leave torch's set() in _shutdown_workers waiting for ever (a test hung so). With
        # the workers gone nobody waits on the event, so a fresh one does
        iterator._workers_done_event = threading.Event()
        iterator._shutdown_workers()  # (joins them, dead already, and closes the queues)
        self.loader._iterator = None
        return True

    def __del__(self) -> None:
        # a loader dropped unclosed (a framework's, a test's): its workers ended as by close, not
        # by torch's wait of 5 s a busy worker; at interpreter exit, _stop_at_exit has done it.
        # Nothing more: no epoch follows, and a collection can run this where its thread holds
        # multiprocessing's heap lock (allocating an mp.Value), which a fresh counter would wait
        # on for ever (a test hung so for 600 s)
        if not sys.is_finalizing() and hasattr(self, "to_device") and os.getpid() == self.owner:
            self._end_workers()  # (not where __init__ failed)

    def host_batches(self) -> Iterator[HostBatch]:
        raise NotImplementedError

    def _ready(self, batch: HostBatch) -> HostBatch:
        return wire.pinned(batch) if self.pin else batch

    def _on_device(self, batches: Iterator[HostBatch], ahead: int) -> Iterator[tuple[Batch, torch.Tensor]]:
        step_wait = self.signals.step_wait.value  # (the last epoch's: a new feed's first item waits for the workers)
        stages = self.to_device.stages()
        feed = self.feed = DeviceFeed(batches, stages, self.device, ahead, self.interrupted, step_wait, self.timeout)
        try:
            for item in feed:
                self.signals.step_wait.value = feed.step_wait  # (for the workers' crops: cpu_share.py)
                yield item
        except Stalled:
            raise Stalled(
                f"{self.spec.location}: no batch came from the loader's workers for {self.timeout:g} s (one stopped, "
                "or its reads hang?): restore them and continue with --resume auto (--data-timeout bounds the wait)"
            ) from None
        finally:
            # bounded: a pull thread can wait for ever on a worker whose read never returns (a
            # stalled mount); left behind, it ends with the workers, at the latest at exit
            feed.close(timeout=5)


class TrainLoader(_ShardLoader):
    """Fixed-length epochs: ``len(self)`` batches of exactly ``batch`` samples, every epoch.

    Each worker mixes its samples in a buffer and hands over whole batches; the training
    process only receives them, except for each worker's short last batch of an exact epoch,
    which it pools with the others' (and pads the epoch's last batch if decodes failed).
    """

    def __init__(
        self,
        shards: Shards,
        mode: str,
        spec: LoaderSpec,
        feeding: Feeding,
        shuffle_buffer: int,
        epoch_size: int | None = None,
    ):
        if shards.samples == 0:
            raise DataError("the training split has no samples")
        if epoch_size is not None and mode == "exact":
            raise DataError(
                f"--epoch-size {epoch_size} with --epoch-mode exact: an exact epoch is every sample of the "
                f"manifest once ({shards.samples}); leave --epoch-size out, or use --epoch-mode resampled"
            )
        batch = spec.batch
        # the rank's buffer, split among its workers; each needs a batch to hand one over
        shuffle = max(batch, shuffle_buffer // max(1, feeding.workers))
        super().__init__(shards, mode, spec, feeding, shuffle)
        counts, world = self.spec.counts, self.spec.world
        if mode == "exact":
            self.steps = exact_assignment(counts, world, batch, self.spec.seed, 0, runs=shards.runs)[1]
        else:
            self.steps = nominal_steps(epoch_size or shards.samples, world, batch)
        self.epoch = 0
        self.delivered: list[torch.Tensor] = []  # this epoch's (shard, index) handed to training
        self.restored: dict | None = None  # the position this epoch continues from (all ranks')
        self.resumed_step = 0  # where the next iteration starts: > 0 once, after a mid-epoch restore

    def __len__(self) -> int:
        return self.steps

    def plan(self) -> str:
        """A digest of what the epochs' sample order follows from (the shards, their sample
        counts, the seed): a resumed epoch can be exact only over the same."""
        shards = self.spec.shards
        plan: list = [shards.names, shards.counts, self.spec.seed]
        if shards.mixed:  # (a single source's digest as it always was)
            plan += [shards.source, shards.weights, shards.taken]
        return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:16]

    def identity(self) -> str:
        """A digest of the training shards themselves (names and SHA-256s), wherever they are
        read from: a checkpoint made on other data is told by it."""
        shards = self.spec.shards
        # each shard once (a mixture lists a shard once per pass over its source): other weights, same data
        once = dict.fromkeys(zip(shards.names, shards.listed, strict=True))
        names, listed = [name for name, _ in once], [bytes_sha for _, bytes_sha in once]
        return hashlib.sha256(json.dumps([names, listed]).encode()).hexdigest()[:16]

    def set_epoch(self, epoch: int, image_size: int | None = None, keep_restored: bool = True) -> None:
        """Start ``epoch`` (call before iterating), optionally at another image size; where a
        restored position is of this epoch, from there, unless not ``keep_restored``."""
        if not keep_restored:
            self._resume_at((-1, {}, ""))
        if epoch != self.epoch or epoch != self.dataset.resumed[0]:
            self.delivered, self.restored, self.resumed_step = [], None, 0
        self.epoch = epoch
        self.signals.epoch.value = epoch
        if image_size:
            self.signals.size.value = image_size

    def position(self) -> dict:
        """The samples this rank trained on this epoch since the loader started (a part of the
        epoch's position, see sampling.merge_positions; ``restored`` holds the rest)."""
        delivered: Done = {}
        for shard, index in torch.cat(self.delivered).tolist() if self.delivered else []:
            delivered.setdefault(shard, set()).add(index)
        return {"epoch": self.epoch, "delivered": {k: sorted(v) for k, v in delivered.items()}}

    def padding(self, padded: int) -> str:
        """The line that says this epoch's last batches were padded with ``padded`` repeats, and of
        which shards samples were not handed out (exact mode: the rank's share of the epoch less
        what it handed out)."""
        line = f"{self.spec.location}: epoch {self.epoch + 1} was padded with {padded} repeats of other samples"
        if self.mode != "exact":  # (resampled: no share of samples planned to compare with)
            return line
        s, (epoch, done, _) = self.spec, self.dataset.resumed
        done = done if epoch == self.epoch else {}  # (trained before a restart: not this rank's to hand out)
        pieces = exact_assignment(s.counts, s.world, s.batch, s.seed, self.epoch, done, s.shards.runs)[0][s.rank]
        handed = set(map(tuple, torch.cat(self.delivered).tolist())) if self.delivered else set()
        missing = Counter(
            s.shards.where(p.shard)
            for p in pieces
            for i in range(p.start, p.stop)
            if (p.shard, i) not in handed and i not in done.get(p.shard, ())
        )
        if not missing:
            return line
        listed = ", ".join(f"{n} of {where}" for where, n in missing.most_common(3))
        more = f" and {len(missing) - 3} more shards" if len(missing) > 3 else ""
        return f"{line} in place of samples that could not be read: {listed}{more} (the loader's problems say why)"

    def restore(self, epoch: int, restart: str, position: dict | None = None, step: int = 0) -> int:
        """Continue ``epoch`` mid-way; returns the step of the epoch it continues at.

        Exact mode: without the samples ``position`` names (trained by any topology); the
        steps left follow from what is left. Resampled mode: from ``step`` on, each worker
        drawing a fresh stream named by ``restart`` (not one the interrupted run drew)."""
        done = trained(position) if position else {}
        self._resume_at((epoch, done, restart))
        self.epoch, self.signals.epoch.value = epoch, epoch
        self.delivered, self.restored = [], position
        if self.mode == "exact":
            counts, world, batch = self.spec.counts, self.spec.world, self.spec.batch
            runs = self.spec.shards.runs
            step = self.steps - exact_assignment(counts, world, batch, self.spec.seed, epoch, done, runs)[1]
        self.resumed_step = step
        return step

    def _resume_at(self, resumed: tuple[int, Done, str]) -> None:
        """Workers keep ``dataset.resumed`` as it was when they started: where it changes, they start afresh."""
        if resumed != self.dataset.resumed:
            self.shut_down()
            self.dataset.resumed = resumed

    def __iter__(self) -> Iterator[Batch]:
        """The rest of this epoch's batches on the device; a batch counts as delivered once handed out."""
        # resumed mid-epoch: the steps trained before the restart are not made again (nor padded)
        first_step, self.resumed_step = self.resumed_step, 0
        for batch, ids in self._on_device(self.host_batches(first_step), ahead=4):
            self.delivered.append(ids)
            yield batch

    def host_batches(self, first_step: int = 0) -> Iterator[HostBatch]:
        """This epoch's batches from ``first_step`` on, still on the host (pixels, or JPEG bytes and crops)."""
        batch, made = self.spec.batch, first_step
        if made >= self.steps:
            return
        pool: list[HostBatch] = []  # workers' short last batches
        previous: HostBatch | None = None
        for received in self.received():
            if len(received.keys) < batch:
                pool.append(received)
                if sum(len(b.keys) for b in pool) < batch:
                    continue
                pooled = wire.concat(pool)
                received, rest = wire.take(pooled, list(range(batch))), list(range(batch, len(pooled.keys)))
                pool = [wire.take(pooled, rest)] if rest else []
            yield (previous := self._ready(received))
            made += 1
            if made == self.steps:
                return
        rng = random.Random(f"pad:{self.spec.seed}:{self.epoch}:{self.spec.rank}")
        while made < self.steps:  # decodes failed or shards were cut short: repeat samples
            have = wire.concat(pool) if pool else None
            source = previous or have
            if source is None:
                raise UnreadableData(
                    f"{self.spec.location}: no training sample of this rank's shards could be read (named above); "
                    "restore them (imagenet_shards.py verify) and continue with --resume auto"
                )
            need = batch - (len(have.keys) if have else 0)
            padding = wire.take(source, [rng.randrange(len(source.keys)) for _ in range(need)])
            self.padded += need
            yield (previous := self._ready(wire.concat([have, padding]) if have else padding))
            pool, made = [], made + 1


class ValLoader(_ShardLoader):
    """Every validation sample exactly once across ranks (batches may be short)."""

    def __init__(self, shards: Shards, spec: LoaderSpec, feeding: Feeding):
        super().__init__(shards, "val", spec, feeding)
        self.samples = shards.samples

    def host_batches(self) -> Iterator[HostBatch]:
        yield from (self._ready(b) for b in self.received())

    def __iter__(self) -> Iterator[Batch]:
        yield from (batch for batch, _ in self._on_device(self.host_batches(), ahead=2))
