"""The device feed: order, stages in threads of their own, errors reach the consumer, it stops cleanly."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from imagenet_ais.loader.device_feed import DeviceFeed, Merged, tensors_in

CPU = torch.device("cpu")


def as_tensor(i: int) -> tuple[torch.Tensor, int]:
    return torch.tensor([i]), i


def test_items_arrive_prepared_and_in_order() -> None:
    got = [(int(t), i) for t, i in DeviceFeed(iter(range(50)), [("prepare", as_tensor)], CPU, ahead=3)]
    assert got == [(i, i) for i in range(50)]


def test_stages_overlap_in_threads_of_their_own_and_say_how_busy_they_were() -> None:
    spans: dict[str, list[tuple[float, float]]] = {"first": [], "second": []}

    def stage(name: str):
        def work(item: object) -> object:
            begin = time.perf_counter()
            time.sleep(0.02)
            spans[name].append((begin, time.perf_counter()))
            return (item, threading.current_thread().name) if name == "first" else (*item, name)

        return work

    feed = DeviceFeed(iter(range(20)), [("first", stage("first")), ("second", stage("second"))], CPU, ahead=2)
    assert list(feed) == [(i, "feed-first", "second") for i in range(20)]
    # the first stage works on an item while the second works on the one before
    assert any(a < d and c < b for a, b in spans["first"] for c, d in spans["second"])
    busy = feed.busy()
    assert set(busy) == {"host", "first", "second"}
    assert busy["first"] >= 20 * 0.02 and busy["second"] >= 20 * 0.02
    assert feed.busy() == {"host": 0.0, "first": 0.0, "second": 0.0}  # reset once read


def test_a_merged_stage_takes_the_items_waiting_for_it_together() -> None:
    calls: list[list[int]] = []

    def many(items: list[int]) -> list[tuple[torch.Tensor, int]]:
        calls.append(items)
        time.sleep(0.02)  # (the items behind pile up meanwhile)
        return [as_tensor(i) for i in items]

    got = [i for _, i in DeviceFeed(iter(range(21)), [("decode", Merged(many, most=2))], CPU, ahead=2)]
    assert got == list(range(21))  # each once, in order, the last one too
    assert [i for items in calls for i in items] == list(range(21))
    assert {len(items) for items in calls} == {1, 2} and max(map(len, calls)) == 2


def test_an_error_behind_merged_items_comes_after_them() -> None:
    def items() -> Iterator[int]:
        yield from range(5)
        raise OSError("the shard went away")

    feed = DeviceFeed(items(), [("decode", Merged(lambda items: [as_tensor(i) for i in items], most=4))], CPU)
    got = []
    with pytest.raises(OSError, match="the shard went away"):
        for _, i in feed:
            got.append(i)
    assert got == list(range(5))


def slowly(item: int) -> tuple[torch.Tensor, int]:
    time.sleep(0.03)
    return as_tensor(item)


def test_step_wait_says_how_much_of_its_time_the_consumer_waits() -> None:
    # (cpu_share.py's workers crop only while the training step waits for batches)
    waiting = DeviceFeed(iter(range(40)), [("prepare", slowly)], CPU, ahead=2)
    for _ in waiting:
        pass  # the producer is the limit
    fed = DeviceFeed(iter(range(40)), [("prepare", as_tensor)], CPU, ahead=2)
    for _ in fed:
        time.sleep(0.03)  # the consumer is
    assert waiting.step_wait > 0.7 and fed.step_wait < 0.3, (waiting.step_wait, fed.step_wait)


def test_step_wait_is_a_mean_at_first_then_follows_the_last_seconds() -> None:
    feed = DeviceFeed(iter([]), [], CPU, step_wait=0.4)  # (as a loader carries it from its last epoch)
    feed.close()
    feed._waited(3.0, 10.0)  # the first item: the producer starting up, left out
    assert feed.step_wait == 0.4
    for now in range(11, 21):  # ten seconds fed: a 1 s step, no wait
        feed._waited(0.0, now)
    assert feed.step_wait == 0
    for now in range(21, 26):  # then five that waited every second
        feed._waited(1.0, now)
    assert feed.step_wait == pytest.approx(1 - 0.8**5)  # 1 s of 5 each time, not a mean over the 15


def test_an_error_while_pulling_items_reaches_the_consumer() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise OSError("shard gone")

    feed = DeviceFeed(items(), [("prepare", as_tensor)], CPU)
    assert next(feed)[1] == 1
    with pytest.raises(OSError, match="shard gone"):
        next(feed)
    assert not any(t.is_alive() for t in feed.threads)


def test_an_error_in_a_later_stage_stops_every_thread() -> None:
    def prepare(i: int) -> tuple:
        if i == 3:
            raise RuntimeError("bad batch")
        return as_tensor(i)

    feed = DeviceFeed(
        itertools.count(), [("add", lambda i: i + 1), ("prepare", prepare)], CPU
    )  # the puller would go on forever
    with pytest.raises(RuntimeError, match="bad batch"):
        list(feed)
    assert not any(t.is_alive() for t in feed.threads)


def test_close_stops_a_feed_that_is_ahead_of_its_consumer() -> None:
    feed = DeviceFeed(itertools.count(), [("prepare", as_tensor)], CPU, ahead=2)
    next(feed)
    feed.close(timeout=5)
    assert not any(t.is_alive() for t in feed.threads)
    assert not set(feed.threads) & set(threading.enumerate())  # (another test's feed may still be ending)


def test_a_feed_closed_from_one_of_its_own_threads_stops_the_others() -> None:
    # (a collection that ends a dropped loader closes its feed in whichever thread it runs: one of
    # the feed's own, say, which cannot join itself)
    closing: list[BaseException | None] = []
    named = threading.Event()

    def prepare(i: int) -> tuple:
        if i == 3:
            # (the threads start inside DeviceFeed(): this item can come before ``feed`` is bound,
            # a NameError in a clean clone's suite)
            named.wait(10)
            try:
                feed.close(timeout=5)
                closing.append(None)
            except RuntimeError as e:  # "cannot join current thread"
                closing.append(e)
        return as_tensor(i)

    feed = DeviceFeed(itertools.count(), [("add", lambda i: i + 1), ("prepare", prepare)], CPU, ahead=2)
    named.set()
    next(feed)
    deadline = time.monotonic() + 10
    while not closing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closing == [None]
    for thread in feed.threads:
        thread.join(10)
    assert not any(t.is_alive() for t in feed.threads)


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
