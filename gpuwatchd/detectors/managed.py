"""Managed-job detectors: ``worker_given_up`` and ``job_stalled`` (pure).

Both read the supervisor's view of each managed job (``Snapshot.managed``,
:class:`~gpuwatchd.model.ManagedJobState`) and stay open while their condition holds,
so a slot given up is a finding in ``status``, metrics and ``notify`` until an operator
acts. Specification: docs/managed-jobs.md, "When the supervisor gives up".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from gpuwatchd.detectors.base import Detector
from gpuwatchd.detectors.params import ParamSpec
from gpuwatchd.model import Finding, ManagedJobState
from gpuwatchd.units import parse_duration
from gpuwatchd.windows import Scope, Windows

__all__ = ["JobStalled", "WorkerGivenUp"]


def _for(default: str) -> ParamSpec:
    return ParamSpec(
        "for",
        parse_duration,
        default=default,
        unit="duration",
        help="how long the condition must hold without a break (0s, 1m)",
    )


class _HeldDetector(Detector):
    """A condition on each managed job's state that holds for ``for:``; subject
    ``job:<name>``. Subclasses give :meth:`held` (the message, or None)."""

    scope: ClassVar[Scope] = "job"

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self._start: dict[str, float] = {}

    def reset(self) -> None:
        """Forget the streaks."""
        self._start = {}

    def streaks(self) -> dict[str, float]:
        """Jobs whose condition holds now -> since when."""
        return {"job:" + job: t for job, t in self._start.items()}

    def held(self, state: ManagedJobState) -> tuple[float, str] | None:
        """(value, message) while the condition holds for ``state``, else None."""
        raise NotImplementedError

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per managed job whose condition has held for ``for:``."""
        now = windows.now
        if now is None:
            return []
        started: dict[str, float] = {}
        out: list[Finding] = []
        for state in windows.managed:
            verdict = self.held(state)
            if verdict is None:
                continue
            since = self._start.get(state.job, now)
            started[state.job] = since
            if now - since >= self.for_s - 1e-9:
                value, message = verdict
                finding = Finding(
                    detector=self.name,
                    subject="job:" + state.job,
                    timestamp_s=now,
                    since_s=since,
                    value=value,
                    threshold=1.0,
                    message=message + self._for_text,
                    job=state.job,
                )
                out.append(finding)
        self._start = started
        return out


class WorkerGivenUp(_HeldDetector):
    """A managed job has worker slots the supervisor gave up on: a crash loop (deaths
    without progress, ``restart.crash_loop``), an environment failure at start, or the
    restart budget spent (``restart.budget``). Holds until an operator starts the slot
    again (``gpuwatchctl job start``) or the configuration changes; value: how many.
    Default ``for: 0s``."""

    name = "worker_given_up"
    description = "worker slots of a managed job the supervisor will not restart by itself"
    params = (_for("0s"),)

    def held(self, state: ManagedJobState) -> tuple[float, str] | None:
        """While ``state`` has given-up slots."""
        if not state.given_up:
            return None
        slots = "; ".join(f"worker {n}: {note}" for n, note in state.given_up[:4])
        more = f" (+{len(state.given_up) - 4} more)" if len(state.given_up) > 4 else ""
        message = f"job {state.job}: {len(state.given_up)} worker slot(s) given up ({slots}{more})"
        return float(len(state.given_up)), message


class JobStalled(_HeldDetector):
    """A managed job has no worker left (none running, none waiting to restart) while
    its work is not done: no slot finished with status 0, and at least one was given up.
    Default ``for: 0s``."""

    name = "job_stalled"
    description = "a managed job with no worker left while its study is unfinished"
    params = (_for("0s"),)

    def held(self, state: ManagedJobState) -> tuple[float, str] | None:
        """While ``state`` has no live slot, no finished one and a given-up one."""
        if state.live or state.finished or not state.given_up:
            return None
        return 1.0, f"job {state.job}: no worker left and its study is unfinished"
