"""The knob values the daemon changed in each job, remembered for the job's next ``hello``.

A knob change the job applied (a policy's ``set_knob``, an operator's ``gpuwatchctl
knob``) is remembered per job name with where it came from. When a process of that
job says ``hello`` again (a new Lightning or Hugging Face Trainer per trial attaches
with the script's original values, a managed worker is restarted), the ``hello``
reply hands back the remembered values within the bounds it declared, so the job goes
on where it was. The memory is rebuilt from the journal at start (the applied
``set_knob`` decisions), so it survives a daemon restart. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from gpuwatchd.model import Knob, KnobValue

__all__ = ["OPERATOR", "SCRIPT", "KnobMemory", "RememberedKnob", "policy_source"]

SCRIPT: Final = "script"
"""Source of a knob value the job's own code declared (its ``hello``)."""
OPERATOR: Final = "operator"
"""Source (and journal ``policy`` column) of a value set with ``gpuwatchctl knob``."""
JOB: Final = "job"
"""Source of a value the job changed by itself (e.g. its OOM handling halved batch_size)."""


def policy_source(policy: str) -> str:
    """The source of a value a policy's ``set_knob`` set: ``"policy <name>"``."""
    return f"policy {policy}"


@dataclass(frozen=True, slots=True)
class RememberedKnob:
    """A value applied to a job's knob: ``source`` (``policy <name>`` or ``operator``),
    ``at_s`` when it was applied (daemon clock, seconds)."""

    value: KnobValue
    source: str
    at_s: float


class KnobMemory:
    """Per job name, the last applied value of each knob the daemon changed."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, RememberedKnob]] = {}

    def remember(self, job: str, knob: str, value: KnobValue, source: str, at_s: float) -> None:
        """Record that ``job`` applied ``knob = value`` from ``source`` at ``at_s``."""
        self._jobs.setdefault(job, {})[knob] = RememberedKnob(value, source, at_s)

    def restore(self, applied: Iterable[tuple[str, str, KnobValue, str, float]]) -> None:
        """Rebuild from ``(job, knob, value, source, at_s)`` entries, oldest first (the
        journal's applied ``set_knob`` decisions); a later entry replaces an earlier one."""
        for job, knob, value, source, at_s in applied:
            self.remember(job, knob, value, source, at_s)

    def of(self, job: str) -> dict[str, RememberedKnob]:
        """The remembered knobs of ``job`` (a copy; ``{}`` when none)."""
        return dict(self._jobs.get(job, {}))

    def handback(
        self, job: str, declared: Mapping[str, Knob]
    ) -> tuple[dict[str, KnobValue], dict[str, str]]:
        """What a ``hello`` of ``job`` declaring ``declared`` gets back.

        Returns ``(values, refused)``: ``values`` the remembered values of declared knobs
        that differ from the declared value, are of the same kind (bool or number) and
        fit its bounds; ``refused`` ``{knob: reason}`` for remembered values outside
        the declared bounds or of another kind.
        """
        values: dict[str, KnobValue] = {}
        refused: dict[str, str] = {}
        for name, remembered in self._jobs.get(job, {}).items():
            knob = declared.get(name)
            if knob is None or remembered.value == knob.value:
                continue
            if isinstance(remembered.value, bool) != isinstance(knob.value, bool):
                refused[name] = f"remembered value {remembered.value!r} is not of the knob's kind"
                continue
            error = knob.bounds_error(remembered.value)
            if error is not None:
                refused[name] = error
                continue
            values[name] = remembered.value
        return values, refused

    def source_of(self, job: str, knob: str, value: KnobValue) -> str | None:
        """The remembered source when ``value`` is the remembered value of ``job``'s
        ``knob``, else None."""
        remembered = self._jobs.get(job, {}).get(knob)
        if remembered is None or remembered.value != value:
            return None
        if isinstance(remembered.value, bool) != isinstance(value, bool):
            return None
        return remembered.source
