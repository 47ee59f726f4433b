"""The ``restart_worker`` action (gpuwatchd/policy/actions/restart_worker.py): one
decision per crash of a managed worker; the backend reports its relaunch."""

from __future__ import annotations

from action_fakes import CRASHED, FakeManaged, carry, crash, firing
from gpuwatchd.policy.actions import restart_worker


def test_each_crash_of_a_managed_worker_is_one_decision() -> None:
    fired, params = firing("restart_worker", when=CRASHED, managed={"hpo": (2, 1)})
    decisions = restart_worker.decide(fired, params, [crash("hpo", 41), crash("unmanaged", 42)])
    assert [dict(d.params) for d in decisions] == [
        {"job": "hpo", "pid": 41, "crash_kind": "cuda_oom", "gpu_index": 0, "trial_number": 12}
    ]
    managed = FakeManaged()
    assert carry(decisions[0], managed=managed).outcome == "applied"
    assert managed.calls == [("restart_worker", 41)]
    gone = carry(decisions[0], managed=FakeManaged(refuse="worker 0 is failed: budget spent"))
    assert (gone.outcome, gone.detail) == ("refused", "worker 0 is failed: budget spent")
