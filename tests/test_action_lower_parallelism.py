"""The ``lower_parallelism`` action (gpuwatchd/policy/actions/lower_parallelism.py): one
step down the ladder, never below the floor; the supervisor backend stops the worker."""

from __future__ import annotations

from action_fakes import FakeManaged, carry, firing, job_group
from gpuwatchd.policy.actions import lower_parallelism

MANAGED = {"hpo": (4, 2), "other": (3, 1)}


def test_lower_moves_the_concerned_job_one_step_down_to_its_floor() -> None:
    fired, params = firing("lower_parallelism: {step: 5}", managed=MANAGED)
    (decision,) = lower_parallelism.decide(fired, params, [job_group("hpo")])
    assert (decision.job, dict(decision.params)) == (
        "hpo",
        {"job": "hpo", "from": 4, "to": 2, "mode": "drain"},  # min_workers 2 is the floor
    )
    lowered, params = firing(
        "lower_parallelism: {}", managed=MANAGED, cooldown="0s", decided=(decision,)
    )
    assert lowered.parallelism("hpo") == 2
    assert lower_parallelism.decide(lowered, params, [job_group("hpo")]) == []


def test_the_supervisor_backend_carries_it_out_and_without_jobs_it_fails() -> None:
    fired, params = firing("lower_parallelism: {mode: now}", managed=MANAGED)
    (decision,) = lower_parallelism.decide(fired, params, [job_group("hpo")])
    managed = FakeManaged()
    record = carry(decision, managed=managed)
    assert (record.outcome, record.detail) == ("applied", "set_parallelism done")
    assert managed.calls == [("set_parallelism", "hpo", 3, "now")]
    record = carry(decision)
    assert (record.outcome, record.detail) == (
        "failed",
        "no managed jobs (the config has no jobs:)",
    )
