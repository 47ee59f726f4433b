"""``tune_loader``: tune a DataLoader knob of the jobs concerned in closed loop.

Decision: for each group, the attached jobs with the knob it concerns (as ``set_knob``)
get a tuning session on the host's one :class:`~gpuwatchd.policy.tuner.LoaderTuner`
(none while one runs); the firing itself decides nothing. The tuner then makes one
decision per move or hold (:func:`decision_of`, not accounted: it paces itself), with
``params = {"knob", "value", "previous", "verdict", "samples_per_s_before",
"samples_per_s_after"}``. Plan: a hold (``value == previous``) is ``logged``; a move on
a knob an operator holds is ``refused``. Carrying out: as ``set_knob``. docs/tuning.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ExclusiveGroup, ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions import set_knob
from gpuwatchd.policy.actions.params import (
    parse_count,
    parse_direction,
    parse_fraction,
    parse_growth,
    parse_knob_names,
    parse_positive_duration,
    parse_positive_int,
    parse_text,
)
from gpuwatchd.policy.actions.spec import ActionSpec, Firing, Group, Outcome
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.tuner import SATURATED_CPU_PCT, TunerStep, TuneSettings

__all__ = ["SPEC", "decide", "decision_of", "plan"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """Open a tuning session for each job the firing concerns (none while one runs); no
    decisions (module docstring)."""
    settings = TuneSettings.from_params(params)
    host = firing.snapshot.host
    saturated = host is not None and host.cpu_pct >= SATURATED_CPU_PCT
    targets = {"knob": settings.knob, **({"job": params["job"]} if "job" in params else {})}
    for group in groups:
        for job in firing.knob_targets(targets, group.findings):
            reason = "; ".join(f.message for f in group.findings if f.job in (None, job.name))
            firing.tuner.start(
                job,
                settings,
                policy=firing.policy,
                dry_run=firing.dry_run,
                reason=reason,
                saturated=saturated,
                cores=None if host is None else host.cpu_count,
            )
    return []


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def decision_of(step: TunerStep, now: float, dry_run: bool) -> Decision:
    """The decision of one tuner move or hold at ``now`` (seconds); ``dry_run`` marks it
    (the engine's dry-run or pause, besides the opening policy's own)."""
    return Decision(
        policy=step.policy,
        action=action_names.TUNE_LOADER,
        params={
            "knob": step.knob,
            "value": step.value,
            "previous": step.previous,
            "verdict": step.verdict,
            "samples_per_s_before": _rounded(step.samples_per_s_before),
            "samples_per_s_after": _rounded(step.samples_per_s_after),
        },
        timestamp_s=now,
        findings=(),
        job=step.job,
        dry_run=step.dry_run or dry_run,
        reason=f"{step.message} (started by: {step.reason})",
    )


def plan(decision: Decision, holds: KnobHolds | None) -> Outcome | None:
    """A hold (the value kept) is ``logged``; else as ``set_knob`` (a held knob: ``refused``)."""
    if decision.params.get("value") == decision.params.get("previous"):
        return "logged", ""
    return set_knob.plan(decision, holds)


SPEC = ActionSpec(
    action_names.TUNE_LOADER,
    "tune a DataLoader knob of the jobs concerned in closed loop: move it, measure "
    "the job's samples/s, keep the better setting, hold on a plateau "
    "(docs/tuning.md)",
    (
        ParamSpec(
            "knob",
            parse_text,
            default="num_workers",
            unit="name",
            help="int knob as the job declared it (num_workers, prefetch_factor)",
        ),
        ParamSpec("min", parse_count, unit="count", help="never below (and the knob's own)"),
        ParamSpec(
            "max",
            parse_count,
            unit="count",
            help="never above (and the knob's own; num_workers also never above the "
            "host's logical CPUs divided by the jobs tuned on it)",
        ),
        ParamSpec(
            "factor",
            parse_growth,
            unit="number > 1",
            help="step rule: multiply (up) or divide (down), moving >= 1 (default 2)",
        ),
        ParamSpec("step", parse_positive_int, unit="count", help="step rule: add or subtract"),
        ParamSpec(
            "settle_epochs",
            parse_count,
            default=1,
            unit="epochs",
            help="epochs skipped after a change is applied, before measuring",
        ),
        ParamSpec(
            "measure",
            parse_positive_duration,
            default="5s",
            unit="duration",
            help="throughput measured per setting (at least one epoch boundary)",
        ),
        ParamSpec(
            "noise",
            parse_fraction,
            default=0.05,
            unit="fraction",
            help="noise margin: a gain below it is a plateau (hold)",
        ),
        ParamSpec(
            "direction",
            parse_direction,
            default="auto",
            unit="auto|up|down",
            help="first move; auto: down when the host CPU is saturated, else up",
        ),
        ParamSpec(
            "then",
            parse_knob_names,
            unit="name|list",
            help="knobs tuned next, each once the previous one holds (e.g. "
            "prefetch_factor after num_workers; upwards, within the knob's bounds)",
        ),
        set_knob.JOB_PARAM,
    ),
    decide,
    set_knob.carry_out,
    groups=(ExclusiveGroup(("factor", "step")),),
    check=set_knob.check_bounds,
    plan=plan,
    job_command=True,
)
