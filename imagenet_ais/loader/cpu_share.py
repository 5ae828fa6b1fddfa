"""Some training crops decoded in the DataLoader workers, while they would otherwise wait.

With decode "gpu" or "dali" a worker only reads each JPEG's header, and the GPU's decoder can be
the limit: ResNet-18 on one H200 had its decode thread busy 0.99 while the workers left most of
16 cores idle (bench/RESULTS.md run AK). So a worker crops a share of its training samples
itself (PIL, as decode "cpu" does, without the flip) and hands them over as pixels after the
batch's JPEGs; the device flips, augments and normalises them with the others. The crop and
flip are drawn as before, so a sample's crop is the same on either side (its pixels differ by
the resampling, as between decode "cpu" and "gpu").

"auto" adapts the share to the time a worker has. It starts at START, so that its first window
times a few crops; then every WINDOW seconds it compares the time it waited for the training
process to ask for more with IDLE, and turns STEP of the difference into crops, at what a crop
took in that window: a worker that waits takes more, one that is late gives some back to the
GPU, between 0 and LIMIT. (Until a crop has been timed it moves by GAIN times the difference.) A
wait longer than PAUSE (torch.compile, validation, a checkpoint) says nothing of the time to
spare while training runs: a new window starts after it. Every worker gives back, as if it had
not waited at all, while the training step waits for batches less than STEP_WAIT of its time
(the training loop's time blocked for its next batch, device_feed.DeviceFeed.step_wait: the feed
keeps up, and crops here cannot make the step faster, only take cores from it), and while the
cores this job may run on are over HOST_BUSY busy (a training process short of CPU makes its
workers wait too). A fixed share (``--cpu-share 0.2``) does none of this.

Measured on one H200 with 16 cores (bench/RESULTS.md run AL), ResNet-18 bs512: "auto" settled at
0.08-0.09 of the samples, 0.706-0.719 of the ceiling against 0.658-0.694 without; workers kept
10% idle took 0.17 and fell to 0.647 (the host's cores 0.91 busy, the feed's host thread waiting
on the workers), and a fixed 0.2 to 0.556. ResNet-50 bs256: 0.32 of the samples, 0.946 against 0.937.
With 8 cores (taskset, run AN) ResNet-50 lost by it: 0.911 against 0.935, the step waiting 6-8%
of its time instead of 4%, and the host's 16 cores, all the cap saw then, 0.41 busy. Hence the
training step's wait (STEP_WAIT) and the job's own cores for the cap (not yet measured on a GPU).

How soon it settles (run BC, bench/settle.sh: ResNet-18 bs512 from ``--max-side 256 --quality
90`` shards, 1,300 steps, against the ceiling of the same call): moved by GAIN from 0, the
workers cropped 0.07 of the samples over steps 10-50 and 0.21 over 50-100; with timed crops,
0.17 and 0.28; both held 0.16-0.28 after. From step 100 on, 0.878 of the ceiling over steps
100-500 and 0.876 over 100-1,300, against 0.857 and 0.854 on the same machine (0.863 / 0.887
against 0.849 / 0.877 on another, with a variant that also ignored STEP_WAIT for 5 s after a
pause: dropped, as it cropped where ResNet-50 at 160 px needed none, 0.940-0.943 against
0.945-0.948; the rule kept was not run on ResNet-50). What was still lost from step 100 on was not
the share: the workers' full garbage collections, all at about one step (worker.worker_init), and
the decode thread, on a core for 21-23 ms a batch of a 27-29 ms step (run BE): nvJPEG's hardware
path copies, launches a conversion and synchronises once per picture, and the conversions wait
behind the step's longest kernels (run BH), so a batch takes it a step's time whatever its number
of pictures. There crops do not lighten it: with the 256-side pictures ResNet-18 was fed at the
same rate with ``--cpu-share 0``, on 29-34% of the 16 cores instead of 71-81% (run BI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from ctypes import c_double
from multiprocessing.sharedctypes import Synchronized

from PIL import Image

from imagenet_ais.errors import ConfigError
from imagenet_ais.loader.cpu_time import own_cpu_jiffies
from imagenet_ais.loader.signals import Signals
from imagenet_ais.loader.transforms import crop_on_cpu

AUTO = "auto"
LIMIT = 0.5  # the most "auto" takes: engine.py sizes the workers' buffers for it
START = 0.05  # "auto"'s share before its first window: a few crops, whose cost the first window measures
IDLE = 0.25  # the part of its time an "auto" worker keeps waiting: cores left to the training process
HOST_BUSY = 0.85  # the job's cores busier than this: every "auto" worker gives some back
STEP_WAIT = 0.10  # the training step waiting for batches less than this share of its time: likewise
GAIN = 0.25  # the share moved per unit of waiting off IDLE, while no crop has been timed
STEP = 0.7  # the part of a window's spare (or missing) time the next window's crops fill (or free)
WINDOW = 1.0  # seconds of a worker's time between changes of its share
PAUSE = 5.0  # a longer wait: the training process was elsewhere (compiling, validating, saving)
FAILED = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)  # what PIL raises on a broken picture


def checked(share: float | str) -> float | str:
    """``share`` as a number between 0 and 1, or "auto"; else a one-line ConfigError."""
    if share == AUTO:
        return AUTO
    try:
        value = float(share)
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value <= 1:
        raise ConfigError(f"--cpu-share {share}: give 'auto' or a share of the samples between 0 and 1 (e.g. 0.2)")
    return value


class CpuShare:
    """(In a worker) which of its training samples it decodes itself: ``share`` of them, or with
    "auto" a share that follows the time it waits for requests and the time its crops take
    (``observe``), the share of its time the training step waits for batches (``step_wait``, set
    by the training process; None: unknown, taken as waiting), and how busy the job's ``cores``
    are ((busy, all) time so far)."""

    def __init__(
        self,
        share: float | str,
        cores: Callable[[], tuple[int, int] | None] = own_cpu_jiffies,
        step_wait: c_double | None = None,
    ):
        self.adaptive, self.cores, self.step_wait = share == AUTO, cores, step_wait
        self.share = START if self.adaptive else float(share)
        self.credit = 0.0  # shares of a sample owed: one is taken whenever it reaches 1
        self.cost: float | None = None  # the seconds a crop took, in the last window that made some
        self.host = cores() if self.adaptive else None  # the job's cores' (busy, all) time when the window began
        self.busy = self.idle = self.cropping = 0.0  # the window's seconds: making samples, waiting, cropping
        self.samples = self.crops = 0  # the window's

    def take(self) -> bool:
        """Whether to decode the next sample here."""
        self.credit += self.share
        if self.credit < 1:
            return False
        self.credit -= 1
        return True

    def observe(self, busy: float, idle: float, cropping: float = 0.0) -> None:
        """Seconds spent making a sample (``cropping`` of them cropping it here), and waiting until
        the next one was asked for."""
        if not self.adaptive:
            return
        if idle > PAUSE:  # says nothing of the time to spare while training runs: a window starts after it
            self.host = self.cores()
            self._new_window()
            return
        self.busy, self.idle, self.samples = self.busy + busy, self.idle + idle, self.samples + 1
        if cropping:
            self.cropping, self.crops = self.cropping + cropping, self.crops + 1
        if self.busy + self.idle >= WINDOW:
            self._move()

    def _move(self) -> None:
        """The share for the next window, from this one's."""
        total = self.busy + self.idle
        needed = self.host_busy() <= HOST_BUSY and (self.step_wait is None or self.step_wait.value >= STEP_WAIT)
        spare = (self.idle / total if needed else 0.0) - IDLE  # the window's time to fill with crops (< 0: to free)
        if self.crops:
            self.cost = self.cropping / self.crops
        # a share of 1 would have cropped each of the window's samples: samples × cost seconds
        gain = STEP * total / (self.samples * self.cost) if self.cost else GAIN
        self.share = min(LIMIT, max(0.0, self.share + gain * spare))
        self._new_window()

    def _new_window(self) -> None:
        self.busy = self.idle = self.cropping = 0.0
        self.samples = self.crops = 0

    def host_busy(self) -> float:
        """The share of the job's cores' time spent busy since the last call (0 where unknown).
        Its affinity's cores: under a cgroup's CPU quota (docker --cpus) they may be idle while
        the quota is spent."""
        before, self.host = self.host, self.cores()
        if before is None or self.host is None or self.host[1] <= before[1]:
            return 0.0
        return (self.host[0] - before[0]) / (self.host[1] - before[1])


def offload(
    samples: Iterator[tuple],
    share: CpuShare,
    size: int,
    cropped: Synchronized[int],
    failed: Callable[[tuple, str], None],
) -> Iterator[tuple]:
    """``samples`` (JPEG bytes, box, plan; then the rest), a share of them cropped to size ×
    size pixels here and counted in ``cropped``; one PIL cannot decode goes to ``failed`` with
    what went wrong instead, skipped as decode "cpu" skips it."""
    mark = time.perf_counter()
    for sample in samples:
        (raw, box, plan), *rest = sample
        cropping = 0.0
        if share.take():
            began = time.perf_counter()
            try:
                sample = ((crop_on_cpu(raw, box, size), box, plan), *rest)
            except FAILED as e:
                failed(sample, f"{type(e).__name__}: {e}")
                continue
            cropping = time.perf_counter() - began
            Signals.add(cropped)
        made = time.perf_counter()
        yield sample
        asked = time.perf_counter()  # (the wait includes collating the batch: a few ms of ~0.5 s here)
        share.observe(made - mark, asked - made, cropping)
        mark = asked
