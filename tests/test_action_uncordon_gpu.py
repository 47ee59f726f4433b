"""The ``uncordon_gpu`` action (gpuwatchd/policy/actions/uncordon_gpu.py): a policy lifts
a policy's cordon, never an operator's."""

from __future__ import annotations

from action_fakes import FakeCordons, carry, firing, gpu_group
from gpuwatchd.policy.actions import uncordon_gpu


def test_a_policy_lifts_a_policys_cordon_and_is_refused_an_operators() -> None:
    fired, params = firing("uncordon_gpu", when="gpu_recovered: {}")
    lift_0, lift_1 = uncordon_gpu.decide(fired, params, [gpu_group(0), gpu_group(1)])
    assert dict(lift_1.params) == {"gpu_index": 1, "gpu_uuid": "GPU-0001"}
    cordons = FakeCordons(by={0: "operator uid 0", 1: "policy gpu-hardware-fault"})
    assert carry(lift_1, gpus=cordons).outcome == "applied"
    assert cordons.calls == [("uncordon", 1, "GPU-0001", "policy p", False)]
    refused = carry(lift_0, gpus=cordons)
    assert (refused.outcome, refused.detail) == (
        "refused",
        "GPU 0 was cordoned by operator uid 0",
    )
    assert cordons.by == {0: "operator uid 0"}
