"""The data path as a library: ``ShardLoader``, one rank's batches of a split, on its device.

train.py builds its loaders here too: one data path. In a plain loop::

    loader = ShardLoader("ais://imagenet/shards", "train", 256, epoch_mode="exact")
    for epoch in range(epochs):
        for images, labels, keys in loader:  # each pass over the loader is the next epoch
            ...
            torch.save({"model": ..., "data": loader.state_dict()}, path)  # mid-epoch too
    ...
    loader.load_state_dict(torch.load(path)["data"])  # goes on with the batches not yet handed out

A state names the samples an exact epoch has trained (not ranks or steps), so another number
of ranks, batch size or workers can continue it: every sample of the epoch still once. Under
``torch.distributed`` with several ranks, ``state_dict()`` gathers every rank's part: all ranks
call it, as they do a model's checkpoint. PyTorch Lightning finds ``state_dict``/``load_state_dict``
on a training loader and keeps the state in its checkpoints (mid-epoch resume included).
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing as mp
import os
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from PIL import Image

from imagenet_ais.distributed import WORK_QUEUES, auto_workers, gather_objects
from imagenet_ais.errors import ConfigError, DataError
from imagenet_ais.loader.augment import NO_AUGMENT, Augment
from imagenet_ais.loader.cpu_share import AUTO, checked
from imagenet_ais.loader.dali_decode import available as dali_available
from imagenet_ais.loader.engine import Batch, Feeding, TrainLoader, ValLoader
from imagenet_ais.loader.failures import ShuffleWarning, StateMismatch, TransformFailed, raised, shown, transform_name
from imagenet_ais.loader.mixture import Source, shards_of, sources_of
from imagenet_ais.loader.sampling import merge_positions
from imagenet_ais.loader.transforms import VAL_CROP
from imagenet_ais.loader.worker import CacheSpec, LoaderSpec
from imagenet_ais.shards.manifest import Manifest, load_manifest
from imagenet_ais.shards.quality import low_quality_line
from imagenet_ais.storage import is_local, open_store

STATE_VERSION = 1

# auto: gpu where CUDA is; cpu: PIL in the workers; gpu: nvJPEG; dali: DALI's JPEG-engine crops
DECODES = ("auto", "cpu", "gpu", "dali")
MAX_IMAGE_SIZE = 2048  # a side: a batch of larger crops takes more than a worker's memory (30,000: MemoryError)


# exact: every sample at most once an epoch; resampled: shards drawn with replacement (engine.py)
EPOCH_MODES = ("resampled", "exact")


class Continued(NamedTuple):
    """Where a state that ``load_state_dict`` went on from had stopped, and on which topology."""

    epoch: int
    step: int
    steps: int
    world_size: int
    batch_size: int
    trained: int | None  # the epoch's samples trained before it stopped (exact mode), else None

    def __str__(self) -> str:
        on = f"{self.world_size} × {self.batch_size}"
        return f"epoch {self.epoch + 1} stopped at step {self.step} of {self.steps} on {on}"


class ShardLoader:
    """One rank's batches of ``split`` of the shards at ``location`` (a directory, ``ais://``,
    ``gs://``, ``s3://``, ``http(s)://``: wherever ``manifest.json`` is), ready on ``device``.

    ``location`` may also be several, as ``(location, weight)`` pairs (or bare locations, weight 1),
    for training: their shards mixed by weight, their classes merged by name (mixture.py says
    what a weight means in each epoch mode). ``classes``: the class names to give labels in (each
    source's mapped to them by name; all its classes must be there); by default the manifest's.

    Iterating gives ``Batch(images, labels, keys)``: normalised float images N × 3 × H × W
    and int64 labels on the device, and the samples' keys. The training split gives ``len(self)``
    batches of exactly ``batch_size`` every epoch, on every rank; validation ("val") every
    sample once across ranks (batches may be short).

    - ``rank``/``world_size``: by default torch.distributed's (1 rank when not initialised).
    - ``epoch_mode``: "exact" (every sample at most once an epoch, the same steps on each rank)
      or "resampled" (shards drawn with replacement; ``epoch_size`` samples an epoch, by
      default the split's count).
    - ``decode``: "cpu" (in the workers), "gpu" (nvJPEG), "dali" (the JPEG engines; the
      ``dali`` extra), or "auto": "gpu" on a CUDA device, else "cpu".
    - ``device``: by default the current CUDA device, else the CPU. ``workers``: DataLoader
      processes, by default this rank's CPUs (less two beside a GPU).
    - ``cpu_share``: with "gpu"/"dali", the share of training samples the workers crop themselves
      (cpu_share.py); "auto": on a GPU, as much as their spare time allows.
    - ``cache_dir``/``cache_size``: remote shards kept on the node's disk, read from there next epoch.
    - ``data_timeout``: seconds the step may wait for a batch before ``Stalled`` ends the wait (a
      worker stopped, or reads that hang); None: for ever.
    - ``augment``: RandAugment-style policies and random erasing (augment.Augment), training only.
      ``val_resize_size``: validation resizes the short side to it, then takes the centre crop.
    - ``transform``: your own, in the workers, on each decoded PIL image (RGB), in place of the
      loader's crop, flip and augment (decode on the CPU; ``image_size`` does not apply). It gives
      a PIL image or a uint8 3×H×W tensor (normalised then as the loader's own crops are), or a
      float 3×H×W tensor (taken as it is); one size for all. Its random draws are the workers'
      own, not the loader's seed. ``batch_transform``: your own on each batch's images on the
      device, as iterating would give them (any decode); it gives a float tensor of as many images.

    Its state (``state_dict()``, training only; a plain dict, for ``torch.save``):

    - ``version``: 1. ``epoch``: the epoch the next pass trains. ``step``: the batches of it
      handed out (0: it starts afresh). ``steps``: the epoch's batches on the topology that wrote it.
    - ``mode``: "exact" or "resampled". ``plan``: a digest of what the epochs' sample order follows
      from (shards, their counts, the seed); a state of another plan cannot continue its epoch.
    - ``position``: in exact mode mid-epoch, the samples the epoch has trained on every rank,
      ``{"epoch": E, "delivered": {shard: [sample indices]}}``; else None.
    - ``world_size``, ``batch_size``: the topology that wrote it; any other may continue it.
    - ``identity``: a digest of the shards' names and SHA-256s (None in states older than it): an
      epoch over shards converted again (the same names and counts, other bytes) starts over.
    """

    def __init__(
        self,
        location: str | os.PathLike | Sequence[tuple[str | os.PathLike, float] | str | os.PathLike],
        split: str = "train",
        batch_size: int = 256,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        epoch_mode: str = "resampled",
        epoch_size: int | None = None,
        image_size: int = 224,
        decode: str = "auto",
        device: torch.device | str | None = None,
        workers: int | None = None,
        cache_dir: str | None = None,
        cache_size: int | None = None,
        seed: int = 0,
        shuffle_buffer: int = 2000,
        augment: Augment = NO_AUGMENT,
        val_resize_size: float | None = None,
        channels_last: bool = False,
        cpu_share: float | str = AUTO,
        manifest: Manifest | None = None,
        data_timeout: float | None = 600.0,
        transform: Callable[[Image.Image], Any] | None = None,
        batch_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        classes: Sequence[str] | None = None,
    ):
        _check_sizes(batch_size=batch_size, image_size=image_size, epoch_size=epoch_size, shuffle_buffer=shuffle_buffer)
        sources = [_absolute(source) for source in sources_of(location)]
        _check_kinds(manifest, augment, workers, seed, data_timeout)
        if manifest is not None and len(sources) > 1:
            raise ConfigError("manifest= is one location's: leave it out for a mixture (each source's is read)")
        rank, world_size = _topology(rank, world_size)
        device = _device(device)
        if epoch_mode not in EPOCH_MODES:
            raise ConfigError(f"epoch mode {epoch_mode!r}: use one of {', '.join(EPOCH_MODES)}")
        self.decode = _decode(_own_transforms(decode, augment, transform, batch_transform), device)
        self.batch_transform = batch_transform
        if device.type == "cuda" and self.decode != "cpu" and (warning := few_queues()):
            warnings.warn(warning, stacklevel=2)
        if cache_size is not None and not cache_dir:
            raise ConfigError("--cache-size bounds --cache-dir: give --cache-dir too")
        manifests = [manifest] if manifest else [load_manifest(open_store(s.location)) for s in sources]
        data, self.classes = shards_of(sources, manifests, split, epoch_mode, _checked_classes(classes))
        self.notes = _shuffle_notes(sources, manifests, split)
        self.sources, self.split = sources, split
        self.location = " + ".join(s.location for s in sources)  # (what its messages name)
        self.rank, self.world_size, self.batch_size, self.device = rank, world_size, batch_size, device
        self.workers = workers if workers is not None else auto_workers(device)
        if transform is not None and self.workers:
            _sendable(transform)
        spec = LoaderSpec(
            world_size, rank, batch_size, seed, image_size, self.decode, len(self.classes),
            CacheSpec(cache_dir, cache_size) if cache_dir else None, augment=augment, transform=transform,
        )  # fmt: skip
        feeding = Feeding(self.workers, device, channels_last, cpu_share=checked(cpu_share), data_timeout=data_timeout)
        self._loader: TrainLoader | ValLoader
        if split == "train":
            self._loader = TrainLoader(data, epoch_mode, spec, feeding, shuffle_buffer, epoch_size)
        else:
            resize = val_resize_size or image_size / VAL_CROP
            if resize < image_size:
                raise ConfigError(f"--val-resize-size {resize:g} is smaller than the validation crop ({image_size})")
            spec = dataclasses.replace(spec, val_crop=image_size / resize, augment=NO_AUGMENT)
            self._loader = ValLoader(data, spec, feeding)
        self.samples = data.samples  # the manifest's count (a mixture's exact epoch: the samples it takes)
        self.epoch = 0  # the epoch the next (or current) pass trains
        self._pending = True  # the next pass trains ``epoch`` (set, restored or first): not the one after
        self._step = 0  # steps of ``epoch`` handed out (with those before a restore)
        # the pass in progress, held weakly: a pass its loop dropped (a break) ends then, where a
        # strong hold would keep it, and this loader with it, alive until a collection
        self._active: weakref.ref[_Pass] | None = None
        self.continued: Continued | None = None  # what the last ``load_state_dict`` went on from
        self._warns = True  # of an epoch padded with repeats: until the caller takes ``problems``

    @property
    def cpu_share(self) -> float | str:
        """The share of training samples the workers crop themselves (cpu_share.py): a number, "auto" or 0."""
        return self._loader.spec.cpu_share

    @property
    def step(self) -> int:
        """The step of its epoch the next pass starts at: 0, or where a restored state left off
        (``enumerate(loader, start=loader.step)`` counts the epoch's steps)."""
        whole = isinstance(self._loader, TrainLoader) and self._step >= len(self._loader)
        return 0 if whole and not self._pending else self._step

    @property
    def problems(self) -> Any:
        """The queue the workers name unreadable shards and samples in ("where: what" lines). A
        caller that takes it names what they say (as train.py does): the loader then no longer warns
        of an epoch padded with repeats, which would name those shards again."""
        self._warns = False
        return self._loader.signals.problems

    def __len__(self) -> int:
        """Batches an epoch, the same on every rank (training only: validation's workers each end
        with a short batch, so its count is not known ahead; TypeError, as for any iterable)."""
        if not isinstance(self._loader, TrainLoader):
            raise TypeError("a validation ShardLoader has no length: its workers' last batches are short")
        return len(self._loader)

    def set_epoch(self, epoch: int, image_size: int | None = None) -> None:
        """Make the next pass ``epoch`` (from its start, unless a restored state is partway
        through it), optionally at another image size (progressive resizing)."""
        if isinstance(self._loader, TrainLoader):
            # a restored state is kept only for the pass it was loaded for
            self._loader.set_epoch(epoch, image_size, keep_restored=self._pending and epoch == self.epoch)
            self._step = self._loader.resumed_step
        elif image_size:
            self._loader.signals.size.value = image_size
        self.epoch, self._pending = epoch, True

    def __iter__(self) -> Iterator[Batch]:
        # a pass left partway, still held: its feed threads stop before the next's start
        self._end_active(
            f"{self.location}: this pass over the loader ended when another began (a pass is an epoch, and two "
            "cannot run at once, as in zip(loader, loader)): finish or drop one pass before starting the next"
        )
        active = _Pass(self._pass())
        self._active = weakref.ref(active)
        return active

    def _end_active(self, why: str) -> None:
        """End the pass in progress, if one is held: ``why`` is what it says if asked for more."""
        active = self._active() if self._active else None
        if active is not None:
            active.end(why)
        self._active = None

    def _pass(self) -> Generator[Batch]:
        if not self._pending:
            self.set_epoch(self.epoch + 1)
        self._pending = False
        padded = self._loader.padded
        for batch in self._loader:
            self._step += 1
            yield self._transformed(batch) if self.batch_transform is not None else batch
        if self._warns and isinstance(self._loader, TrainLoader) and (padded := self._loader.padded - padded):
            # counters() only counts them: a loop that reads no problems would train on repeats unsaid
            warnings.warn(self._loader.padding(padded), stacklevel=3)  # (the caller's loop, past _Pass)

    def _transformed(self, batch: Batch) -> Batch:
        """The batch_transform's images of ``batch``: a float tensor of as many images, else TransformFailed."""
        said = f"{self.location}: the batch_transform {transform_name(self.batch_transform)}"
        which, n = f"the batch of {batch.keys[0]!r} and {len(batch.keys) - 1} more", len(batch.keys)
        try:
            out = self.batch_transform(batch.images)  # type: ignore[misc]
        except Exception as e:
            raise TransformFailed(f"{said} raised on {which}: {raised(e)}") from None
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 4 and len(out) == n:
            return batch._replace(images=out)
        raise TransformFailed(f"{said} gave {shown(out)} for {which}: return a float tensor of its {n} images, N×C×H×W")

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in its epochs (the class's docstring says what it holds), for
        ``load_state_dict``; validation keeps none. With several ranks under torch.distributed, a
        collective: every rank calls it."""
        loader = self._loader
        if not isinstance(loader, TrainLoader):
            return {}
        epoch, step = self.epoch, self._step
        if step >= len(loader):  # handed out whole: what comes next is the next epoch
            epoch, step = epoch + 1, 0
        position = None
        if step and loader.mode == "exact":  # every rank's samples of the epoch so far
            mine = loader.position()
            if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(
                    f"state_dict() of rank {self.rank} of {self.world_size} mid-epoch: without torch.distributed it "
                    "cannot gather the other ranks' samples; call init_process_group first"
                )
            theirs = gather_objects(mine) if self.world_size > 1 else [mine]
            position = merge_positions(epoch, [loader.restored, *theirs])
        return self.state_of(
            epoch, step, len(loader), loader.mode, loader.plan(), position, self.world_size, self.batch_size,
            loader.identity(),
        )  # fmt: skip

    @staticmethod
    def state_of(
        epoch: int,
        step: int,
        steps: int,
        mode: str,
        plan: str | None,
        position: dict | None,
        world: int,
        batch: int,
        identity: str | None = None,
    ) -> dict[str, Any]:
        """A state from its parts (as ``state_dict`` gives it): for checkpoints that kept the parts
        rather than the state."""
        return {
            "version": STATE_VERSION, "epoch": epoch, "step": step, "steps": steps, "mode": mode, "plan": plan,
            "position": position, "world_size": world, "batch_size": batch, "identity": identity,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (``state_dict()``'s, maybe of another number of ranks, batch size
        or workers): the next pass continues its epoch. Exact epochs continue without the samples
        trained before; resampled ones as far through the epoch, from fresh streams. A state this
        loader cannot continue exactly raises ``StateMismatch`` (its epoch may start over instead).
        ``continued`` then says where the state had stopped."""
        loader = self._loader
        self.continued = None
        if not isinstance(loader, TrainLoader) or not state:
            return
        self._end_active(  # the next pass goes on from the state
            f"{self.location}: this pass over the loader ended at load_state_dict(): start a new pass "
            "(for ... in loader) to continue from the state loaded"
        )
        state = _checked_state(state)
        epoch, step, position = state["epoch"], state["step"], state["position"]
        self._pending = False  # (the epoch is set afresh, whatever was restored before)
        self.set_epoch(epoch)
        trained = sum(map(len, position["delivered"].values())) if position else None
        self.continued = Continued(epoch, step, state["steps"], state["world_size"], state["batch_size"], trained)
        if not step:
            return
        at = str(self.continued)
        if state["plan"] != loader.plan():  # (before its position's shards are looked up: they may be others)
            other = "other shards or weights," if loader.spec.shards.mixed else "other shards"
            raise StateMismatch(f"{at} over {other} or with another seed (ShardLoader's seed=, train.py's --seed)")
        if state.get("identity") not in (None, loader.identity()):
            raise StateMismatch(f"{at} over other shards: the same names and counts, other bytes (converted again?)")
        restart = f"{epoch}:{step}"  # names the streams a resampled epoch draws from here on
        if loader.mode == "exact":
            if not position:
                raise StateMismatch(f"{at} in {state['mode']} mode, which keeps no record of its samples")
            _check_position(position, loader.spec.counts)
            self._step = loader.restore(epoch, restart, position)
        else:
            self._step = loader.restore(
                epoch, restart, step=min(len(loader), round(step * len(loader) / state["steps"]))
            )

    def counters(self) -> dict[str, int]:
        """Samples that failed to decode, shards that failed to read and the samples they listed
        unread, samples of the shards set out to read, samples repeated to pad (all this process's)."""
        return self._loader.counters()

    def in_reading(self) -> list[tuple[str, float]]:
        """The shards the workers are reading now, each with the seconds it has been read (for
        a step that waits: a read that hangs shows here)."""
        return self._loader.in_reading()

    def reads(self) -> dict[str, dict[str, int]]:
        """What reading the shards has cost this process so far, by source location: bytes from its
        store (``read_bytes``, copies fetched into the cache included) in ``read_requests``, bytes
        served by copies the cache held (``cache_bytes``), and bytes read again after a failure
        (``reread_bytes``: a resumed epoch's samples trained before, bad cached copies fetched again)."""
        return self._loader.reads()

    def busy(self) -> dict[str, float]:
        """Seconds each of the feed's threads worked since the last call (the limit is near 100%)."""
        return self._loader.busy()

    def plan(self) -> str | None:
        """A digest of what the epochs' sample order follows from (shards, counts, seed)."""
        return self._loader.plan() if isinstance(self._loader, TrainLoader) else None

    def identity(self) -> str | None:
        """A digest of the training shards (names, SHA-256s), wherever they are read from."""
        return self._loader.identity() if isinstance(self._loader, TrainLoader) else None

    def stop_waiting_when(self, interrupted: Any) -> None:
        """While the step waits for a batch, ``interrupted(seconds waited)`` true ends the wait in
        ``Interrupted`` (a signal must stop a run whose data never comes)."""
        self._loader.interrupted = interrupted

    def close(self) -> None:
        """Stop the feed's threads and the DataLoader workers (they also end with the process)."""
        self._end_active(f"{self.location}: the loader was closed during this pass")
        self._loader.shut_down()

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


STATE_KEYS = ("version", "epoch", "step", "steps", "mode", "plan", "position", "world_size", "batch_size")


def _checked_state(state: object) -> dict[str, Any]:
    """``state`` if it is a state this loader can read (the class's docstring), else a one-line DataError."""
    if not isinstance(state, dict):
        raise DataError(f"a ShardLoader state is a dict (state_dict()'s), not {type(state).__name__}")
    if missing := [key for key in STATE_KEYS if key not in state]:
        raise DataError(f"not a ShardLoader state: no {', '.join(map(repr, missing))} in it")
    if state["version"] != STATE_VERSION:
        raise DataError(f"a ShardLoader state of version {state['version']!r}: this loader reads {STATE_VERSION}")
    for key, low in (("epoch", 0), ("step", 0), ("steps", 1), ("world_size", 1), ("batch_size", 1)):
        if not _whole(state[key]) or state[key] < low:
            raise DataError(f"a ShardLoader state whose {key} is {state[key]!r}: not a whole number, {low} or more")
    position = state["position"]
    if position is not None:
        delivered = position.get("delivered") if isinstance(position, dict) else None
        if not isinstance(delivered, dict) or not all(isinstance(indices, list) for indices in delivered.values()):
            raise DataError("a ShardLoader state whose position holds no 'delivered' samples ({shard: [index, ...]})")
    return state


def _check_position(position: dict, counts: list[int]) -> None:
    """A position of these shards (``counts``: their samples), else a one-line DataError."""
    for shard, indices in position["delivered"].items():
        if not _whole(shard) or not 0 <= shard < len(counts):
            raise DataError(f"a ShardLoader state naming shard {shard!r}: these shards are 0 to {len(counts) - 1}")
        if not all(_whole(i) and 0 <= i < counts[shard] for i in indices):
            raise DataError(f"a ShardLoader state naming samples of shard {shard} it does not hold ({counts[shard]})")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(**sizes: object) -> None:
    """Sizes a loader can work with, each a whole number in its range, else a one-line ConfigError."""
    bounds = {
        "batch_size": (1, None),
        "image_size": (8, MAX_IMAGE_SIZE),
        "epoch_size": (1, None),
        "shuffle_buffer": (0, None),
    }
    for name, value in sizes.items():
        if value is None and name == "epoch_size":
            continue
        low, high = bounds[name]
        if not _whole(value) or value < low or (high is not None and value > high):  # type: ignore[operator]
            within = f"{low} to {high}" if high else f"{low} or more"
            raise ConfigError(f"{name}={value!r}: give a whole number, {within}")


def _check_kinds(manifest: object, augment: object, workers: object, seed: object, data_timeout: object) -> None:
    """Arguments of the wrong kind, in one line rather than an error deep inside at the first batch."""
    if manifest is not None and not isinstance(manifest, Manifest):
        raise ConfigError(f"manifest={manifest!r}: give a Manifest (shards.manifest.load_manifest), or leave it out")
    if not isinstance(augment, Augment):
        raise ConfigError(f"augment={augment!r}: give an Augment (loader.augment.Augment), e.g. Augment('ra')")
    if workers is not None and (not _whole(workers) or not 0 <= workers <= max_workers()):  # type: ignore[operator]
        raise ConfigError(f"workers={workers!r}: give a whole number of DataLoader workers, 0 to {max_workers()} here")
    if not _whole(seed):
        raise ConfigError(f"seed={seed!r}: give a whole number")
    if data_timeout is not None and (not isinstance(data_timeout, int | float) or not data_timeout > 0):
        raise ConfigError(f"data_timeout={data_timeout!r}: give seconds (more than 0), or None to wait for ever")


def _absolute(source: Source) -> Source:
    """A local source at its absolute path: the workers read it wherever the caller (or a
    transform in a worker) moves the working directory later."""
    if not is_local(source.location):
        return source
    return dataclasses.replace(source, location=open_store(source.location).url)


def _shuffle_notes(sources: Sequence[Source], manifests: Sequence[Manifest], split: str) -> list[str]:
    """What a caller should know of its training data (shards sorted by class, say), each line also
    warned of (a ShuffleWarning, at the caller's line)."""
    notes = [
        line
        for source, made in zip(sources, manifests, strict=True)
        if split == "train" and (line := low_quality_line(source.location, made.class_counts.get(split, [])))
    ]
    for line in notes:
        warnings.warn(line, ShuffleWarning, stacklevel=3)
    return notes


def _checked_classes(classes: Sequence[str] | None) -> list[str] | None:
    """``classes=`` as a list, each named once (a name twice is an output no label is given), else a
    one-line ConfigError."""
    if classes is None:
        return None
    given = list(classes)
    if twice := [name for name, n in Counter(given).items() if n > 1]:
        raise ConfigError(f"classes= names {twice[0]!r} more than once: give each class once")
    return given


def _sendable(transform: object) -> None:
    """A ``transform`` that can reach the DataLoader workers, else a one-line ConfigError: under the
    spawn and forkserver start methods it is pickled to them, which a lambda or local function cannot be."""
    method = mp.get_start_method()  # (this fixes the process's, as the loader's shared counters made next would)
    if method == "fork":
        return
    try:
        ForkingPickler.dumps(transform)
    except Exception as e:
        raise ConfigError(
            f"transform={transform_name(transform)} cannot be sent to the DataLoader workers ({method!r} start "
            f"method: {raised(e)}): give a module-level function or a functools.partial of one, or workers=0"
        ) from None


def max_workers() -> int:
    """The most DataLoader workers a process may start: 4 a CPU (more only wait on each other and
    exhaust the task and file limits)."""
    return 4 * (os.cpu_count() or 1)


def _own_transforms(decode: str, augment: Augment, transform: object, batch_transform: object) -> str:
    """The decode to use with the caller's transforms (``transform`` needs the CPU's), else a
    one-line ConfigError."""
    for name, given in (("transform", transform), ("batch_transform", batch_transform)):
        if given is not None and not callable(given):
            raise ConfigError(f"{name}={given!r}: give a callable (e.g. a torchvision.transforms.v2 Compose)")
    if transform is None or decode not in DECODES:  # (_decode names the decodes there are)
        return decode
    if decode not in ("auto", "cpu"):
        raise ConfigError(
            f"transform= runs in the workers on PIL images, not with decode={decode!r}: give decode='cpu', or "
            "batch_transform= for the batch on the device"
        )
    if augment != NO_AUGMENT:
        raise ConfigError(
            "transform= replaces the loader's crop, flip and augment: give one of transform= and augment="
        )
    return "cpu"


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return _default_device()
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r}: {e}") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: no CUDA device is visible to this process")
    return found


def _topology(rank: int | None, world: int | None) -> tuple[int, int]:
    """This loader's rank and world size: the caller's, else torch.distributed's."""
    if (rank is None) != (world is None):
        raise ConfigError(f"rank={rank}, world_size={world}: give both, or neither (torch.distributed's then)")
    if rank is not None and world is not None:
        if not _whole(rank) or not _whole(world) or not 0 <= rank < world:
            raise ConfigError(f"rank {rank} of world size {world}: a rank is 0 to {world - 1}")
        return rank, world
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's, before its process group: each would read all
        raise ConfigError(
            f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but torch.distributed is not initialised: "
            "call init_process_group first, or give rank= and world_size="
        )
    return 0, 1


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _Pass(Iterator[Batch]):
    """One pass over a ShardLoader (an epoch of training). Ended before its last batch (another
    pass began, a state was loaded, the loader closed), it raises a one-line ConfigError if
    asked for more, rather than stop as if its epoch were whole."""

    def __init__(self, batches: Generator[Batch]):
        self.batches, self.ended = batches, ""

    def __next__(self) -> Batch:
        if self.ended:
            raise ConfigError(self.ended)
        return next(self.batches)

    def close(self) -> None:
        """Stop this pass's feed now (as a generator's ``close``)."""
        self.batches.close()

    def end(self, why: str) -> None:
        """Stop its feed now; ``why`` is what a later ``next`` says, unless it had handed out all."""
        if inspect.getgeneratorstate(self.batches) != inspect.GEN_CLOSED:
            self.ended = why
        self.batches.close()


def few_queues() -> str | None:
    """Why the GPU decode would run slowly beside training in this process, if it would: CUDA's
    default 8 work queues (or fewer) make its kernels wait behind the step's, which halved it
    (bench/RESULTS.md runs L, AM). train.py asks for 32; a library leaves your process alone."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8").strip()
    if value.isdigit() and int(value) >= int(WORK_QUEUES):
        return None
    return (
        f"CUDA_DEVICE_MAX_CONNECTIONS is {value}: the GPU decode beside training runs at half speed or less; "
        f"set it to {WORK_QUEUES} before CUDA starts (train.py does)"
    )


def _decode(decode: str, device: torch.device) -> str:
    if decode not in DECODES:
        raise ConfigError(f"decode {decode!r}: use one of {', '.join(DECODES)}")
    if decode == "dali" and not dali_available():
        raise ConfigError(
            "--decode dali needs DALI, the dali extra: ./run venv --extra dali (pip: pip install -c "
            "requirements-dev.lock '.[dali]'; NGC's PyTorch images have it), or --decode gpu"
        )
    if decode == "auto":
        return "gpu" if device.type == "cuda" else "cpu"
    return decode
