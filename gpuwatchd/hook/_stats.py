"""Step records and their aggregation into one ``report`` (pure, no I/O).

The training thread appends one :data:`StepRecord` per step to a bounded deque;
the hook's background thread drains it every reporting period and calls
:func:`summarize`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["StepRecord", "summarize"]

StepRecord = tuple[float, float, int, int]
"""``(step_time_s, data_wait_s, samples, epoch)`` of one training step.

``step_time_s`` is the wall time from one ``next()`` call on the loader to the
following one (data wait + compute); ``data_wait_s`` is the time spent inside the
first of those ``next()`` calls; ``samples`` is the batch's length.
"""


def summarize(records: Iterable[StepRecord], steps_total: int) -> dict[str, Any] | None:
    """Aggregate one period's step records into the ``report`` object of protocol v1.

    Returns ``{"steps", "epoch", "step_time_s", "data_wait_s", "data_wait_fraction",
    "samples_per_s"}`` or ``None`` when the period had no step. ``steps`` is
    ``steps_total`` (steps since the job started, as ``model.JobReport.steps``);
    ``epoch`` is the epoch of the period's last step; ``step_time_s`` and
    ``data_wait_s`` are means per step in seconds; ``data_wait_fraction`` is
    ``sum(data_wait) / sum(step_time)`` clamped to 0..1; ``samples_per_s`` is
    ``sum(samples) / sum(step_time)``.
    """
    count = 0
    step_sum = 0.0
    wait_sum = 0.0
    samples_sum = 0
    epoch = 0
    for step_time_s, data_wait_s, samples, record_epoch in records:
        count += 1
        step_sum += step_time_s
        wait_sum += data_wait_s
        samples_sum += samples
        epoch = record_epoch
    if count == 0:
        return None
    fraction = min(1.0, max(0.0, wait_sum / step_sum)) if step_sum > 0 else 0.0
    return {
        "steps": max(steps_total, count),
        "epoch": epoch,
        "step_time_s": step_sum / count,
        "data_wait_s": wait_sum / count,
        "data_wait_fraction": fraction,
        "samples_per_s": samples_sum / step_sum if step_sum > 0 else 0.0,
    }
