"""The ``restart_worker`` action (gpuwatchd/policy/actions/restart_worker.py): one
decision per crash of a managed worker; the backend reports its relaunch."""

from __future__ import annotations

from action_fakes import NOW, FakeManaged, Group, carry, firing
from gpuwatchd.detectors import EventFinding
from gpuwatchd.model import JobEvent
from gpuwatchd.policy.actions import restart_worker

WHEN = "job_crashed: {kind: cuda_oom}"


def crash(job: str, pid: int) -> Group:
    event = JobEvent(NOW, job, "crash", pid, "cuda_oom", 12, None, 0, "CUDA out of memory")
    found = EventFinding(
        "job_crashed", f"job:{job}", NOW, NOW, 1.0, 0.0, "worker died", None, 0, job, event
    )
    return Group(f"job:{job}", [found], job=job)


def test_each_crash_of_a_managed_worker_is_one_decision() -> None:
    fired, params = firing("restart_worker", when=WHEN, managed={"hpo": (2, 1)})
    decisions = restart_worker.decide(fired, params, [crash("hpo", 41), crash("unmanaged", 42)])
    assert [dict(d.params) for d in decisions] == [
        {"job": "hpo", "pid": 41, "crash_kind": "cuda_oom", "gpu_index": 0, "trial_number": 12}
    ]
    managed = FakeManaged()
    assert carry(decisions[0], managed=managed).outcome == "applied"
    assert managed.calls == [("restart_worker", 41)]
    gone = carry(decisions[0], managed=FakeManaged(refuse="worker 0 is failed: budget spent"))
    assert (gone.outcome, gone.detail) == ("refused", "worker 0 is failed: budget spent")
