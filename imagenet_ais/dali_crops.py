"""Decode "dali": the GPU's hardware JPEG decoders turn each batch's crops into pixels.

The workers pick every crop as for decode "gpu" (transforms.py: the same boxes from the same
draws), and this stage hands the batch's JPEG bytes and boxes to a DALI pipeline through
``external_source``: its region-of-interest decoder decodes only each box, on the H100's JPEG
engines where it can (``HW_DECODER_LOAD``), and resizes it to size × size. The SMs are left to
the step, where nvJPEG's CUDA decode (torchvision) takes them. Flip, augmentation and
normalisation stay ours (``transforms.crop_decoded``), as do the epochs, the streams, the
cache and the data-health accounting.

DALI is an optional dependency (``pip install .[dali]``; NGC's PyTorch images ship it). On the
CPU the same pipeline runs DALI's CPU decoder (what the tests exercise here).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

from imagenet_ais.transforms import Encoded

# Share of the JPEG work given to the hardware decoders: nearly all of it (MLPerf's H100
# ResNet-50 setting), since beside training the CUDA decoders would take the step's SMs.
HW_DECODER_LOAD = 0.99
THREADS = 4  # DALI's host threads per pipeline: JPEG parsing and the hardware decoder's queue


def available() -> bool:
    """Whether DALI is installed (it is imported only when a pipeline is built)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no nvidia package at all (a CPU build of torch)
        return False


class DaliFailed(RuntimeError):
    """DALI could not decode a batch (a pipeline is rebuilt after this)."""


class DaliCrops:
    """Encoded batch → uint8 N × size × size × 3 on ``device``: each sample's box decoded and resized.

    One pipeline per batch size and crop size (built on first use, rebuilt after a failure, as
    a DALI pipeline that raised is unusable). Call from one thread at a time.
    """

    def __init__(self, device: torch.device, threads: int = THREADS):
        self.device, self.threads = device, threads
        self.pipe: Any = None
        self.shape = (0, 0)  # (batch, size) the pipeline was built for

    def __call__(self, batch: Encoded, size: int) -> torch.Tensor:
        n = len(batch.sizes)
        if self.pipe is None or self.shape[0] < n or self.shape[1] != size:
            self.pipe, self.shape = self._build(n, size), (n, size)
        boxes = batch.boxes.numpy()
        self.pipe.feed_input("jpegs", np.split(batch.blob.numpy(), np.cumsum(batch.sizes)[:-1]))
        self.pipe.feed_input("anchors", np.ascontiguousarray(boxes[:, 0:2], dtype=np.int32))
        self.pipe.feed_input("shapes", np.ascontiguousarray(boxes[:, 2:4], dtype=np.int32))
        try:
            (pixels,) = self.pipe.run()
        except RuntimeError as e:
            self.pipe = None
            raise DaliFailed(_reason(e)) from e
        return self._to_torch(pixels.as_tensor())

    def _build(self, batch: int, size: int) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        cuda = self.device.type == "cuda"

        @pipeline_def(
            batch_size=batch,
            num_threads=self.threads,
            device_id=(self.device.index or 0) if cuda else None,
            exec_async=False,  # one batch per call, in this thread: the feed already overlaps
            exec_pipelined=False,
            prefetch_queue_depth=1,
        )
        def crops() -> Any:
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
            anchors = fn.external_source(name="anchors", dtype=types.INT32)
            shapes = fn.external_source(name="shapes", dtype=types.INT32)
            # Pixels as PIL and torchvision read them: EXIF orientation is not applied there either.
            mixed = {"hw_decoder_load": HW_DECODER_LOAD} if cuda else {}
            images = fn.decoders.image_slice(
                jpegs, anchors, shapes, device="mixed" if cuda else "cpu", output_type=types.RGB,
                adjust_orientation=False, axis_names="WH", **mixed,
            )  # fmt: skip
            return fn.resize(images, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)

        pipe = crops()
        pipe.build()
        return pipe

    def _to_torch(self, pixels: Any) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        out = torch.empty(pixels.shape(), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        feed_ndarray(pixels, out, cuda_stream=stream)
        return out


def _reason(e: RuntimeError) -> str:
    """The line of a DALI error that says what went wrong (it comes after the operator's traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    after = lines.index("encountered:") + 1 if "encountered:" in lines else 0
    return lines[after].rstrip(" :") if after < len(lines) else type(e).__name__
