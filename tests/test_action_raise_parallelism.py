"""The ``raise_parallelism`` action (gpuwatchd/policy/actions/raise_parallelism.py): one
step up the ladder, never above the ceiling; started at once."""

from __future__ import annotations

from action_fakes import FakeManaged, carry, firing, job_group
from gpuwatchd.policy.accounting import Accounting
from gpuwatchd.policy.actions import lower_parallelism, raise_parallelism

MANAGED = {"hpo": (4, 1)}


def test_raise_moves_a_lowered_job_up_and_never_above_its_workers() -> None:
    lowering, params = firing("lower_parallelism: {step: 2}", managed=MANAGED)
    (lowered,) = lower_parallelism.decide(lowering, params, [job_group("hpo")])
    fired, params = firing(
        "raise_parallelism: {step: 5}", managed=MANAGED, cooldown="0s", decided=(lowered,)
    )
    (decision,) = raise_parallelism.decide(fired, params, [job_group("hpo")])
    assert dict(decision.params) == {"job": "hpo", "from": 2, "to": 4, "mode": "now"}
    at_top, params = firing("raise_parallelism: {}", managed=MANAGED)
    assert raise_parallelism.decide(at_top, params, [job_group("hpo")]) == []

    managed = FakeManaged()
    assert carry(decision, managed=managed).outcome == "applied"
    assert managed.calls == [("set_parallelism", "hpo", 4, "now")]
    refused = carry(decision, managed=FakeManaged(refuse="job hpo is stopping"))
    assert (refused.outcome, refused.detail) == ("refused", "job hpo is stopping")


def test_a_refused_raise_leaves_the_ladder_where_it_was() -> None:
    # a Slurm raise held within raise_hold is refused: the ladder stays where the
    # lower left it, so the next lower steps on from there (docs/slurm.md)
    lowering, params = firing("lower_parallelism: {}", managed=MANAGED)
    (lowered,) = lower_parallelism.decide(lowering, params, [job_group("hpo")])
    fired, params = firing(
        "raise_parallelism: {}", managed=MANAGED, cooldown="0s", decided=(lowered,)
    )
    (raised,) = raise_parallelism.decide(fired, params, [job_group("hpo")])
    accounting = Accounting(MANAGED)
    accounting.restore([lowered, raised])
    assert accounting.parallelism("hpo") == 4
    accounting.refused(lowered)  # a later decision moved it since: left alone
    assert accounting.parallelism("hpo") == 4
    accounting.refused(raised)
    assert accounting.parallelism("hpo") == 3
