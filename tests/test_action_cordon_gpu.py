"""The ``cordon_gpu`` action (gpuwatchd/policy/actions/cordon_gpu.py): one decision per
GPU of the firing, carried out by the cordons as the policy."""

from __future__ import annotations

from action_fakes import FakeCordons, carry, finding, firing, gpu_group
from gpuwatchd.policy.actions import cordon_gpu


def test_each_faulty_gpu_is_cordoned_by_the_policy_with_the_findings_as_reason() -> None:
    fired, params = firing("cordon_gpu: {relaunch: false}")
    xid = finding("xid", gpu_index=1, message="Xid 79 on GPU 1")
    (decision,) = cordon_gpu.decide(fired, params, [gpu_group(1, xid)])
    assert (decision.gpu_uuid, dict(decision.params)) == (
        "GPU-0001",
        {"gpu_index": 1, "gpu_uuid": "GPU-0001", "relaunch": False},
    )
    cordons = FakeCordons()
    record = carry(decision, gpus=cordons)
    assert (record.outcome, record.detail) == ("applied", "GPU 1 cordoned")
    assert cordons.calls == [("cordon", 1, "GPU-0001", "policy p", "Xid 79 on GPU 1", False)]
    record = carry(decision)
    assert (record.outcome, record.detail) == ("failed", "no GPU cordons here")


def test_a_gpu_cordoned_within_the_cooldown_is_not_decided_again() -> None:
    first, params = firing("cordon_gpu: {}")
    (decision,) = cordon_gpu.decide(first, params, [gpu_group(1)])
    again, params = firing("cordon_gpu: {}", decided=(decision,))
    assert cordon_gpu.decide(again, params, [gpu_group(1)]) == []
    assert len(cordon_gpu.decide(again, params, [gpu_group(0)])) == 1
