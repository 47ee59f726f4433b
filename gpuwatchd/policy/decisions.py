"""A firing policy as its actions see it: the engine's state for one policy's decisions (pure).

:class:`PolicyFiring` is the :class:`gpuwatchd.policy.actions.spec.Firing` each action's
``decide`` gets; the actions themselves live in :mod:`gpuwatchd.policy.actions`.
Specification: docs/modules.md#gpuwatchdpolicyengine ("Actions").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.model import Decision, Finding, JobInfo, Snapshot
from gpuwatchd.policy.accounting import Accounting
from gpuwatchd.policy.actions.spec import Group, reason_of
from gpuwatchd.policy.grouping import unique_in_order, uses_gpu
from gpuwatchd.policy.schema import Policy
from gpuwatchd.policy.tuner import LoaderTuner

__all__ = ["PolicyFiring", "concerned_managed", "knob_targets"]


def knob_targets(
    params: Mapping[str, Any], findings: Sequence[Finding], snapshot: Snapshot
) -> list[JobInfo]:
    """The attached jobs with knob ``params["knob"]`` that ``findings`` concern: the
    action's ``job`` if given; else the jobs they name; else the jobs on their GPUs; else
    every job with the knob (docs/modules.md, ``set_knob``)."""
    knob = params["knob"]
    jobs = [j for j in snapshot.jobs if knob in j.knobs]
    only = params.get("job")
    if only is not None:
        return [j for j in jobs if j.name == only]
    named = {f.job for f in findings if f.job is not None}
    if named:
        return [j for j in jobs if j.name in named]
    gpus = [(f.gpu_uuid, f.gpu_index) for f in findings if f.gpu_uuid is not None]
    if gpus:
        return [j for j in jobs if uses_gpu(j, gpus)]
    return jobs


def concerned_managed(
    group: Group, snapshot: Snapshot, managed: Mapping[str, tuple[int, int]]
) -> list[str]:
    """The managed jobs ``group`` is about (docs/modules.md, ``lower_parallelism``)."""
    if not managed:
        return []
    if group.job is not None:
        return [group.job] if group.job in managed else []
    named = unique_in_order(f.job for f in group.findings if f.job is not None)
    if named:
        return [n for n in named if n in managed]
    gpus = [(f.gpu_uuid, f.gpu_index) for f in group.findings if f.gpu_uuid is not None]
    if group.gpu_uuid is not None:
        gpus.append((group.gpu_uuid, group.gpu_index))
    if gpus:
        return unique_in_order(
            j.name for j in snapshot.jobs if j.name in managed and uses_gpu(j, gpus)
        )
    return list(managed)


class PolicyFiring:
    """One policy firing at ``now`` (seconds) on ``snapshot``: what its actions' ``decide``
    see. ``accounting`` answers cooldowns and ladder positions; ``dry_run`` marks the
    decisions; ``tuner`` is the host's one tuner."""

    __slots__ = ("_accounting", "_policy", "dry_run", "now", "snapshot", "tuner")

    def __init__(
        self,
        accounting: Accounting,
        policy: Policy,
        now: float,
        dry_run: bool,
        snapshot: Snapshot,
        tuner: LoaderTuner,
    ) -> None:
        self._accounting = accounting
        self._policy = policy
        self.now = now
        self.dry_run = dry_run
        self.snapshot = snapshot
        self.tuner = tuner

    @property
    def policy(self) -> str:
        """The firing policy's name."""
        return self._policy.name

    @property
    def managed(self) -> Mapping[str, tuple[int, int]]:
        """Managed job -> ``(workers, min_workers)``."""
        return self._accounting.managed_jobs

    def cooling(self, target: str) -> bool:
        """Whether the policy acted on ``target`` within its cooldown."""
        return self._accounting.cooling(self._policy, target, self.now)

    def parallelism(self, job: str) -> int | None:
        """The ladder position of managed ``job`` (None: not managed)."""
        return self._accounting.parallelism(job)

    def knob_targets(self, params: Mapping[str, Any], findings: Sequence[Finding]) -> list[JobInfo]:
        """:func:`knob_targets` on this firing's snapshot."""
        return knob_targets(params, findings, self.snapshot)

    def concerned_managed(self, group: Group) -> list[str]:
        """:func:`concerned_managed` on this firing's snapshot."""
        return concerned_managed(group, self.snapshot, self._accounting.managed_jobs)

    def decision(
        self,
        action: str,
        params: dict[str, object],
        findings: Sequence[Finding],
        *,
        job: str | None = None,
        gpu_uuid: str | None = None,
    ) -> Decision:
        """A decision of this firing; its ``reason`` is the findings' messages."""
        found = tuple(findings)
        return Decision(
            policy=self._policy.name,
            action=action,
            params=params,
            timestamp_s=self.now,
            findings=found,
            job=job,
            gpu_uuid=gpu_uuid,
            dry_run=self.dry_run,
            reason=reason_of(found),
        )
