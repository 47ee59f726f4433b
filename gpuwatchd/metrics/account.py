"""The counts behind gpuwatchd's Prometheus counters and its tick histogram.

Pure: fed on the daemon's event loop (each tick's snapshot and duration, each decision
that reached its outcome), copied there for a scrape (:meth:`MetricsAccount.copy`).
The label values come from outside (job names from hooks, policy names from files), so
every labelled count is capped (:data:`MAX_SERIES`). Specification: docs/metrics.md.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpuwatchd.control.protocol import TRIAL_STATES
from gpuwatchd.model import Snapshot

__all__ = [
    "MAX_SERIES",
    "OTHER",
    "TICK_DURATION_BUCKETS_S",
    "AccountCopy",
    "LabelledCounts",
    "MetricsAccount",
]

TICK_DURATION_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the tick duration histogram: a tick of 8 GPUs takes about
0.5 ms (bench/tick.py); 1 s is the default interval, past which ticks are skipped."""

MAX_SERIES: Final = 1000
"""Label sets one counter keeps; past it new ones are counted under :data:`OTHER`
(job names come from any hook on the control socket)."""

OTHER: Final = "_other"
"""Label value that stands for every label set past :data:`MAX_SERIES`."""

_TRIALS_REMEMBERED: Final = 4096
"""(job, trial number) pairs remembered so that one trial is counted once."""


class LabelledCounts:
    """Counts per label tuple, at most :data:`MAX_SERIES` tuples (then :data:`OTHER`)."""

    def __init__(self, width: int, limit: int = MAX_SERIES) -> None:
        self._width = width
        self._limit = limit
        self.counts: dict[tuple[str, ...], int] = {}

    def add(self, labels: tuple[str, ...], n: int = 1) -> None:
        """Add ``n`` to ``labels`` (a tuple of ``width`` strings)."""
        if labels not in self.counts and len(self.counts) >= self._limit:
            labels = (OTHER,) * self._width
        self.counts[labels] = self.counts.get(labels, 0) + n


@dataclass(frozen=True, slots=True)
class AccountCopy:
    """A scrape's copy of :class:`MetricsAccount`: plain values, safe in another thread.

    ``tick_buckets``: ticks per bucket of :data:`TICK_DURATION_BUCKETS_S` (not
    cumulative), the last one past 1 s; ``tick_sum_s``: seconds of all ticks.
    """

    tick_buckets: tuple[int, ...]
    tick_sum_s: float
    decisions: Mapping[tuple[str, ...], int]
    """(policy, action, outcome) -> decisions that reached that outcome."""
    crashes: Mapping[tuple[str, ...], int]
    """(job, crash kind) -> worker crashes."""
    trials: Mapping[tuple[str, ...], int]
    """(job, study, TrialState) -> trials that ended so."""


class MetricsAccount:
    """What gpuwatchd counts for its counters, since the daemon started.

    :meth:`observe_tick` takes each tick's snapshot: its ``crash`` events (the
    supervisor's classified crashes of managed workers and the hooks' of other jobs),
    its ``trial`` events (a hook's word that an Optuna trial ended) and a managed
    worker's crashed trial (the daemon fails it in the study), each trial once.
    :meth:`decided` takes each decision once its outcome is known. ``studies``: job ->
    Optuna study name of the configured jobs (an attached job's ``study`` names the
    others).
    """

    def __init__(self, studies: Mapping[str, str] | None = None) -> None:
        self._studies = dict(studies or {})
        self._buckets = [0] * (len(TICK_DURATION_BUCKETS_S) + 1)
        self._tick_sum_s = 0.0
        self.decisions = LabelledCounts(3)
        self.crashes = LabelledCounts(2)
        self.trials = LabelledCounts(3)
        self._ended: OrderedDict[tuple[str, int], None] = OrderedDict()

    def observe_tick(self, snapshot: Snapshot, duration_s: float) -> None:
        """Count one tick of ``duration_s`` seconds and the events of its ``snapshot``."""
        self._buckets[bisect.bisect_left(TICK_DURATION_BUCKETS_S, duration_s)] += 1
        self._tick_sum_s += duration_s
        if not snapshot.events:
            return
        studies = {job.name: job.study for job in snapshot.jobs if job.study}
        for event in snapshot.events:
            managed = self._studies.get(event.job)
            if event.kind == "crash":
                self.crashes.add((event.job, event.crash_kind or "other"))
                if managed and event.trial_number is not None:  # the daemon fails it
                    self._trial_ended(event.job, managed, event.trial_number, "FAIL")
            elif event.kind == "trial" and event.trial_state in TRIAL_STATES:
                study = managed or studies.get(event.job) or ""
                self._trial_ended(event.job, study, event.trial_number, event.trial_state)

    def _trial_ended(self, job: str, study: str, number: int | None, state: str) -> None:
        if number is not None:
            if (job, number) in self._ended:
                return  # the hook's FAIL and the crash of the same trial
            self._ended[(job, number)] = None
            if len(self._ended) > _TRIALS_REMEMBERED:
                self._ended.popitem(last=False)
        self.trials.add((job, study, state))

    def decided(self, policy: str, action: str, outcome: str) -> None:
        """Count one decision that reached ``outcome`` (``applied``, ``failed``, ...)."""
        self.decisions.add((policy, action, outcome))

    def copy(self) -> AccountCopy:
        """The counts now, as an :class:`AccountCopy` (call on the feeding thread)."""
        return AccountCopy(
            tick_buckets=tuple(self._buckets),
            tick_sum_s=self._tick_sum_s,
            decisions=dict(self.decisions.counts),
            crashes=dict(self.crashes.counts),
            trials=dict(self.trials.counts),
        )
