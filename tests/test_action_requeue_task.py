"""The ``requeue_task`` action (gpuwatchd/policy/actions/requeue_task.py): one decision
per crash of a Slurm array's task, naming the task when the crash was read from Slurm,
carried out through Slurm; a refusal and a daemon without ``slurm:`` are outcomes, and a
dry run decides without calling Slurm. Against the real Slurm: tests/test_slurm_crashes.py."""

from __future__ import annotations

import pytest

from action_fakes import CRASHED, FakeSlurm, carry, crash, firing
from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.actions import requeue_task
from gpuwatchd.policy.schema import parse_policies


def test_a_crash_read_from_slurm_requeues_its_task() -> None:
    fired, params = firing("requeue_task: {max_requeues: 2}", when=CRASHED, managed={"hpo": (4, 1)})
    [decision] = requeue_task.decide(fired, params, [crash("hpo", None, "812_3")])
    assert decision.params["slurm_job"] == "812_3"
    slurm = FakeSlurm(arrays=("hpo",))
    record = carry(decision, slurm=slurm)
    assert (record.outcome, record.detail) == ("applied", "task 812_3 requeued")
    assert slurm.calls == [("requeue", None, "812_3", 2)]


def test_a_hook_reported_crash_names_its_worker_and_the_default_cap_is_one() -> None:
    fired, params = firing("requeue_task: {}", when=CRASHED, managed={"hpo": (4, 1)})
    [decision] = requeue_task.decide(fired, params, [crash("hpo", 41)])
    slurm = FakeSlurm(arrays=("hpo",))
    assert carry(decision, slurm=slurm).outcome == "applied"
    assert slurm.calls == [("requeue", 41, None, 1)]  # the task of pid 41's hello


def test_refused_failed_and_dry_run_are_outcomes_without_a_requeue() -> None:
    fired, params = firing("requeue_task: {}", when=CRASHED, managed={"hpo": (4, 1)})
    [decision] = requeue_task.decide(fired, params, [crash("hpo", 41, "812_3")])
    refusing = FakeSlurm(arrays=("hpo",), refuse="task 812_3 was requeued 1 time(s) already")
    refused = carry(decision, slurm=refusing)
    assert (refused.outcome, refused.detail) == (
        "refused",
        "task 812_3 was requeued 1 time(s) already",
    )
    failed = carry(decision)
    assert (failed.outcome, failed.detail) == ("failed", "no slurm: in the config")
    managed = carry(decision, slurm=FakeSlurm(arrays=("other",)))  # hpo: a managed job
    assert (managed.outcome, managed.detail) == (
        "refused",
        "job 'hpo' is not a Slurm array (slurm.arrays)",
    )
    dry, _ = firing("requeue_task: {}", when=CRASHED, managed={"hpo": (4, 1)}, dry_run=True)
    [planned] = requeue_task.decide(dry, params, [crash("hpo", 41, "812_3")])
    slurm = FakeSlurm(arrays=("hpo",))
    assert carry(planned, slurm=slurm).outcome == "dry-run"
    assert slurm.calls == []
    # not a managed job nor a Slurm array: nothing decided
    assert requeue_task.decide(fired, params, [crash("other", 41, "812_3")]) == []


def test_a_policy_needs_a_job_crashed_condition_for_it() -> None:
    text = (
        "policies:\n  - name: p\n    when: {idle_gpu: {for: 1m}}\n"
        "    do:\n      - requeue_task: {}\n"
    )
    with pytest.raises(PolicyError, match="needs a job_crashed"):
        parse_policies(text, "test.yaml")
    with pytest.raises(PolicyError, match="max_requeues"):
        parse_policies(
            text.replace("idle_gpu: {for: 1m}", "job_crashed: {}").replace(
                "requeue_task: {}", "requeue_task: {max_requeues: -1}"
            ),
            "test.yaml",
        )
