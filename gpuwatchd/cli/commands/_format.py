"""Small formatting helpers shared by the human (table) output of commands."""

from __future__ import annotations

import time
from typing import Any

from gpuwatchd.units import format_bytes, format_duration

__all__ = ["ago", "gpu_state", "na", "pct", "size", "sm_active_text"]


def na(value: object, fmt: str = "{}") -> str:
    """``fmt.format(value)``, or ``N/A`` when the daemon sent null (NVML's NA)."""
    return "N/A" if value is None else fmt.format(value)


def pct(value: object) -> str:
    """A percentage with one decimal, or ``N/A``."""
    return "N/A" if value is None else f"{float(value):.1f} %"  # type: ignore[arg-type]


def size(value: object) -> str:
    """Bytes in IEC units, or ``N/A``."""
    return "N/A" if value is None else format_bytes(float(value))  # type: ignore[arg-type]


def ago(timestamp_s: object, now_s: float | None = None) -> str:
    """``"12s ago"`` for a daemon wall-clock timestamp, or ``-``."""
    if timestamp_s is None:
        return "-"
    now = time.time() if now_s is None else now_s
    return format_duration(max(0.0, now - float(timestamp_s))) + " ago"  # type: ignore[arg-type]


_THROTTLE_BITS = (
    (0x4, "sw-power-cap"),
    (0x8, "hw-slowdown"),
    (0x20, "sw-thermal"),
    (0x40, "hw-thermal"),
    (0x80, "hw-power-brake"),
)
"""``nvmlClocksEventReason*`` bits shown as throttling (NVML API reference, "Clocks Event
Reasons"; GpuIdle, application/display clock settings and sync boost are not shown)."""


def gpu_state(gpu: dict[str, Any]) -> str:
    """A ``status`` GPU's state in rich markup: its error, ``stale: <call>`` (an NVML call
    past its deadline), hardware-health flags (DBE errors, row remap pending/failure,
    throttle reasons), MIG instances, else ``ok``."""
    if gpu.get("error"):
        return f"[red]{gpu['error']}[/]"
    parts = []
    if gpu.get("stale"):
        parts.append(f"[yellow]stale: {gpu['stale']}[/]")
    health = gpu.get("health") or {}
    if health.get("ecc_dbe_volatile_total"):
        parts.append(f"[red]DBE {health['ecc_dbe_volatile_total']}[/]")
    if health.get("row_remap_failure"):
        parts.append("[red]row remap failed[/]")
    if health.get("row_remap_pending"):
        parts.append("[red]row remap pending (reset)[/]")
    reasons = health.get("clocks_event_reasons")
    if isinstance(reasons, int):
        names = [name for bit, name in _THROTTLE_BITS if reasons & bit]
        if names:
            parts.append(f"[yellow]throttle: {','.join(names)}[/]")
    mig = gpu.get("mig_devices") or []
    if mig:
        parts.append(f"MIG x{len(mig)}")
    return " ".join(parts) or "ok"


def sm_active_text(gpu: dict[str, Any]) -> str:
    """GPM SM activity in percent (two decimals below 1 %: ``0.04 %`` for tiny kernels);
    ``N/A`` where the GPU has no GPM (``gpm_unavailable`` in ``--json`` says why)."""
    value = gpu.get("sm_active_pct")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "N/A"
    return f"{value:.2f} %" if value < 1 else f"{value:.0f} %"
