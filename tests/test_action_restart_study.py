"""The ``restart_study`` action (gpuwatchd/policy/actions/restart_study.py): as
``restart_worker``, with the retries the trial may have."""

from __future__ import annotations

from action_fakes import CRASHED, FakeManaged, carry, crash, firing
from gpuwatchd.policy.actions import restart_study


def test_the_crashed_trial_is_failed_and_requeued_with_the_actions_retries() -> None:
    fired, params = firing("restart_study: {max_retries: 1}", when=CRASHED, managed={"hpo": (2, 1)})
    (decision,) = restart_study.decide(fired, params, [crash("hpo", 41)])
    assert (decision.params["pid"], decision.params["max_retries"]) == (41, 1)
    managed = FakeManaged()
    record = carry(decision, managed=managed)
    assert (record.outcome, record.detail) == ("applied", "restart_study done")
    assert managed.calls == [("restart_study", 41, 1)]
    assert carry(decision).outcome == "failed"  # no managed jobs here
