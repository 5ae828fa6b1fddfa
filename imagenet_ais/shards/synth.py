"""A synthetic ImageNet tree: learnable pictures in the ILSVRC2012 folder layout.

Each class is a shape in a colour, drawn at a random position, scale and rotation over a
noisy, cluttered background, so a small model can learn it and a broken pipeline cannot.
The train split also carries the quirks real ImageNet has (CMYK, grayscale, PNG bytes
behind a .JPEG name) and, on request, files a converter must reject.
"""

from __future__ import annotations

import colorsys
import io
import json
import math
import random
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from imagenet_ais.errors import ConfigError
from imagenet_ais.shards import progress

# Written into the tree: the converter carries it into the manifest's "source", so a copy of the
# shards anywhere (another folder, AIStore) is still known as synthetic, and the demo as the demo.
DESCRIPTION = "synthetic.json"

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond", "hexagon", "bar")


def wnid(k: int) -> str:
    return f"n{10_000_000 + k:08d}"


def class_style(k: int) -> tuple[str, tuple[int, int, int]]:
    hue = (k * 0.618034) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, 0.9, 0.95)
    return SHAPES[k % len(SHAPES)], (int(r * 255), int(g * 255), int(b * 255))


def _polygon(cx: float, cy: float, radius: float, sides: int, angle: float) -> list[tuple[float, float]]:
    angles = (angle + 2 * math.pi * i / sides for i in range(sides))
    return [(cx + radius * math.cos(a), cy + radius * math.sin(a)) for a in angles]


def draw_picture(k: int, rng: random.Random, size: tuple[int, int] | None = None) -> Image.Image:
    width, height = size or (rng.randint(150, 600), rng.randint(150, 600))
    bg = tuple(rng.randint(60, 200) for _ in range(3))
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 8)):  # clutter that carries no class information
        pts = [(rng.uniform(0, width), rng.uniform(0, height)) for _ in range(2)]
        draw.line(pts, fill=tuple(rng.randint(0, 255) for _ in range(3)), width=rng.randint(1, 4))

    shape, colour = class_style(k)
    radius = rng.uniform(0.18, 0.4) * min(width, height)
    cx, cy = rng.uniform(radius, width - radius), rng.uniform(radius, height - radius)
    angle = rng.uniform(0, 2 * math.pi)
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=max(3, int(radius / 3)))
    elif shape == "square":
        draw.polygon(_polygon(cx, cy, radius, 4, angle), fill=colour)
    elif shape == "diamond":
        draw.polygon(_polygon(cx, cy, radius, 4, math.pi / 4), fill=colour)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, radius, 3, angle), fill=colour)
    elif shape == "hexagon":
        draw.polygon(_polygon(cx, cy, radius, 6, angle), fill=colour)
    elif shape == "cross":
        t = radius / 3
        draw.rectangle((cx - radius, cy - t, cx + radius, cy + t), fill=colour)
        draw.rectangle((cx - t, cy - radius, cx + t, cy + radius), fill=colour)
    else:  # bar
        t = radius / 4
        draw.rectangle((cx - radius, cy - t, cx + radius, cy + t), fill=colour)

    pixels = np.asarray(img, dtype=np.int16)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, 12, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def _jpeg(img: Image.Image, rng: random.Random, quality: int | None = None) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality or rng.randint(75, 95))
    return buf.getvalue()


def _quirk_bytes(quirk: str, img: Image.Image, rng: random.Random) -> bytes:
    buf = io.BytesIO()
    if quirk == "cmyk":
        img.convert("CMYK").save(buf, format="JPEG", quality=90)
    elif quirk == "gray":
        img.convert("L").save(buf, format="JPEG", quality=90)
    else:  # png: PNG bytes behind a .JPEG name
        img.save(buf, format="PNG")
    return buf.getvalue()


QUIRKS = ("cmyk", "gray", "png")


@dataclass(frozen=True)
class _Job:
    out: Path
    split: str
    k: int
    i: int
    name: str
    seed: int
    quirk: str | None
    size: tuple[int, int] | None
    quality: int | None


def _write(job: _Job) -> None:
    rng = random.Random(f"{job.seed}:{job.split}:{job.k}:{job.i}")  # per image: any process order gives one tree
    img = draw_picture(job.k, rng, job.size)
    data = _quirk_bytes(job.quirk, img, rng) if job.quirk else _jpeg(img, rng, job.quality)
    (job.out / job.split / wnid(job.k) / job.name).write_bytes(data)


def make_tree(
    out: Path,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    seed: int,
    with_bad: bool = False,
    size: tuple[int, int] | None = None,
    quality: int | None = None,
    workers: int = 1,
) -> dict[str, int]:
    """Write the tree; returns the number of files written per split.

    ``size`` fixes every picture's (width, height) and ``quality`` their JPEG quality (else
    random); (500, 375) at 95 gives ImageNet-like files of about 110 KB.
    """
    if classes < 1 or train_per_class < 1 or val_per_class < 0:
        raise ConfigError("need at least one class and one training image per class")
    # The last training image of classes 0, 1, 2 (wrapping) carries one quirk each.
    quirk_of = {(i % classes, train_per_class - 1 - i // classes): q for i, q in enumerate(QUIRKS)}
    jobs = [
        _Job(out, "train", k, i, f"{wnid(k)}_{i}.JPEG", seed, quirk_of.get((k, i)), size, quality)
        for k in range(classes)
        for i in range(train_per_class)
    ]
    jobs += [
        _Job(out, "val", k, i, f"ILSVRC2012_val_{k * val_per_class + i + 1:08d}.JPEG", seed, None, size, quality)
        for k in range(classes)
        for i in range(val_per_class)
    ]
    for job in jobs:
        (out / job.split / wnid(job.k)).mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        done = pool.map(_write, jobs, chunksize=64) if pool else map(_write, jobs)
        with progress.bar(len(jobs), f"synth {out}", "images") as bar:
            for _ in done:
                bar.update()
    counts = {split: sum(job.split == split for job in jobs) for split in ("train", "val")}
    if with_bad:
        rng = random.Random(f"{seed}:bad")
        good = _jpeg(draw_picture(0, rng), rng)
        bad = {"truncated": good[: len(good) // 2], "empty": b"", "notimage": b"this is not an image\n"}
        for what, data in bad.items():
            (out / "train" / wnid(0) / f"{wnid(0)}_{what}.JPEG").write_bytes(data)
        counts["train"] += len(bad)
    made = {"seed": seed, "classes": classes, "size": list(size) if size else None, "quality": quality}
    (out / DESCRIPTION).write_text(json.dumps(made) + "\n")
    return counts


def description(tree: Path) -> dict[str, object] | None:
    """What ``make_tree`` wrote into ``tree`` (None for a tree it did not make)."""
    try:
        made = json.loads((tree / DESCRIPTION).read_text())
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) else None
