"""Small formatting helpers shared by the human (table) output of commands."""

from __future__ import annotations

import time

from gpuwatchd.units import format_bytes, format_duration

__all__ = ["ago", "na", "pct", "size"]


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
