"""The packaged default policies on scripted hardware faults (issue 22 acceptance): Xid 79
and 48, a DBE count rising, a remap pending, a GPU lost, throttle reasons; each is found
once, the right action is decided (cordon_gpu for hardware faults, a log otherwise), an
application Xid decides nothing, a reset that clears the fault lifts the cordon; and
underuse is judged on SM activity where the GPU reports it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from gpuwatchd.model import NA, Decision, Finding, GpuHealth, GpuSample, MaybeFloat, Snapshot
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.xid import XidEvent, describe


def engine() -> PolicyEngine:
    return PolicyEngine(load_policies([default_policy_path()]), max_gap_s=3.0)


def gpu(index: int, health: GpuHealth | None = None, **kw: object) -> GpuSample:
    fields: dict[str, object] = {"utilization_gpu_pct": 97.0, "memory_used_bytes": 10 << 30}
    fields.update(kw)
    return GpuSample(
        f"GPU-{index:04d}",
        index,
        "H100",
        0.0,
        memory_total_bytes=80 << 30,
        health=health or GpuHealth(0, 0, 0, 0, 0, 0, 0),
        **fields,  # type: ignore[arg-type]
    )


def xid(t: float, index: int, code: int) -> XidEvent:
    return XidEvent(t, index, f"GPU-{index:04d}", code, describe(code))


def run(
    frames: Sequence[tuple[Sequence[GpuSample], Sequence[XidEvent]]],
) -> tuple[list[Finding], list[Decision]]:
    eng = engine()
    findings: list[Finding] = []
    decisions: list[Decision] = []
    for t, (gpus, xids) in enumerate(frames):
        result = eng.step(Snapshot(float(t), tuple(gpus), None, xids=tuple(xids)))
        findings += result.findings
        decisions += result.decisions
    return findings, decisions


def fault_findings(findings: Sequence[Finding]) -> Counter[tuple[str, int | None]]:
    faults = {"xid", "ecc_dbe", "row_remap", "gpu_lost", "gpu_throttled", "gpu_recovered"}
    return Counter((f.detector, f.gpu_index) for f in findings if f.detector in faults)


def actions(decisions: Sequence[Decision]) -> list[tuple[str, str, str | None]]:
    return [(d.policy, d.action, d.gpu_uuid) for d in decisions if d.action != "log"]


def test_xid_79_and_48_cordon_their_gpus_once_and_13_decides_nothing() -> None:
    healthy = [gpu(0), gpu(1), gpu(2)]
    frames = [
        (healthy, []),
        (healthy, [xid(1, 0, 79)]),
        (healthy, [xid(2, 0, 79), xid(2, 1, 48)]),  # 79 repeated: same incident
        (healthy, [xid(3, 2, 13), xid(3, 2, 31)]),  # application: crash evidence only
        (healthy, [xid(4, 1, 48)]),
    ]
    findings, decisions = run(frames)
    assert fault_findings(findings) == {("xid", 0): 1, ("xid", 1): 1}
    assert actions(decisions) == [
        ("gpu-hardware-xid", "cordon_gpu", "GPU-0000"),
        ("gpu-hardware-xid", "cordon_gpu", "GPU-0001"),
    ]
    logs = [d for d in decisions if d.action == "log"]
    assert [d.params["level"] for d in logs] == ["error", "error"]
    assert "Xid 79 (hardware; recommended: reboot_node)" in str(logs[0].params["message"])


def test_xid_92_corrected_errors_cordon_nothing_94_and_95_cordon() -> None:
    """NVIDIA's GPU debug guidelines: 92 (a high rate of corrected single-bit errors) is
    informational; 94 (contained) and 95 (uncontained ECC error) need a reset or reboot."""
    healthy = [gpu(0), gpu(1), gpu(2)]
    frames = [(healthy, [xid(0, 0, 92)]), (healthy, [xid(1, 1, 94), xid(1, 2, 95)])]
    _findings, decisions = run(frames)
    assert actions(decisions) == [
        ("gpu-hardware-xid", "cordon_gpu", "GPU-0001"),
        ("gpu-hardware-xid", "cordon_gpu", "GPU-0002"),
    ]


def test_dbe_rising_cordons_once_and_a_reset_lifts_it() -> None:
    def frame(dbe: int) -> tuple[list[GpuSample], list[XidEvent]]:
        return [gpu(0), gpu(1, GpuHealth(0, dbe, 0, 0, 0, 0, 0))], []

    findings, decisions = run([frame(0), frame(0), frame(1), frame(1), frame(1), frame(0)])
    assert fault_findings(findings) == {("ecc_dbe", 1): 1, ("gpu_recovered", 1): 1}
    assert actions(decisions) == [
        ("gpu-hardware-ecc-dbe", "cordon_gpu", "GPU-0001"),
        ("gpu-recovered-uncordon", "uncordon_gpu", "GPU-0001"),
    ]


def test_remap_pending_is_logged_once_failure_cordons() -> None:
    def frame(pending: int, failure: int) -> tuple[list[GpuSample], list[XidEvent]]:
        return [gpu(0, GpuHealth(0, 0, 0, 1, pending, failure, 0))], []

    findings, decisions = run([frame(0, 0), frame(1, 0), frame(1, 0), frame(1, 0), frame(1, 1)])
    assert fault_findings(findings) == {("row_remap", 0): 2}
    pending = [d for d in decisions if d.policy == "gpu-remap-pending"]
    assert [d.action for d in pending] == ["log"]
    assert actions(decisions) == [("gpu-hardware-remap-failure", "cordon_gpu", "GPU-0000")]


def test_gpu_lost_cordons_once_and_its_return_lifts_it() -> None:
    lost = gpu(1, GpuHealth(), utilization_gpu_pct=NA, memory_used_bytes=NA, error="GPU is lost")
    frames = [([gpu(0), gpu(1)], []), *[([gpu(0), lost], [])] * 4, ([gpu(0), gpu(1)], [])]
    findings, decisions = run(frames)
    assert fault_findings(findings) == {("gpu_lost", 1): 1, ("gpu_recovered", 1): 1}
    assert actions(decisions) == [
        ("gpu-hardware-lost", "cordon_gpu", "GPU-0001"),
        ("gpu-recovered-uncordon", "uncordon_gpu", "GPU-0001"),
    ]


def test_sustained_thermal_slowdown_is_logged_once_not_cordoned() -> None:
    hot = gpu(0, GpuHealth(0, 0, 0, 0, 0, 0, 0x40))
    capped = gpu(0, GpuHealth(0, 0, 0, 0, 0, 0, 0x4))
    frames = [([capped], [])] * 90 + [([hot], [])] * 90  # 1 s ticks
    findings, decisions = run(frames)
    assert fault_findings(findings) == {("gpu_throttled", 0): 1}
    (log,) = [d for d in decisions if d.policy == "gpu-throttled"]
    assert log.action == "log" and "hw_thermal" in str(log.params["message"])
    assert actions(decisions) == []


def test_underuse_judged_on_sm_activity_where_reported() -> None:
    def frame(util: float, sm: MaybeFloat) -> tuple[list[GpuSample], list[XidEvent]]:
        return [gpu(0, utilization_gpu_pct=util, sm_active_pct=sm)], []

    findings, _ = run([frame(100.0, 8.0)] * 25)
    under = [f for f in findings if f.detector == "low_utilization"]
    assert under and "GPU 0 SM active 8.0 %" in under[-1].message
    findings, _ = run([frame(100.0, NA)] * 25)  # no GPM: utilization.gpu, not low
    assert not [f for f in findings if f.detector == "low_utilization"]
