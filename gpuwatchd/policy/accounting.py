"""Policy engine state derived from decisions: cooldowns, rate limits, parallelism ladders (pure).

Rebuilt on restart by replaying journaled decisions. Specification:
docs/modules.md#gpuwatchdpolicyengine ("Cooldown", "Rate limit", "Restart").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from gpuwatchd.model import Decision
from gpuwatchd.policy.actions import ACTIONS, LADDER_ACTIONS
from gpuwatchd.policy.actions.spec import cooldown_target
from gpuwatchd.policy.schema import Policy, PolicySet


def cooldown_targets(decision: Decision) -> tuple[str, ...]:
    """The targets whose cooldown ``decision`` starts (docs/modules.md, "Cooldown").

    Actions cooling down per subject (``log``, ``notify``: ``ActionSpec.per_subject``):
    ``<action>:<subject>`` for each of ``params["subjects"]`` (the finding subjects when
    the params lack them); other actions: ``job:<job>``, ``gpu:<uuid>``,
    ``job:<job>@gpu:<uuid>`` or ``global`` from the decision's ``job``/``gpu_uuid``.
    Derived from the decision alone, so :meth:`PolicyEngine.restore` can use it.
    """
    spec = ACTIONS.get(decision.action)
    if spec is not None and spec.per_subject:
        subjects = decision.params.get("subjects")
        if not isinstance(subjects, (list, tuple)):
            subjects = sorted({f.subject for f in decision.findings})
        return tuple(f"{decision.action}:{s}" for s in subjects)
    return (cooldown_target(decision.job, decision.gpu_uuid),)


class Accounting:
    """Cooldowns, rate-limit history and ladders of the managed jobs, fed by decisions.

    The base of :class:`~gpuwatchd.policy.engine.PolicyEngine`. ``managed_jobs`` as
    there (ValueError if ``min_workers`` exceeds ``workers`` or is < 1).
    """

    def __init__(self, managed_jobs: Mapping[str, tuple[int, int]] | None = None) -> None:
        self._cooldown_s: dict[str, float] = {}
        self._last_action_s: dict[tuple[str, str], float] = {}
        self._firings: dict[str, deque[float]] = {}
        self._ladder: dict[str, int] = {}
        self._managed: dict[str, tuple[int, int]] = {}
        self.set_managed_jobs(managed_jobs or {})

    @property
    def managed_jobs(self) -> Mapping[str, tuple[int, int]]:
        """Managed job name -> ``(workers, min_workers)`` (a read-only view)."""
        return MappingProxyType(self._managed)

    def set_managed_jobs(self, managed_jobs: Mapping[str, tuple[int, int]]) -> None:
        """Replace the managed jobs (a config reload); ladder positions are kept.

        A kept position outside the job's new ``[min_workers, workers]`` is read clamped
        into it. Raises ValueError for ``min_workers < 1`` or ``min_workers > workers``.
        """
        managed: dict[str, tuple[int, int]] = {}
        for name, (workers, min_workers) in managed_jobs.items():
            if min_workers < 1 or min_workers > workers:
                raise ValueError(
                    f"managed job {name!r}: need 1 <= min_workers ({min_workers}) <= "
                    f"workers ({workers})"
                )
            managed[name] = (int(workers), int(min_workers))
        self._managed = managed

    def parallelism(self, job: str) -> int | None:
        """The ladder position (current worker count) of managed ``job``; None if unmanaged."""
        bounds = self._managed.get(job)
        if bounds is None:
            return None
        workers, min_workers = bounds
        return min(max(self._ladder.get(job, workers), min_workers), workers)

    def last_action_s(self, policy: str, target: str) -> float | None:
        """When ``policy`` last acted on cooldown target ``target`` (``log:gpu:<uuid>``,
        ``gpu:<uuid>``, ``global``, ...; see :func:`cooldown_targets`), in the clock's
        seconds; None if never, or if that cooldown has been pruned as over."""
        return self._last_action_s.get((policy, target))

    def firing_times_s(self, policy: str) -> tuple[float, ...]:
        """The times (clock seconds, oldest first) of ``policy``'s last firings kept for
        its rate limit (``limit: {max: N}``: at most N); empty without a limit."""
        return tuple(self._firings.get(policy, ()))

    def _account_policies(self, policies: PolicySet) -> None:
        """Keep the cooldowns and rate-limit history of the policies whose name persists."""
        firings: dict[str, deque[float]] = {}
        for policy in policies.policies:
            if policy.limit is not None:
                firings[policy.name] = deque(
                    self._firings.get(policy.name, ()), maxlen=policy.limit.max
                )
        self._firings = firings
        self._cooldown_s = {p.name: p.cooldown_s for p in policies.policies}
        self._last_action_s = {
            k: t for k, t in self._last_action_s.items() if k[0] in self._cooldown_s
        }

    def _forget_accounting(self) -> None:
        """Forget every cooldown, rate-limit history and ladder position."""
        self._last_action_s.clear()
        for firings in self._firings.values():
            firings.clear()
        self._ladder.clear()

    def record(self, decision: Decision) -> None:
        """Account one decision: start its cooldowns, count its firing, move its ladder.

        Applied by :meth:`step` to every decision it makes and by :meth:`restore`. A
        decision of a policy that is not loaded only moves its ladder.
        """
        name = decision.policy
        now = decision.timestamp_s
        cooldown_s = self._cooldown_s.get(name, 0.0)
        if cooldown_s > 0:
            last = self._last_action_s
            for target in cooldown_targets(decision):
                key = (name, target)
                previous = last.get(key)
                if previous is None or previous < now:
                    last[key] = now
        firings = self._firings.get(name)
        if firings is not None and (not firings or firings[-1] < now):
            firings.append(now)
        if decision.action in LADDER_ACTIONS and not decision.dry_run and decision.job:
            to = decision.params.get("to")
            if isinstance(to, int) and not isinstance(to, bool):
                self._ladder[decision.job] = to

    def refused(self, decision: Decision) -> None:
        """A ladder ``decision`` was refused (nothing moved: a Slurm raise held within
        ``raise_hold``, docs/slurm.md): its job's ladder goes back to its ``from``, unless
        a later decision moved it since. Other decisions: nothing."""
        job, params = decision.job, decision.params
        if decision.action not in LADDER_ACTIONS or decision.dry_run or not job:
            return
        before, to = params.get("from"), params.get("to")
        if isinstance(before, int) and not isinstance(before, bool) and self._ladder.get(job) == to:
            self._ladder[job] = before

    def restore(self, decisions: Iterable[Decision]) -> None:
        """Replay journaled ``decisions`` (oldest first) into cooldowns, limits and ladders.

        For a daemon restarted after a crash or ``SIGKILL``: it then neither repeats an
        action within its cooldown, nor exceeds a rate limit, nor forgets a ladder
        position. Call it after construction (or :meth:`reload`), before the first
        :meth:`step`. Detector streaks are not restored (docs/modules.md).
        """
        for decision in decisions:
            self.record(decision)

    def _prune_cooldowns(self, now: float) -> None:
        cooldown = self._cooldown_s
        self._last_action_s = {
            k: t for k, t in self._last_action_s.items() if now - t < cooldown.get(k[0], 0.0)
        }

    def cooling(self, policy: Policy, target: str, now: float) -> bool:
        """Whether ``policy`` acted on ``target`` (:func:`cooldown_targets`) less than its
        cooldown before ``now`` (seconds)."""
        if policy.cooldown_s <= 0:
            return False
        last = self._last_action_s.get((policy.name, target))
        return last is not None and now - last < policy.cooldown_s

    def _limited(self, policy: Policy, now: float) -> bool:
        limit = policy.limit
        if limit is None:
            return False
        firings = self._firings.get(policy.name)
        return (
            firings is not None
            and len(firings) >= limit.max
            and now - firings[-limit.max] < limit.per_s
        )
