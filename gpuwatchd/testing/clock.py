"""A clock for tests: time stands still until you advance it."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """A callable clock returning seconds (like ``time.time``) that moves only by :meth:`advance`.

    ``start_s`` defaults to 1,000,000 s so that "0" never passes for a real time.
    Pass the instance wherever a ``clock: Callable[[], float]`` is injected.
    """

    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now_s = float(start_s)

    def __call__(self) -> float:
        """The current fake time in seconds."""
        return self.now_s

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0) and return the new time.

        Raises ``ValueError`` for a negative step: a monotonic clock never goes back.
        """
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now_s += seconds
        return self.now_s

    def __repr__(self) -> str:
        return f"FakeClock({self.now_s})"
