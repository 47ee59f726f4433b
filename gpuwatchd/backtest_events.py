"""The events of a backtest (``gpuwatchd replay``): a finding started, a finding cleared, a
decision taken; both ways of computing a backtest (gpuwatchd/backtest.py stepping the
engine, gpuwatchd/backtest_arrays.py over arrays) make them. Specification:
docs/backtests.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuwatchd.model import Decision, Finding

__all__ = [
    "BacktestEvent",
    "DecisionTaken",
    "EventList",
    "EventsMade",
    "FindingCleared",
    "FindingStarted",
    "finding_order",
]


@dataclass(frozen=True, slots=True)
class FindingStarted:
    """A finding appeared at trace time ``timestamp_s`` (``offset_s`` after the trace start).

    ``finding.since_s`` is when its condition began to hold (``for:`` earlier, at least).
    """

    timestamp_s: float
    offset_s: float
    finding: Finding

    kind: ClassVar[Literal["finding_started"]] = "finding_started"


@dataclass(frozen=True, slots=True)
class FindingCleared:
    """A finding that started at ``started_s`` is gone at ``timestamp_s``.

    ``last`` is the last finding seen while it held. ``end_of_trace`` is True when
    the trace ended while it still held (``timestamp_s`` is then the last frame's).
    """

    timestamp_s: float
    offset_s: float
    last: Finding
    started_s: float
    end_of_trace: bool = False

    kind: ClassVar[Literal["finding_cleared"]] = "finding_cleared"

    @property
    def held_s(self) -> float:
        """Seconds from the finding's start to its clearing (trace time)."""
        return self.timestamp_s - self.started_s


@dataclass(frozen=True, slots=True)
class DecisionTaken:
    """The engine decided ``decision`` at trace time ``timestamp_s``."""

    timestamp_s: float
    offset_s: float
    decision: Decision

    kind: ClassVar[Literal["decision"]] = "decision"


BacktestEvent = FindingStarted | FindingCleared | DecisionTaken
"""One line of a backtest's output; ``.kind`` is ``finding_started``, ``finding_cleared``
or ``decision``."""


def finding_order(finding: Finding) -> tuple[int, str, str, float]:
    """The sort key of findings that start or clear at the same frame: GPU index (-1
    for none), detector, subject, threshold (the backtest's output order)."""
    index = -1 if finding.gpu_index is None else finding.gpu_index
    return (index, finding.detector, finding.subject, finding.threshold)


class EventList:
    """The events of one backtest as they are made, in order: the first ``limit`` kept
    (None: every one), the rest only counted in :attr:`omitted`, so that a long trace
    (bench/replay.py's month of 64 GPUs: 546,083 events, with their findings' messages)
    is backtested in memory that does not grow with its events. Raises ValueError for
    a negative ``limit``."""

    __slots__ = ("_limit", "kept", "omitted")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"limit {limit}: not >= 0")
        self._limit = limit
        self.kept: list[BacktestEvent] = []
        self.omitted = 0

    def append(self, event: BacktestEvent) -> None:
        """Keep ``event`` if fewer than ``limit`` are kept, else count it."""
        if self._limit is None or len(self.kept) < self._limit:
            self.kept.append(event)
        else:
            self.omitted += 1

    def extend(self, events: Iterable[BacktestEvent]) -> None:
        """:meth:`append` each of ``events``."""
        for event in events:
            self.append(event)


EventsMade = tuple[EventList, int, int]
"""(the events made, findings started, decisions) of one backtest: what
:func:`gpuwatchd.backtest.run_backtest` steps or computes over arrays
(gpuwatchd/backtest_arrays.py), before its summary."""
