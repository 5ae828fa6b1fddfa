"""The device feed: order, errors from either thread reach the consumer, and it stops cleanly."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from imagenet_ais.feed import DeviceFeed, tensors_in

CPU = torch.device("cpu")


def as_tensor(i: int) -> tuple[torch.Tensor, int]:
    return torch.tensor([i]), i


def test_items_arrive_prepared_and_in_order() -> None:
    got = [(int(t), i) for t, i in DeviceFeed(iter(range(50)), as_tensor, CPU, ahead=3)]
    assert got == [(i, i) for i in range(50)]


def test_an_error_while_pulling_items_reaches_the_consumer() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise OSError("shard gone")

    feed = DeviceFeed(items(), as_tensor, CPU)
    assert next(feed)[1] == 1
    with pytest.raises(OSError, match="shard gone"):
        next(feed)
    assert not any(t.is_alive() for t in feed.threads)


def test_an_error_while_preparing_stops_both_threads() -> None:
    def prepare(i: int) -> tuple:
        if i == 3:
            raise RuntimeError("bad batch")
        return as_tensor(i)

    feed = DeviceFeed(itertools.count(), prepare, CPU)  # the puller would go on forever
    with pytest.raises(RuntimeError, match="bad batch"):
        list(feed)
    assert not any(t.is_alive() for t in feed.threads)


def test_close_stops_a_feed_that_is_ahead_of_its_consumer() -> None:
    feed = DeviceFeed(itertools.count(), as_tensor, CPU, ahead=2)
    next(feed)
    feed.close(timeout=5)
    assert not any(t.is_alive() for t in feed.threads)
    assert not [t for t in threading.enumerate() if t.name in ("host-batches", "device-feed")]


def test_tensors_nested_in_the_prepared_tuple_are_all_found() -> None:
    # On CUDA each of them is marked as used by the training stream; one missed would have
    # its memory reused for the next batch while the step still reads it.
    class Batch(NamedTuple):
        images: torch.Tensor
        labels: torch.Tensor
        keys: list[str]

    images, labels = torch.zeros(2, 3), torch.zeros(2)
    ready = (Batch(images, labels, ["a", "b"]), [(0, 1), (0, 2)])
    assert [id(t) for t in tensors_in(ready)] == [id(images), id(labels)]
