"""``gpuwatchctl status``/``top``: a GPU's state and SM activity cells (issue 22 fields)."""

from __future__ import annotations

from gpuwatchd.cli.commands._format import gpu_state, sm_active_text
from gpuwatchd.cli.commands.status import GPU_COLUMNS, gpu_rows


def _gpu(**extra: object) -> dict[str, object]:
    gpu: dict[str, object] = {
        "index": 0,
        "name": "H100",
        "utilization_gpu_pct": 36.0,
        "memory_used_bytes": 1,
        "memory_total_bytes": 2,
        "memory_used_pct": 50.0,
        "temperature_gpu_c": 33.0,
        "power_draw_w": 124.7,
        "processes": [],
        "error": None,
        "stale": None,
        "sm_active_pct": 0.0352,
        "health": {"clocks_event_reasons": 0},
        "mig_devices": [],
    }
    gpu.update(extra)
    return gpu


def test_tiny_kernels_show_36_percent_util_and_004_percent_sm_active() -> None:
    [row] = gpu_rows([_gpu()])
    cells = dict(zip(GPU_COLUMNS, row, strict=True))
    assert (cells["util"], cells["SM act"], cells["state"]) == ("36.0 %", "0.04 %", "ok")
    assert sm_active_text(_gpu(sm_active_pct=None)) == "N/A"
    assert sm_active_text(_gpu(sm_active_pct=96.2)) == "96 %"


def test_state_names_stale_calls_and_hardware_faults() -> None:
    assert gpu_state(_gpu(stale="nvmlDeviceGetFieldValues")) == (
        "[yellow]stale: nvmlDeviceGetFieldValues[/]"
    )
    faulty = _gpu(
        health={"ecc_dbe_volatile_total": 2, "row_remap_pending": 1, "clocks_event_reasons": 0x45},
        mig_devices=[{"uuid": "MIG-1"}],
    )
    state = gpu_state(faulty)
    assert "DBE 2" in state and "row remap pending" in state
    assert "throttle: sw-power-cap,hw-thermal" in state and "MIG x1" in state
    assert gpu_state(_gpu(error="GPU is lost")) == "[red]GPU is lost[/]"
    assert gpu_state(_gpu(health={"clocks_event_reasons": 0x1})) == "ok"  # GPU idle is no fault
