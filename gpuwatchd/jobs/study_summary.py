"""An Optuna study's numbers (``gpuwatchctl study``) computed from its trials. Pure: no
storage, no Optuna import; ``gpuwatchd.jobs.study.study_stats`` reads the trials.

Specification: docs/modules.md#gpuwatchdjobsstudy_summary
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpuwatchd.jobs.trial_lineage import RetryChains

if TYPE_CHECKING:  # pragma: no cover - typing only
    from optuna.trial import FrozenTrial

__all__ = ["STATES", "summarize_trials"]

STATES = ("RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL")
"""Optuna's :class:`~optuna.trial.TrialState` names, in the order ``study_stats`` reports them."""


def _timestamp(value: datetime | None) -> float | None:
    # Naive datetimes (Optuna's datetime.now()) are local time, as time.time() compares.
    return None if value is None else value.timestamp()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_trials(
    name: str, directions: list[str], trials: Sequence[FrozenTrial], now_s: float
) -> dict[str, Any]:
    """One study's entry of ``gpuwatchd.jobs.study.study_stats`` (its docstring and
    docs/studies.md give the shape) from its ``trials``.

    Args:
        name: the study's name.
        directions: ``"minimize"``/``"maximize"``, one per objective.
        trials: all the study's trials (:class:`optuna.trial.FrozenTrial`).
        now_s: "now" in seconds since the epoch, for ``trials_per_hour.last_hour``.
    """
    total = len(trials)
    counts = dict.fromkeys(STATES, 0)
    durations: dict[str, list[float]] = {state: [] for state in STATES}
    for trial in trials:
        state = trial.state.name
        counts[state] = counts.get(state, 0) + 1
        start, complete = _timestamp(trial.datetime_start), _timestamp(trial.datetime_complete)
        if start is not None and complete is not None:
            durations.setdefault(state, []).append(complete - start)
    states = {
        state: {
            "count": counts[state],
            "pct": 100.0 * counts[state] / total if total else 0.0,
            "mean_duration_s": _mean(durations[state]),
        }
        for state in counts
    }
    decided = counts["COMPLETE"] + counts["PRUNED"]
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]
    starts = [s for t in trials if (s := _timestamp(t.datetime_start)) is not None]
    completes = [c for t in finished if (c := _timestamp(t.datetime_complete)) is not None]
    first_start = min(starts) if starts else None
    last_complete = max(completes) if completes else None
    overall = None
    if first_start is not None and last_complete is not None and last_complete > first_start:
        overall = len(finished) / ((last_complete - first_start) / 3600.0)
    chains = RetryChains(trials)
    retry_trials = [t for t in trials if chains.is_retry(t.number)]
    by_state = dict.fromkeys(STATES, 0)
    made_by: dict[str, int] = {"gpuwatchd": 0, "optuna": 0}
    histories = []
    for trial in retry_trials:
        by_state[trial.state.name] = by_state.get(trial.state.name, 0) + 1
        made_by[chains.maker(trial.number) or "gpuwatchd"] += 1
        histories.append(chains.history(trial.number))
    best_value: float | None = None
    best_trial: int | None = None
    if len(directions) == 1:
        valued = [
            (float(t.value), t.number)
            for t in trials
            if t.state.name == "COMPLETE" and t.value is not None
        ]
        if valued:
            sign = 1.0 if directions[0] == "minimize" else -1.0
            best_value, best_trial = min(valued, key=lambda vn: (sign * vn[0], vn[1]))
    return {
        "study": name,
        "directions": directions,
        "trials": total,
        "states": states,
        "pruned_pct": 100.0 * counts["PRUNED"] / decided if decided else None,
        "retries": {
            "retry_trials": len(retry_trials),
            "retried_trials": len({history[0] for history in histories}),
            "max_retry": max((len(history) for history in histories), default=0),
            "by_state": by_state,
            "made_by": made_by,
        },
        "trials_per_hour": {
            "overall": overall,
            "last_hour": sum(1 for c in completes if now_s - 3600.0 <= c <= now_s),
        },
        "first_start_s": first_start,
        "last_complete_s": last_complete,
        "best_value": best_value,
        "best_trial": best_trial,
    }
