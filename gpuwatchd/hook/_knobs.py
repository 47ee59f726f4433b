"""Knob declarations of the job-side hook: parsing, bounds and value checks (pure, no I/O).

A knob is a setting of the running job that the daemon may change, named with the
PyTorch ``DataLoader`` argument it feeds (``num_workers``, ``prefetch_factor``,
``persistent_workers``) or any name the job chooses. Each has a kind (``int``,
``float`` or ``bool``, taken from its initial value), a current value and
inclusive bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from gpuwatchd.errors import KnobError
from gpuwatchd.model import KnobValue

__all__ = [
    "DEFAULT_BOUNDS",
    "LIVE_LOADER_KNOBS",
    "KnobKind",
    "KnobSpec",
    "check_value",
    "divisors",
    "parse_knobs",
]

KnobKind = Literal["int", "float", "bool"]

DEFAULT_BOUNDS: Final[Mapping[str, tuple[KnobValue, KnobValue]]] = {
    # torch.utils.data.DataLoader: num_workers >= 0 (0 loads in the main process);
    # 64 is a sane ceiling for one process on one host.
    "num_workers": (0, 64),
    # DataLoader: prefetch_factor (batches loaded in advance per worker) must be >= 1.
    "prefetch_factor": (1, 64),
    "persistent_workers": (False, True),
}
"""Bounds used when the job declares a well-known knob without its own ``min``/``max``.

``batch_size`` gets ``[1, effective batch size]`` from :func:`gpuwatchd.hook.attach`."""

LIVE_LOADER_KNOBS: Final = frozenset({"num_workers", "prefetch_factor"})
"""DataLoader knobs that can be changed on an existing ``torch.utils.data.DataLoader``
between two epochs (its ``__setattr__`` forbids ``batch_size`` and
``persistent_workers`` once built; the next ``iter()`` starts the new workers)."""


@dataclass(frozen=True, slots=True)
class KnobSpec:
    """A declared knob: ``name``, ``kind``, initial ``value`` and inclusive bounds.

    ``min``/``max`` are ``None`` when unbounded on that side (only for knobs the job
    names itself without bounds; the well-known DataLoader knobs always have bounds).
    """

    name: str
    kind: KnobKind
    value: KnobValue
    min: KnobValue | None
    max: KnobValue | None

    def as_hello(self, value: KnobValue) -> dict[str, KnobValue | None]:
        """The ``hello`` form ``{"value", "min", "max"}`` with ``value`` as current value.

        A boolean knob (``persistent_workers``) has no range: its bounds go as ``null``
        (docs/protocol.md: ``min``/``max`` are numbers or null)."""
        if self.kind == "bool":
            return {"value": value, "min": None, "max": None}
        return {"value": value, "min": self.min, "max": self.max}


def _kind_of(name: str, value: object) -> KnobKind:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise KnobError(f"knob {name!r}: value {value!r} is not finite", knob=name)
        return "float"
    raise KnobError(
        f"knob {name!r}: value must be an int, a float or a bool, not {type(value).__name__}",
        knob=name,
    )


def _coerce(name: str, kind: KnobKind, value: object) -> KnobValue:
    """``value`` as a value of ``kind``; raises KnobError when it is not one."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise KnobError(f"knob {name!r} takes true or false, not {value!r}", knob=name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KnobError(f"knob {name!r} takes a number, not {value!r}", knob=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise KnobError(f"knob {name!r}: value {value!r} is not finite", knob=name)
    if kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise KnobError(f"knob {name!r} takes an integer, not {value!r}", knob=name)
            return int(value)
        return value
    return float(value)


def check_value(spec: KnobSpec, value: object) -> KnobValue:
    """Check a new value for ``spec``: right kind and within ``[min, max]``.

    Returns the value coerced to the knob's kind (``2.0`` -> ``2`` for an int knob).
    Raises :class:`KnobError` with a message fit for a ``bad_request`` reply.
    """
    coerced = _coerce(spec.name, spec.kind, value)
    if spec.kind != "bool":
        if spec.min is not None and coerced < spec.min:
            raise KnobError(
                f"knob {spec.name!r}: {coerced!r} is below its minimum {spec.min!r} "
                f"(bounds [{spec.min!r}, {spec.max!r}])",
                knob=spec.name,
            )
        if spec.max is not None and coerced > spec.max:
            raise KnobError(
                f"knob {spec.name!r}: {coerced!r} is above its maximum {spec.max!r} "
                f"(bounds [{spec.min!r}, {spec.max!r}])",
                knob=spec.name,
            )
    return coerced


def _parse_one(
    name: object, raw: object, defaults: Mapping[str, tuple[KnobValue, KnobValue]]
) -> KnobSpec:
    if not isinstance(name, str) or not name:
        raise KnobError(f"knob names must be non-empty strings, not {name!r}")
    bounds = defaults.get(name, DEFAULT_BOUNDS.get(name))
    low: object = bounds[0] if bounds else None
    high: object = bounds[1] if bounds else None
    if isinstance(raw, Mapping):
        unknown = set(raw) - {"value", "min", "max"}
        if unknown:
            raise KnobError(
                f"knob {name!r}: unknown keys {sorted(map(str, unknown))} "
                "(expected 'value', 'min', 'max')",
                knob=name,
            )
        if "value" not in raw:
            raise KnobError(f"knob {name!r}: missing 'value'", knob=name)
        value = raw["value"]
        low = raw.get("min", low)
        high = raw.get("max", high)
    else:
        value = raw
    kind = _kind_of(name, value)
    if kind == "bool":
        low, high = False, True
    spec_low = None if low is None else _coerce(name, kind, low)
    spec_high = None if high is None else _coerce(name, kind, high)
    if spec_low is not None and spec_high is not None and spec_low > spec_high:
        raise KnobError(f"knob {name!r}: min {spec_low!r} is above max {spec_high!r}", knob=name)
    spec = KnobSpec(name=name, kind=kind, value=value, min=spec_low, max=spec_high)
    return KnobSpec(
        name=name, kind=kind, value=check_value(spec, value), min=spec_low, max=spec_high
    )


def parse_knobs(
    knobs: Mapping[str, object] | None,
    defaults: Mapping[str, tuple[KnobValue, KnobValue]] | None = None,
) -> dict[str, KnobSpec]:
    """Parse the ``knobs=`` argument of :func:`gpuwatchd.hook.attach`.

    Each entry is ``name: value`` or ``name: {"value": v, "min": a, "max": b}``.
    The kind comes from the value (bool, int or float). Missing bounds of
    ``num_workers`` [0, 64], ``prefetch_factor`` [1, 64] and ``persistent_workers``
    (bool) come from :data:`DEFAULT_BOUNDS`, or from ``defaults`` ``{name: (min, max)}``
    which takes precedence; other knobs without bounds are unbounded.
    Raises :class:`KnobError` for a wrong type, an unknown key, ``min > max`` or an
    initial value outside its bounds.
    """
    if knobs is None:
        return {}
    if not isinstance(knobs, Mapping):
        raise KnobError(f"knobs must be a mapping of name to value, not {type(knobs).__name__}")
    extra = defaults or {}
    return {spec.name: spec for spec in (_parse_one(k, v, extra) for k, v in knobs.items())}


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` (``n >= 1``), ascending: the batch sizes that split an
    effective batch of ``n`` samples into equal micro-batches."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
