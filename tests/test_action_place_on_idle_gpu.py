"""The ``place_on_idle_gpu`` action (gpuwatchd/policy/actions/place_on_idle_gpu.py): the
next worker goes to the idle GPU, never to a cordoned one."""

from __future__ import annotations

from action_fakes import FakeCordons, FakeManaged, carry, firing, gpu_group
from gpuwatchd.policy.actions import place_on_idle_gpu

MANAGED = {"hpo": (4, 1), "eval": (2, 1)}


def test_each_managed_job_is_placed_on_the_idle_gpu_unless_one_is_named() -> None:
    fired, params = firing("place_on_idle_gpu: {}", managed=MANAGED)
    decisions = place_on_idle_gpu.decide(fired, params, [gpu_group(1)])
    assert [(d.job, d.gpu_uuid, d.params["gpu_index"]) for d in decisions] == [
        ("hpo", "GPU-0001", 1),
        ("eval", "GPU-0001", 1),
    ]
    only, params = firing("place_on_idle_gpu: {job: eval}", managed=MANAGED)
    assert [d.job for d in place_on_idle_gpu.decide(only, params, [gpu_group(1)])] == ["eval"]


def test_placing_on_a_cordoned_gpu_is_refused() -> None:
    fired, params = firing("place_on_idle_gpu: {job: hpo}", managed=MANAGED)
    (decision,) = place_on_idle_gpu.decide(fired, params, [gpu_group(1)])
    managed = FakeManaged()
    assert carry(decision, managed=managed, gpus=FakeCordons()).outcome == "applied"
    assert managed.calls == [("place_next", "hpo", 1)]
    cordoned = FakeCordons(by={1: "operator uid 0"})
    record = carry(decision, managed=FakeManaged(), gpus=cordoned)
    assert (record.outcome, record.detail) == (
        "refused",
        "GPU 1 is cordoned; no worker is placed on it",
    )
