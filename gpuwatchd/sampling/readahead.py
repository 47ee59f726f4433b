"""An iterator read one item ahead in a worker thread.

A streamed CSV backtest parses a trace's next block (pyarrow's CSV reader and numpy,
which release the GIL) while the array backtest works on the current one; on two cores
a day of 8 GPUs in CSV takes about a quarter less wall time (docs/benchmarks.md).
Specification: docs/backtests.md.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterable
from typing import Final, TypeVar

__all__ = ["read_ahead"]

T = TypeVar("T")

_POLL_S: Final = 0.1
"""How often a worker blocked on a full queue looks whether the consumer has gone."""

_JOIN_S: Final = 10.0
"""How long closing waits for the worker to finish the item it is making."""


class _End:
    """The worker's last item: the source ended, or raised ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def read_ahead(items: Iterable[T], depth: int = 1) -> Generator[T, None, None]:
    """The items of ``items`` in order, each produced in a worker thread while the
    caller works on the one before: at most ``depth`` items wait, done, for the caller
    (memory: ``depth + 2`` items at once: one being made, those waiting, the caller's).

    What iterating ``items`` raises is raised here, at the item where it happened.
    Closing this generator early (``break``, an exception in the caller, garbage
    collection) stops the worker after the item it is making, waiting up to
    :data:`_JOIN_S` seconds for that item; ``items`` is not used again. The worker is a
    daemon thread: a process that exits does not wait for it.

    Raises:
        ValueError: ``depth`` < 1.
    """
    if depth < 1:
        raise ValueError(f"read_ahead depth must be >= 1, got {depth}")
    done: queue.Queue[T | _End] = queue.Queue(maxsize=depth)
    gone = threading.Event()

    def put(item: T | _End) -> bool:
        while not gone.is_set():
            try:
                done.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:  # handed to the caller, raised there
            put(_End(exc))
            return
        put(_End(None))

    worker = threading.Thread(target=work, name="gpuwatchd-read-ahead", daemon=True)
    worker.start()
    try:
        while True:
            item = done.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        gone.set()
        # the item being made is finished (a block of a trace: tens of ms), so that no
        # worker is left inside pyarrow when the interpreter exits
        worker.join(_JOIN_S)
