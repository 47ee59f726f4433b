"""What the tests of the policy actions share (tests/test_action_<name>.py).

A firing on the real engine's state (:class:`gpuwatchd.policy.decisions.PolicyFiring`
over a :class:`~gpuwatchd.policy.engine.PolicyEngine` loaded with the test's policy),
and the real :class:`~gpuwatchd.actuators.Actuator` carrying decisions out over fake
collaborators: the managed-job backend, the cordons and the job connection (the
supervisor, the cordon store and attached jobs are tested on their own elsewhere).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fake_daemon import FakeCommander
from gpuwatchd.actuators import Actuator, DecisionRecord
from gpuwatchd.detectors import EventFinding
from gpuwatchd.errors import ActionRefused
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision, Finding, GpuSample, JobEvent, JobInfo, Knob, Snapshot
from gpuwatchd.policy.decisions import PolicyFiring
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.schema import parse_policies

LOG = get_logger("test.actions")
NOW = 1000.0


@dataclass
class Group:
    """A policy group as the engine forms them (gpuwatchd.policy.grouping)."""

    subject: str
    findings: list[Finding]
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    job: str | None = None


def gpu(index: int) -> GpuSample:
    return GpuSample(uuid=f"GPU-{index:04d}", index=index, name="H100", timestamp_s=NOW)


def finding(
    detector: str = "idle_gpu",
    *,
    gpu_index: int | None = None,
    job: str | None = None,
    message: str = "GPU idle",
) -> Finding:
    uuid = None if gpu_index is None else f"GPU-{gpu_index:04d}"
    subject = f"gpu:{uuid}" if uuid else (f"job:{job}" if job else "host")
    return Finding(detector, subject, NOW, NOW - 60, 0.0, 5.0, message, uuid, gpu_index, job)


def gpu_group(index: int, *findings: Finding) -> Group:
    uuid = f"GPU-{index:04d}"
    return Group(f"gpu:{uuid}", list(findings) or [finding(gpu_index=index)], uuid, index)


def job_group(name: str, *findings: Finding) -> Group:
    return Group(f"job:{name}", list(findings) or [finding("data_starved", job=name)], job=name)


CRASHED = "job_crashed: {kind: cuda_oom}"
"""The ``when`` of a policy acting on crashes."""


def crash(job: str, pid: int | None, slurm_job: str | None = None) -> Group:
    """The group of a CUDA OOM crash of ``job``'s worker ``pid`` (trial 12, GPU 0);
    ``slurm_job``: the Slurm task it was read from."""
    event = JobEvent(
        NOW, job, "crash", pid, "cuda_oom", 12, None, 0, "CUDA out of memory", slurm_job
    )
    found = EventFinding(
        "job_crashed", f"job:{job}", NOW, NOW, 1.0, 0.0, "worker died", None, 0, job, event
    )
    return Group(f"job:{job}", [found], job=job)


def attached(name: str, knobs: Mapping[str, Knob], cuda: tuple[str, ...] = ()) -> JobInfo:
    return JobInfo(name, 4242, NOW - 100, cuda, dict(knobs))


def firing(
    action_yaml: str,
    *,
    jobs: tuple[JobInfo, ...] = (),
    managed: Mapping[str, tuple[int, int]] | None = None,
    cooldown: str = "10m",
    when: str = "idle_gpu: {for: 1m}",
    dry_run: bool = False,
    decided: tuple[Decision, ...] = (),
) -> tuple[PolicyFiring, dict[str, Any]]:
    """A firing of policy ``p`` (``when``, ``do: [action_yaml]``) at :data:`NOW` on a
    snapshot of GPUs 0 and 1 and ``jobs``; ``decided`` are earlier decisions the engine
    accounted (cooldowns, ladders). Returns the firing and the action's parsed params."""
    text = (
        f"policies:\n  - name: p\n    cooldown: {cooldown}\n    when: {{{when}}}\n"
        f"    do:\n      - {action_yaml}\n"
    )
    policy = parse_policies(text, "test.yaml").policies[0]
    engine = PolicyEngine(parse_policies(text, "test.yaml"), managed_jobs=managed)
    engine.restore(decided)
    snapshot = Snapshot(NOW, (gpu(0), gpu(1)), None, jobs)
    fired = PolicyFiring(engine, policy, NOW, dry_run, snapshot, engine.tuner)
    return fired, dict(policy.actions[0].params)


@dataclass
class FakeManaged:
    """The managed-job backend (:class:`gpuwatchd.jobs.actions.SupervisorActions`):
    records each call; ``refuse`` makes every call refused with that message."""

    refuse: str | None = None
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def _call(self, *call: Any) -> str:
        self.calls.append(call)
        if self.refuse is not None:
            raise ActionRefused(self.refuse)
        return f"{call[0]} done"

    async def set_parallelism(self, job: str, to: int, mode: str) -> str:
        return self._call("set_parallelism", job, to, mode)

    async def restart_worker(self, decision: Decision) -> str:
        return self._call("restart_worker", decision.params["pid"])

    async def restart_study(self, decision: Decision) -> str:
        return self._call("restart_study", decision.params["pid"], decision.params["max_retries"])

    async def place_next(self, job: str, gpu_index: int) -> str:
        return self._call("place_next", job, gpu_index)


@dataclass
class FakeCordons:
    """The cordons (:class:`gpuwatchd.cordon.CordonActions`): a set of cordoned indexes,
    each with who set it."""

    by: dict[int, str] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    async def cordon(
        self, index: int, uuid: str | None, by: str, reason: str, *, relaunch: bool = True
    ) -> str:
        self.calls.append(("cordon", index, uuid, by, reason, relaunch))
        self.by.setdefault(index, by)
        return f"GPU {index} cordoned"

    def uncordon(self, index: int, uuid: str | None, *, by: str, operator: bool) -> str:
        self.calls.append(("uncordon", index, uuid, by, operator))
        if index not in self.by:
            return f"GPU {index} was not cordoned; nothing to lift"
        if not operator and not self.by[index].startswith("policy "):
            raise ActionRefused(f"GPU {index} was cordoned by {self.by[index]}")
        del self.by[index]
        return f"GPU {index} uncordoned"

    def is_cordoned(self, index: int) -> bool:
        return index in self.by


@dataclass
class FakeSlurm:
    """Slurm as the actions see it: the arrays it owns, this node's drain (``refuse``:
    the refusal of the cluster-wide cap); every call recorded."""

    arrays: tuple[str, ...] = ()
    refuse: str | None = None
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def owns(self, job: str) -> bool:
        return job in self.arrays

    async def set_parallelism(self, job: str, to: int, lowering: bool) -> str:
        self.calls.append(("throttle", job, to, lowering))
        return f"throttle of {job}: {to}"

    async def restart_study(self, decision: Decision) -> str:
        self.calls.append(("restart_study", decision.params.get("trial_number")))
        return "trial re-enqueued"

    async def requeue_task(self, decision: Decision) -> str:
        if self.refuse is not None:
            raise ActionRefused(self.refuse)
        params = decision.params
        self.calls.append(("requeue", params["pid"], params["slurm_job"], params["max_requeues"]))
        return f"task {params['slurm_job']} requeued"

    async def drain(self, finding: str) -> str:
        if self.refuse is not None:
            raise ActionRefused(self.refuse)
        self.calls.append(("drain", finding))
        return f"drained: gpuwatchd: {finding}"


def carry(
    decision: Decision,
    *,
    commander: FakeCommander | None = None,
    managed: FakeManaged | None = None,
    gpus: FakeCordons | None = None,
    holds: KnobHolds | None = None,
    slurm: FakeSlurm | None = None,
) -> DecisionRecord:
    """``decision`` carried out by a real :class:`Actuator` over the given fakes; returns
    its record once the outcome is known (or at once when the plan knew it)."""

    async def run() -> DecisionRecord:
        actuator = Actuator(
            commander or FakeCommander([]),
            LOG,
            lambda: NOW,
            managed=managed,
            gpus=gpus,
            holds=holds,
            slurm=slurm,
        )
        record = actuator.apply(decision)
        for _ in range(2000):
            if record.outcome != "pending":
                break
            await asyncio.sleep(0.005)
        await actuator.close()
        return record

    return asyncio.run(run())
