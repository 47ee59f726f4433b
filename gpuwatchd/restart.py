"""A job's restart rules (``restart:`` in the config), parsed and checked (pure).

Specification: docs/modules.md#gpuwatchdrestart
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpuwatchd.errors import ConfigError, UnitError
from gpuwatchd.units import parse_duration

__all__ = ["RESTART_KEYS", "RestartPolicy"]

RESTART_KEYS: Final = (
    "backoff",
    "max_backoff",
    "budget",
    "budget_window",
    "crash_loop",
    "min_uptime",
    "reset_after",
    "stop_timeout",
)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart rules of one job; see the module docstring for each field's meaning."""

    backoff_s: float = 5.0
    max_backoff_s: float = 300.0
    budget: int = 20
    budget_window_s: float = 3600.0
    crash_loop: int = 5
    min_uptime_s: float = 10.0
    reset_after_s: float = 60.0
    stop_timeout_s: float = 10.0

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, job: str = "?") -> RestartPolicy:
        """Build from a job's ``restart:`` mapping (durations as ``5s``/``5m`` or seconds).

        Raises :class:`~gpuwatchd.errors.ConfigError` naming the job and key for an unknown
        key, a bad duration, a negative value, or ``max_backoff < backoff``.
        """
        values: dict[str, Any] = {}
        for key, raw in mapping.items():
            if key not in RESTART_KEYS:
                raise ConfigError(
                    f"job {job!r}: unknown key restart.{key} "
                    f"(expected one of: {', '.join(RESTART_KEYS)})"
                )
            if key in ("budget", "crash_loop"):
                if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
                    raise ConfigError(f"job {job!r}: restart.{key} must be a positive integer")
                values[key] = raw
                continue
            try:
                seconds = parse_duration(raw)
            except UnitError as exc:
                raise ConfigError(f"job {job!r}: restart.{key}: {exc}") from None
            if seconds < 0:
                raise ConfigError(f"job {job!r}: restart.{key} must not be negative")
            values[f"{key}_s"] = seconds
        policy = cls(**values)
        if policy.max_backoff_s < policy.backoff_s:
            raise ConfigError(f"job {job!r}: restart.max_backoff is shorter than restart.backoff")
        return policy

    def delay_s(self, streak: int) -> float:
        """Delay before restart number ``streak`` (1 = first crash) of a run of crashes.

        ``backoff * 2**(streak-1)``, capped at ``max_backoff``.
        """
        if streak <= 1:
            return min(self.backoff_s, self.max_backoff_s)
        # 2**60 s is far beyond any cap; avoids float overflow for absurd streaks.
        return min(self.backoff_s * 2.0 ** min(streak - 1, 60), self.max_backoff_s)
