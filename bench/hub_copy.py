#!/usr/bin/env python3
"""SRC's converted shards written again as another tool's: the Hugging Face hub's
``timm/imagenet-1k-wds`` layout (``imagenet1k-train-NNNN.tar``, each sample ``KEY.jpg`` with the
same bytes, ``KEY.cls`` and ``KEY.json``), with no manifest: what ``index`` is for. The same
pictures both ways, so a training rate from each compares the two paths alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import webdataset as wds

from imagenet_ais.shards.manifest import load_manifest
from imagenet_ais.shards.members import members
from imagenet_ais.storage import open_store


def main(src: str, dst: str) -> None:
    Path(dst).mkdir(parents=True, exist_ok=True)
    store = open_store(src)
    for s, shard in enumerate(load_manifest(store).split("train").shards):
        with store.open(shard.name) as f, wds.TarWriter(f"{dst}/imagenet1k-train-{s:04d}.tar") as tar:
            sample: dict = {}
            for name, data in members(f):
                key, _, ext = name.partition(".")
                sample |= {"__key__": key, ext: data}
                if {"jpg", "cls"} <= sample.keys():
                    label = int(sample["cls"])
                    sample["json"] = json.dumps({"label": label, "filename": f"{key}.JPEG"}).encode()
                    tar.write(sample)
                    sample = {}


if __name__ == "__main__":
    main(*sys.argv[1:3])
