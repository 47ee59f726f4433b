"""What a policy action is: its spec, the firing it decides in, what it carries out with (pure).

Each action module of :mod:`gpuwatchd.policy.actions` has a ``SPEC``
(:class:`ActionSpec`): its params, its pure ``decide`` (a :class:`Firing` and the
policy's groups in, decisions out) and its ``carry_out`` (a decision and its collaborators,
:class:`Effects`, in; an outcome out). Nothing here does I/O: the collaborators are
passed in by the actuator. docs/policies.md, "Adding an action".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpuwatchd.detectors import ExclusiveGroup, Fail, ParamSpec
from gpuwatchd.errors import GpuwatchError
from gpuwatchd.model import Decision, Finding, JobInfo, Snapshot

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.control.protocol import Reply
    from gpuwatchd.policy.holds import KnobHolds
    from gpuwatchd.policy.tuner import LoaderTuner

__all__ = [
    "NO_GPU_CORDONS",
    "NO_MANAGED_JOBS",
    "NO_SLURM",
    "ActionSpec",
    "CommandResult",
    "Effects",
    "Firing",
    "GpuCordoning",
    "Group",
    "JobCommander",
    "ManagedJobs",
    "Outcome",
    "SlurmBackend",
    "cooldown_target",
    "float_param",
    "int_param",
    "reason_of",
    "strings_param",
    "unique_findings",
]

Outcome = tuple[str, str]
"""``(outcome, detail)`` of a carried-out decision: ``applied``, ``refused``, ``failed``
(or ``logged`` from a plan) and one line saying what happened."""
NO_MANAGED_JOBS: Final = "no managed jobs (the config has no jobs:)"
"""The detail of a managed-job decision where the daemon has no managed jobs."""
NO_GPU_CORDONS: Final = "no GPU cordons here"
"""The detail of a cordon decision where the daemon keeps no cordons."""
NO_SLURM: Final = "no slurm: in the config"
"""The detail of a Slurm decision (``drain_node``) where the daemon does not act on Slurm."""


class Group(Protocol):
    """The findings of one firing policy that go together (by the policy's scope):
    ``subject`` (``gpu:<uuid>``, ``job:<name>`` or ``global``) and, where the scope gives
    them, the GPU (``gpu_uuid``, NVML ``gpu_index``) or the ``job``."""

    @property
    def subject(self) -> str: ...

    @property
    def findings(self) -> list[Finding]: ...

    @property
    def gpu_uuid(self) -> str | None: ...

    @property
    def gpu_index(self) -> int | None: ...

    @property
    def job(self) -> str | None: ...


class Firing(Protocol):
    """What a ``decide`` sees of the engine while one policy fires (pure, no I/O).

    ``policy``: its name; ``now``: the snapshot's time (seconds); ``dry_run``: its decisions
    are marked dry-run; ``managed``: managed job -> ``(workers, min_workers)``.
    """

    @property
    def policy(self) -> str: ...

    @property
    def now(self) -> float: ...

    @property
    def dry_run(self) -> bool: ...

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def managed(self) -> Mapping[str, tuple[int, int]]: ...

    @property
    def tuner(self) -> LoaderTuner:
        """The host's one tuner (``tune_loader`` opens sessions on it)."""
        ...

    def cooling(self, target: str) -> bool:
        """Whether the policy acted on ``target`` within its cooldown (:func:`cooldown_target`)."""
        ...

    def parallelism(self, job: str) -> int | None:
        """The ladder position of managed ``job`` (None: not managed)."""
        ...

    def knob_targets(self, params: Mapping[str, Any], findings: Sequence[Finding]) -> list[JobInfo]:
        """The attached jobs with knob ``params["knob"]`` that ``findings`` concern
        (``params["job"]`` if given; docs/modules.md, ``set_knob``)."""
        ...

    def concerned_managed(self, group: Group) -> list[str]:
        """The managed jobs ``group`` is about (docs/modules.md, ``lower_parallelism``)."""
        ...

    def decision(
        self,
        action: str,
        params: dict[str, object],
        findings: Sequence[Finding],
        *,
        job: str | None = None,
        gpu_uuid: str | None = None,
    ) -> Decision:
        """A decision of this firing (policy, time, dry-run mark, reason from ``findings``)."""
        ...


class JobCommander(Protocol):
    """What the actuator needs from the control server: sending a command to a job."""

    async def send_command(
        self,
        job: str,
        op: str,
        params: Mapping[str, Any],
        *,
        pid: int | None = None,
        timeout_s: float = 60.0,
        source: str | None = None,
    ) -> list[Reply]: ...


class ManagedJobs(Protocol):
    """What the managed-job actions need (:class:`gpuwatchd.jobs.actions.SupervisorActions`).

    Each method carries out one decision and returns the outcome's detail (one line);
    it raises :class:`~gpuwatchd.errors.ActionRefused` when the present state forbids the
    action (outcome ``refused``) and any other exception when it failed (``failed``).
    """

    async def set_parallelism(self, job: str, to: int, mode: str) -> str: ...

    async def restart_worker(self, decision: Decision) -> str: ...

    async def restart_study(self, decision: Decision) -> str: ...

    async def place_next(self, job: str, gpu_index: int) -> str: ...


class GpuCordoning(Protocol):
    """What ``cordon_gpu``/``uncordon_gpu``/``place_on_idle_gpu`` need from the cordons
    (:class:`gpuwatchd.cordon.CordonActions`); ``cordon``/``uncordon`` return the detail and
    raise :class:`~gpuwatchd.errors.ActionRefused`."""

    async def cordon(
        self, index: int, uuid: str | None, by: str, reason: str, *, relaunch: bool = True
    ) -> str: ...

    def uncordon(self, index: int, uuid: str | None, *, by: str, operator: bool) -> str: ...

    def is_cordoned(self, index: int) -> bool: ...


class SlurmBackend(Protocol):
    """What the actions carried out through Slurm need
    (:class:`gpuwatchd.slurm_actions.SlurmActions`): the ``ArrayTaskThrottle`` of the
    Slurm arrays it ``owns`` (the ladder actions on them), their crashed tasks' trials
    (``restart_study``), their requeue (``requeue_task``) and this node's drain. Errors
    as :class:`ManagedJobs`'s."""

    def owns(self, job: str) -> bool: ...

    async def set_parallelism(self, job: str, to: int, lowering: bool) -> str: ...

    async def restart_study(self, decision: Decision) -> str: ...

    async def requeue_task(self, decision: Decision) -> str: ...

    async def drain(self, finding: str) -> str: ...


class CommandResult(Protocol):
    """What ``exec`` reads of a finished command (:class:`gpuwatchd.actuators.ExecResult`)."""

    @property
    def ok(self) -> bool: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Effects:
    """The collaborators a ``carry_out`` acts through, passed in by the actuator.

    ``commander``: the control server (knob commands to jobs, waiting up to
    ``ack_timeout_s`` seconds for the acknowledgement); ``managed``: the managed-job
    backend; ``gpus``: the cordons; ``slurm``: Slurm (``drain_node``, and the ladder of
    the Slurm arrays it owns, which stand for managed jobs); ``run_exec(argv,
    timeout_s)``: runs a command (:func:`gpuwatchd.actuators.run_exec`);
    ``send_notification(urls, title, message,
    timeout_s)``: sends through apprise (:func:`gpuwatchd.notify.send_notification`).
    None: not available here; the ``require_*`` methods then raise.
    """

    commander: JobCommander | None = None
    managed: ManagedJobs | None = None
    gpus: GpuCordoning | None = None
    slurm: SlurmBackend | None = None
    run_exec: Callable[[Sequence[str], float], Awaitable[CommandResult]] | None = None
    send_notification: (
        Callable[[Sequence[str], str, str, float], Awaitable[tuple[bool, str]]] | None
    ) = None
    ack_timeout_s: float = 600.0

    def require_managed(self) -> ManagedJobs:
        """``managed``; raises :class:`~gpuwatchd.errors.GpuwatchError` (outcome ``failed``,
        detail :data:`NO_MANAGED_JOBS`) without one."""
        if self.managed is None:
            raise GpuwatchError(NO_MANAGED_JOBS)
        return self.managed

    def require_gpus(self) -> GpuCordoning:
        """``gpus``; raises :class:`~gpuwatchd.errors.GpuwatchError` (:data:`NO_GPU_CORDONS`)."""
        if self.gpus is None:
            raise GpuwatchError(NO_GPU_CORDONS)
        return self.gpus

    def require_slurm(self) -> SlurmBackend:
        """``slurm``; raises :class:`~gpuwatchd.errors.GpuwatchError` (:data:`NO_SLURM`)."""
        if self.slurm is None:
            raise GpuwatchError(NO_SLURM)
        return self.slurm

    def missing(self, needs: Iterable[str]) -> str | None:
        """The detail of the first of ``needs`` (``managed``, ``gpus``, ``slurm``) not
        available, or None. ``managed`` is met by Slurm arrays too (a job that is neither
        fails when carried out)."""
        for need in needs:
            if need == "managed" and self.managed is None and self.slurm is None:
                return NO_MANAGED_JOBS
            if need == "gpus" and self.gpus is None:
                return NO_GPU_CORDONS
            if need == "slurm" and self.slurm is None:
                return NO_SLURM
        return None


Decide = Callable[[Firing, Mapping[str, Any], Sequence[Group]], list[Decision]]
"""``decide(firing, params, groups)``: the decisions of one action of a firing policy."""
CarryOut = Callable[[Decision, Effects], Awaitable[Outcome]]
"""``carry_out(decision, effects)``: act; raise ActionRefused (``refused``) or any error
(``failed``)."""
Plan = Callable[[Decision, "KnobHolds | None"], "Outcome | None"]
"""``plan(decision, holds)``: the outcome known before acting (no side effects), or None."""


@dataclass(frozen=True)
class ActionSpec:
    """An action of the ``do:`` vocabulary, as its module declares it.

    ``params``/``groups``/``check``: what the schema validates (``check(params, fail)``
    sees the parsed params and calls ``fail(key, message)`` to reject a combination).
    ``decide``: pure, the decisions of one firing. ``carry_out``: the side effects, None
    for an action that only logs. ``plan``: an outcome known before acting (``logged``,
    ``refused`` on a held knob). ``needs``: collaborators without which the decision
    fails at once (``managed``, ``gpus``). ``narrates``: decided last, and only when
    another action of a policy that has one decided (``log``). ``per_subject``: cooldown
    per finding subject (``<name>:<subject>``) rather than per target. ``moves_ladder``:
    its ``params["to"]`` is the managed job's new parallelism. ``needs_detector`` /
    ``needs_scope``: a policy using it must have that condition / scope (``because``
    says why). ``job_command``: carried out as a command to the job, which may wait for
    its acknowledgement; logged ``knob <outcome>``; left pending (unknown after a restart)
    when the daemon stops. ``resumable``: idempotent; one a killed daemon left
    ``unknown`` is carried out at the next start. ``public``: ``params`` as logs and
    ``status`` show them (secrets cut).
    """

    name: str
    description: str
    params: tuple[ParamSpec, ...]
    decide: Decide
    carry_out: CarryOut | None = None
    groups: tuple[ExclusiveGroup, ...] = ()
    check: Callable[[Mapping[str, Any], Fail], None] | None = None
    plan: Plan | None = None
    needs: tuple[str, ...] = ()
    narrates: bool = False
    per_subject: bool = False
    moves_ladder: bool = False
    needs_detector: str | None = None
    needs_scope: str | None = None
    because: str = ""
    job_command: bool = False
    resumable: bool = False
    public: Callable[[Mapping[str, object]], dict[str, object]] | None = None


def cooldown_target(job: str | None, gpu: str | None) -> str:
    """The cooldown target of a decision about ``job`` and/or GPU ``gpu`` (a UUID):
    ``job:<job>@gpu:<uuid>``, ``job:<job>``, ``gpu:<uuid>`` or ``global``."""
    if job is not None and gpu is not None:
        return f"job:{job}@gpu:{gpu}"
    if job is not None:
        return "job:" + job
    if gpu is not None:
        return "gpu:" + gpu
    return "global"


def reason_of(findings: Iterable[Finding]) -> str:
    """The findings' messages joined by ``; `` (a decision's ``reason``)."""
    return "; ".join(f.message for f in findings)


def unique_findings(findings: Iterable[Finding]) -> list[Finding]:
    """``findings`` without repeats (by identity), in order."""
    seen: set[int] = set()
    out: list[Finding] = []
    for f in findings:
        if id(f) not in seen:
            seen.add(id(f))
            out.append(f)
    return out


def int_param(decision: Decision, key: str) -> int:
    """``decision.params[key]``, an int as the action's ``decide`` made it; raises
    ValueError (outcome ``failed``) for a decision that has none (not made by it)."""
    value = decision.params.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"decision without an integer {key!r}: {value!r}")
    return value


def float_param(decision: Decision, key: str, default: float) -> float:
    """``decision.params[key]`` as a float (``default`` where it is absent); ValueError
    for a value that is not a number."""
    value = decision.params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"decision without a number {key!r}: {value!r}")
    return float(value)


def strings_param(decision: Decision, key: str) -> list[str]:
    """``decision.params[key]``, a non-empty list, as strings; ValueError otherwise."""
    value = decision.params.get(key)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"decision without a non-empty list {key!r}: {value!r}")
    return [str(v) for v in value]
