"""Operator overrides: a knob an operator set holds against policies for a stated time.

``gpuwatchctl knob JOB KNOB VALUE --hold DURATION`` (default 30 minutes, at most 24
hours, ``0`` for none) places a :class:`KnobHold` on ``(job, knob)``, as a manual
override on a controller does. While it is in force, a policy decision that would change
that knob (``set_knob``, a ``tune_loader`` move) is not carried out: the actuator journals
it ``refused`` with :meth:`KnobHold.describe` as the detail, and the tuner ends (or does
not open) its session on that knob. An operator's later ``knob`` command on the same knob
replaces the hold; ``--hold 0`` clears it.

The daemon owns one :class:`KnobHolds` and passes it to the policy engine (the tuner), the
actuator and the ``knob`` op. The holds are rebuilt from the journal at start (the
operator's applied ``set_knob`` decisions carry their ``hold_s``), so a hold outlives a
daemon restart as the knob memory does. Pure: no I/O; the clock (seconds, the daemon's
wall clock) is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from gpuwatchd.model import KnobValue

__all__ = ["DEFAULT_HOLD_S", "MAX_HOLD_S", "KnobHold", "KnobHolds", "check_hold_s"]

DEFAULT_HOLD_S: Final = 1800.0
"""How long an operator's knob change holds against policies unless told (30 minutes)."""
MAX_HOLD_S: Final = 86400.0
"""The longest hold an operator may ask for (24 hours)."""


def check_hold_s(hold_s: object) -> float:
    """``hold_s`` as seconds (a number, 0..:data:`MAX_HOLD_S`).

    Raises :class:`ValueError` (with a one-line reason) for anything else.
    """
    if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)):
        raise ValueError(f"'hold_s' must be a number of seconds, not {hold_s!r}")
    if not 0 <= hold_s <= MAX_HOLD_S:
        raise ValueError(f"'hold_s' must be 0-{MAX_HOLD_S:.0f} seconds (24h), not {hold_s!r}")
    return float(hold_s)


@dataclass(frozen=True, slots=True)
class KnobHold:
    """An operator's ``knob = value`` on ``job``, held until ``until_s`` (daemon clock,
    seconds since the epoch), asked by ``uid`` through ``via`` at ``since_s``."""

    job: str
    knob: str
    value: KnobValue
    uid: int
    since_s: float
    until_s: float
    via: str = "gpuwatchctl knob"

    def describe(self) -> str:
        """One line naming the override, for a refused decision's detail, e.g.
        ``operator override: num_workers=2 by uid 0 (gpuwatchctl knob) until 18:42:07 UTC``."""
        until = time.strftime("%H:%M:%S", time.gmtime(self.until_s))
        return (
            f"operator override: {self.knob}={_text(self.value)} by uid {self.uid} "
            f"({self.via}) until {until} UTC"
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (``status``'s ``holds`` entries)."""
        return {
            "job": self.job,
            "knob": self.knob,
            "value": self.value,
            "by_uid": self.uid,
            "via": self.via,
            "since_s": self.since_s,
            "until_s": self.until_s,
        }


def _text(value: KnobValue) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


class KnobHolds:
    """The operator holds in force, per ``(job, knob)``; ``clock`` gives seconds.

    An expired hold is forgotten the next time it is looked at.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._holds: dict[tuple[str, str], KnobHold] = {}

    def now(self) -> float:
        """The holds' clock now (seconds)."""
        return self._clock()

    def hold(
        self,
        job: str,
        knob: str,
        value: KnobValue,
        *,
        uid: int,
        hold_s: float,
        via: str = "gpuwatchctl knob",
        since_s: float | None = None,
    ) -> KnobHold | None:
        """Hold ``job``'s ``knob`` at ``value`` for ``hold_s`` seconds from ``since_s``
        (default now), replacing any hold on it; ``hold_s`` 0 clears it (returns None).
        A hold already over at ``since_s + hold_s`` is not kept (returns None).

        Raises :class:`ValueError` for a ``hold_s`` outside 0..:data:`MAX_HOLD_S`.
        """
        hold_s = check_hold_s(hold_s)
        key = (job, knob)
        self._holds.pop(key, None)
        start = self._clock() if since_s is None else since_s
        if hold_s == 0 or start + hold_s <= self._clock():
            return None
        held = KnobHold(job, knob, value, uid, start, start + hold_s, via)
        self._holds[key] = held
        return held

    def clear(self, job: str, knob: str) -> None:
        """End the hold on ``job``'s ``knob`` (no-op when none)."""
        self._holds.pop((job, knob), None)

    def active(self, job: str | None, knob: str) -> KnobHold | None:
        """The hold in force on ``job``'s ``knob`` now, or None."""
        if job is None:
            return None
        held = self._holds.get((job, knob))
        if held is None:
            return None
        if held.until_s <= self._clock():
            del self._holds[(job, knob)]
            return None
        return held

    def in_force(self) -> list[KnobHold]:
        """Every hold in force now, by job then knob (expired ones forgotten)."""
        now = self._clock()
        for key in [k for k, h in self._holds.items() if h.until_s <= now]:
            del self._holds[key]
        return [self._holds[k] for k in sorted(self._holds)]

    def restore(self, entries: Iterable[tuple[str, str, KnobValue, int, float, float]]) -> None:
        """Rebuild from ``(job, knob, value, uid, since_s, hold_s)`` entries, oldest first
        (the journal's applied operator ``set_knob`` decisions); a later entry replaces an
        earlier one, ``hold_s`` 0 clears, expired holds are not kept. Entries with a bad
        ``hold_s`` are skipped."""
        for job, knob, value, uid, since_s, hold_s in entries:
            try:
                self.hold(job, knob, value, uid=uid, hold_s=hold_s, since_s=since_s)
            except ValueError:
                continue
