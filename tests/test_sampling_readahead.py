"""gpuwatchd.sampling.readahead: an iterator read one item ahead in a worker thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpuwatchd.sampling.readahead import read_ahead


class Source:
    """Numbered items, made in whatever thread asks, counted; raises at ``fail_at``."""

    def __init__(self, count: int, fail_at: int | None = None) -> None:
        self.count, self.fail_at = count, fail_at
        self.made: list[int] = []
        self.threads: set[str] = set()

    def __iter__(self) -> Iterator[int]:
        for n in range(self.count):
            self.threads.add(threading.current_thread().name)
            if n == self.fail_at:
                raise ValueError(f"item {n} is malformed")
            self.made.append(n)
            yield n


def _wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_items_come_in_order_each_made_in_the_worker_thread() -> None:
    source = Source(1000)
    assert list(read_ahead(source)) == list(range(1000))
    assert source.threads == {"gpuwatchd-read-ahead"}


def test_the_next_item_is_made_while_the_caller_works_on_the_current_one() -> None:
    source = Source(10)
    items = read_ahead(source, depth=2)
    assert next(items) == 0
    # the caller holds item 0: the worker has made 1 and 2 (waiting) and 3 (blocked)
    _wait_for(lambda: len(source.made) == 4)
    time.sleep(0.2)
    assert source.made == [0, 1, 2, 3]
    assert list(items) == list(range(1, 10))


def test_an_error_of_the_source_is_raised_at_its_item_after_the_ones_before() -> None:
    got: list[int] = []
    with pytest.raises(ValueError, match="item 3 is malformed"):
        for item in read_ahead(Source(10, fail_at=3)):
            got.append(item)
    assert got == [0, 1, 2]


def test_a_caller_that_stops_early_stops_the_worker_and_the_source() -> None:
    source = Source(10_000)
    items = read_ahead(source)
    assert next(items) == 0
    items.close()
    _wait_for(lambda: not any(t.name == "gpuwatchd-read-ahead" for t in threading.enumerate()))
    made = len(source.made)
    assert made <= 3  # item 0, the one waiting, the one being made
    time.sleep(0.2)
    assert len(source.made) == made


def test_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        next(read_ahead(Source(1), depth=0))
