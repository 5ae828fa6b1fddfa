"""Decode "dali": DALI decodes each batch's crops on the GPU's hardware JPEG decoders.

The workers pick every crop as for decode "gpu" (transforms.py: the same boxes from the same
draws), and this stage hands the batch's JPEG bytes and boxes to DALI pipelines through
``external_source``: the region-of-interest decoder decodes each box, on the JPEG engines where
it can (``HW_DECODER_LOAD``), and resizes it to size × size. Flip, augmentation and
normalisation stay ours (``device_decode.crop_decoded``), as do the epochs, the streams, the cache
and the data-health accounting.

Measured on long epochs (bench/RESULTS.md run AG, one H200): as fast as decode "gpu" end to end
(torchvision's batched nvJPEG uses the same engines for baseline JPEGs), though faster alone;
so ``--decode auto`` keeps "gpu", and this is the choice to try where nvJPEG's decode is the limit.

DALI is an optional dependency (the ``dali`` extra: ``./run venv --extra dali``; NGC's PyTorch
images ship it). On the CPU the same pipeline runs DALI's CPU decoder (what the tests exercise
here).
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
from typing import Any

import numpy as np
import torch

from imagenet_ais.loader.wire import Encoded

# Share of the JPEG work given to the hardware decoders: nearly all of it (MLPerf's H100 setting).
# Alone on an H200, one pipeline: 0.65 → 5,422 img/s, 0.9 → 10,378, 0.99 → 11,563 (RESULTS run AG).
HW_DECODER_LOAD = 0.99
THREADS = 4  # DALI's host threads per pipeline: JPEG parsing and the hardware decoder's queue
# A batch is cut into this many parts, each run by a pipeline of its own at the same time: one
# pipeline that runs a batch per call leaves the engines idle while it parses and resizes. Alone,
# 512 crops on an H200: 1 part 11,563 img/s, 2 12,337, 3 14,701, 4 18,121 (nvJPEG's 15,996).
PARTS = 4


def available() -> bool:
    """Whether DALI is installed (it is imported only when a pipeline is built)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no nvidia package at all (a CPU build of torch)
        return False


class DaliFailed(RuntimeError):
    """DALI could not decode a batch (its pipeline is rebuilt after this)."""


class DaliCrops:
    """Encoded batch → uint8 N × size × size × 3 on ``device``: each sample's box decoded and resized.

    The batch is decoded in ``parts`` pieces at once, one DALI pipeline each (built on first use
    for the largest piece and the size; rebuilt after a failure, as a pipeline that raised is
    unusable). Call from one thread at a time.
    """

    def __init__(self, device: torch.device, threads: int = THREADS, parts: int = PARTS):
        self.device, self.threads, self.parts = device, threads, parts
        self.pipes: list[Any] = []
        self.shape = (0, 0)  # (piece, size) the pipelines were built for

    def __call__(self, batch: Encoded, size: int) -> torch.Tensor:
        n = len(batch.sizes)
        piece = math.ceil(n / self.parts)
        if not self.pipes or self.shape[0] < piece or self.shape[1] != size:
            self.pipes, self.shape = [self._build(piece, size) for _ in range(self.parts)], (piece, size)
        jpegs = np.split(batch.blob.numpy(), np.cumsum(batch.sizes)[:-1])
        boxes = batch.boxes[:n].numpy().astype(np.int32)  # (the rows after are cropped already)
        out = torch.empty(n, size, size, 3, dtype=torch.uint8, device=self.device)
        # the calling thread's stream (the feed's decode stage's side stream), which other threads do not have
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        starts = range(0, n, piece)
        runs = [
            _Run(self.pipes[i], a, jpegs[a : a + piece], boxes[a : a + piece], out[a : a + piece], stream)
            for i, a in enumerate(starts)
        ]
        threads = [threading.Thread(target=run, name="dali-part") for run in runs[1:]]
        for thread in threads:
            thread.start()
        runs[0]()
        for thread in threads:
            thread.join()
        if failures := [(run.error, run.reason()) for run in runs if run.error is not None]:
            self.pipes = []
            if stream is not None:  # the parts that did decode may still be copying into ``out``,
                stream.synchronize()  # which the caller drops, its memory going to nvJPEG's outputs next
            error, reason = failures[0]
            if isinstance(error, RuntimeError):  # DALI's errors: a sample it cannot decode
                raise DaliFailed(reason) from error
            raise error
        return out

    def _build(self, batch: int, size: int) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        cuda = self.device.type == "cuda"

        @pipeline_def(
            batch_size=batch,
            num_threads=self.threads,
            device_id=(self.device.index or 0) if cuda else None,
            exec_async=False,  # one piece per call, in the calling thread
            exec_pipelined=False,
            prefetch_queue_depth=1,
        )
        def crops() -> Any:
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
            anchors = fn.external_source(name="anchors", dtype=types.INT32)
            shapes = fn.external_source(name="shapes", dtype=types.INT32)
            # Pixels as PIL and torchvision read them: EXIF orientation is not applied there either.
            mixed: dict[str, Any] = {"hw_decoder_load": HW_DECODER_LOAD} if cuda else {}
            images = fn.decoders.image_slice(
                jpegs, anchors, shapes, device="mixed" if cuda else "cpu", output_type=types.RGB,
                adjust_orientation=False, axis_names="WH", **mixed,
            )  # fmt: skip
            return fn.resize(images, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)

        pipe = crops()
        pipe.build()
        return pipe


class _Run:
    """One pipeline's piece of a batch, decoded into its rows of the output (any thread)."""

    def __init__(
        self, pipe: Any, start: int, jpegs: list[np.ndarray], boxes: np.ndarray, out: torch.Tensor, stream: Any
    ):
        self.pipe, self.start, self.jpegs, self.boxes, self.out, self.stream = pipe, start, jpegs, boxes, out, stream
        self.error: BaseException | None = None  # raised by the caller, in its thread

    def __call__(self) -> None:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        try:
            self.pipe.feed_input("jpegs", self.jpegs)
            self.pipe.feed_input("anchors", np.ascontiguousarray(self.boxes[:, 0:2]))
            self.pipe.feed_input("shapes", np.ascontiguousarray(self.boxes[:, 2:4]))
            (pixels,) = self.pipe.run()
            feed_ndarray(pixels.as_tensor(), self.out, cuda_stream=self.stream)
        except BaseException as e:
            self.error = e

    def reason(self) -> str:
        """The line of DALI's error that says what went wrong (after the operator's traceback), its
        sample numbered in the whole batch."""
        lines = [line.strip() for line in str(self.error).splitlines() if line.strip()]
        after = lines.index("encountered:") + 1 if "encountered:" in lines else 0
        line = lines[after].rstrip(" :") if after < len(lines) else type(self.error).__name__
        return re.sub(r"sample #(\d+)", lambda m: f"sample #{int(m[1]) + self.start}", line)
