"""The ``drain_node`` action (gpuwatchd/policy/actions/drain_node.py): one decision per
firing naming the findings, carried out through Slurm; the cap's refusal and a daemon
without ``slurm:`` are outcomes, not errors. Against the real Slurm:
tests/test_daemon_ops_node.py."""

from __future__ import annotations

from action_fakes import FakeSlurm, carry, finding, firing, gpu_group
from gpuwatchd.policy.actions import drain_node, lower_parallelism


def test_one_drain_per_firing_names_every_finding() -> None:
    fired, params = firing("drain_node: {}", when="row_remap: {kind: failure}")
    groups = [
        gpu_group(0, finding("row_remap", gpu_index=0, message="GPU 0 row remap failed")),
        gpu_group(1, finding("row_remap", gpu_index=1, message="GPU 1 row remap failed")),
    ]
    [drain] = drain_node.decide(fired, params, groups)
    assert dict(drain.params) == {"finding": "GPU 0 row remap failed; GPU 1 row remap failed"}
    slurm = FakeSlurm()
    done = carry(drain, slurm=slurm)
    assert (done.outcome, done.detail) == (
        "applied",
        "drained: gpuwatchd: GPU 0 row remap failed; GPU 1 row remap failed",
    )
    # within the cooldown (target global) the policy decides no second drain
    later, _ = firing("drain_node: {}", when="row_remap: {kind: failure}", decided=(drain,))
    assert drain_node.decide(later, params, groups) == []


def test_the_cap_refuses_and_no_slurm_fails() -> None:
    fired, params = firing("drain_node: {}", when="row_remap: {kind: failure}")
    [drain] = drain_node.decide(fired, params, [gpu_group(0, finding(gpu_index=0))])
    refused = carry(drain, slurm=FakeSlurm(refuse="1 node(s) drained by gpuwatchd already"))
    assert (refused.outcome, refused.detail) == (
        "refused",
        "1 node(s) drained by gpuwatchd already",
    )
    failed = carry(drain)
    assert (failed.outcome, failed.detail) == ("failed", "no slurm: in the config")


def test_a_ladder_move_of_a_slurm_array_goes_to_slurm() -> None:
    fired, params = firing(
        "lower_parallelism: {job: hpo}", when="vram_above: {percent: 95}", managed={"hpo": (4, 2)}
    )
    [lower] = lower_parallelism.decide(
        fired, params, [gpu_group(0, finding(gpu_index=0))]
    )
    slurm = FakeSlurm(arrays=("hpo",))
    assert carry(lower, slurm=slurm).outcome == "applied"
    assert slurm.calls == [("throttle", "hpo", 3, True)]
