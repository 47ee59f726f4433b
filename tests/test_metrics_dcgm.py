"""The DCGM-like GPU fields of issue 22 as Prometheus metrics (dcgm-exporter's meaning,
gpuwatchd's naming: docs/metrics.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpuwatchd.metrics.collector import DaemonCollector
from gpuwatchd.model import NA, GpuHealth, GpuProcess, GpuSample, MigDevice, Snapshot


def _samples(gpu: GpuSample) -> dict[str, list[tuple[dict[str, str], float]]]:
    collector: Any = DaemonCollector(lambda: None, "host1")
    view = SimpleNamespace(
        snapshot=Snapshot(1.0, (gpu,), None), xid_totals={}, process_slurm={42: "77"}
    )
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in collector._gpus(view, {"77": "77"}):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_gpm_health_process_and_mig_fields_are_exported() -> None:
    gpu = GpuSample(
        "GPU-a",
        0,
        "H100",
        1.0,
        utilization_gpu_pct=36.0,
        sm_active_pct=0.04,
        sm_occupancy_pct=NA,
        tensor_active_pct=12.5,
        processes=(GpuProcess(42, 1024, 62.0), GpuProcess(43, 1024)),
        health=GpuHealth(ecc_dbe_volatile_total=3, row_remap_pending=1, clocks_event_reasons=0x44),
        mig_devices=(MigDevice("MIG-1", 3, 2048, 4096),),
        stale="nvmlDeviceGetFieldValues",
    )
    got = _samples(gpu)
    assert got["gpuwatchd_gpu_sm_active_ratio"][0][1] == 0.0004
    assert got["gpuwatchd_gpu_tensor_active_ratio"][0][1] == 0.125
    assert "gpuwatchd_gpu_sm_occupancy_ratio" not in got  # NA: no sample, not 0
    assert got["gpuwatchd_gpu_ecc_dbe_volatile_total"][0][1] == 3
    assert got["gpuwatchd_gpu_row_remap_pending"][0][1] == 1
    assert got["gpuwatchd_gpu_clocks_event_reasons"][0][1] == 0x44
    assert "gpuwatchd_gpu_ecc_sbe_volatile_total" not in got
    assert got["gpuwatchd_gpu_stale"][0][1] == 1.0
    [(labels, value)] = got["gpuwatchd_gpu_process_sm_active_ratio"]
    assert (labels["pid"], labels["slurm_job_id"], value) == ("42", "77", 0.62)
    [(labels, value)] = got["gpuwatchd_gpu_mig_memory_used_bytes"]
    assert (labels["mig_uuid"], labels["gpu_instance_id"], value) == ("MIG-1", "3", 2048)


def test_a_fresh_gpu_is_not_stale() -> None:
    got = _samples(GpuSample("GPU-b", 1, "H100", 1.0))
    assert got["gpuwatchd_gpu_stale"][0][1] == 0.0
