"""Parsing of values with units used in config and policy files (pure, no I/O).

Specification: docs/modules.md#gpuwatchdunits
"""

from __future__ import annotations

import re

from gpuwatchd.errors import UnitError

__all__ = [
    "format_bytes",
    "format_duration",
    "parse_bytes",
    "parse_duration",
    "parse_fraction",
    "parse_percent",
]

_DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_UNITS_BYTES = {
    "b": 1,
    "": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_NUM_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z%]*)\s*$")


def _split(value: object, what: str) -> tuple[float, str]:
    if isinstance(value, bool):
        raise UnitError(f"expected a {what}, got a boolean {value!r}")
    if isinstance(value, (int, float)):
        return float(value), ""
    if not isinstance(value, str):
        raise UnitError(f"expected a {what}, got {type(value).__name__} {value!r}")
    match = _NUM_UNIT.match(value)
    if match is None:
        raise UnitError(f"cannot parse {value!r} as a {what}")
    return float(match.group(1)), match.group(2)


def parse_duration(value: object) -> float:
    """Return ``value`` (``"30s"``, ``"10m"``, ``"500ms"``, ``"1h"``, ``2.5``) in seconds.

    Raises :class:`UnitError` for an unknown unit, a negative or non-numeric value.
    """
    number, unit = _split(value, "duration (e.g. 30s, 10m, 500ms)")
    if unit == "":
        return number
    factor = _DURATION_UNITS_S.get(unit)
    if factor is None:
        raise UnitError(f"unknown duration unit {unit!r} in {value!r} (use ms, s, m, h or d)")
    return number * factor


def parse_bytes(value: object) -> int:
    """Return ``value`` (``"20GiB"``, ``"512MiB"``, ``"1GB"``, ``1048576``) in bytes.

    Raises :class:`UnitError` for an unknown unit or a non-numeric value.
    """
    number, unit = _split(value, "size (e.g. 20GiB, 512MiB)")
    factor = _SIZE_UNITS_BYTES.get(unit.lower())
    if factor is None:
        raise UnitError(
            f"unknown size unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
        )
    return int(number * factor)


def parse_percent(value: object) -> float:
    """Return ``value`` (``90``, ``"90%"``, ``"97.5 %"``) as percent in 0..100.

    Raises :class:`UnitError` for another unit or a value outside 0..100.
    """
    number, unit = _split(value, "percentage (e.g. 90 or 90%)")
    if unit not in ("", "%"):
        raise UnitError(f"expected a percentage, got unit {unit!r} in {value!r}")
    if not 0.0 <= number <= 100.0:
        raise UnitError(f"percentage {value!r} is outside 0..100")
    return number


def parse_fraction(value: object) -> float:
    """Return ``value`` (``0.9``) as a fraction in 0..1; ``"90%"`` is accepted as 0.9.

    Raises :class:`UnitError` for a value outside 0..1 or another unit.
    """
    number, unit = _split(value, "fraction (e.g. 0.9)")
    if unit == "%":
        number /= 100.0
    elif unit != "":
        raise UnitError(f"expected a fraction, got unit {unit!r} in {value!r}")
    if not 0.0 <= number <= 1.0:
        raise UnitError(f"fraction {value!r} is outside 0..1")
    return number


def format_duration(seconds: float) -> str:
    """Return ``seconds`` as a short string: ``"850ms"``, ``"42s"``, ``"3m05s"``, ``"2h10m"``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def format_bytes(n_bytes: float) -> str:
    """Return ``n_bytes`` in IEC units with one decimal: ``"1.5 GiB"``, ``"17.0 MiB"``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
