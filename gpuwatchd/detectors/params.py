"""Detector parameters: ``ParamSpec``, ``ExclusiveGroup`` and their validation (pure).

The one source the policy schema validates against and the policy reference is
generated from. Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from gpuwatchd.errors import UnitError
from gpuwatchd.units import (
    parse_duration,
    parse_fraction,
    parse_percent,
)

Fail = Callable[[str | None, str], NoReturn]
"""``fail(key, message)``: raise a located error at param ``key`` (None: the whole mapping)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a detector or action.

    ``parse`` turns the YAML value into the stored value (seconds, bytes, percent,
    fraction, ...) and raises ValueError (:class:`~gpuwatchd.errors.UnitError` is one)
    with a readable message. ``default`` is written as in YAML (``"5m"``) and parsed
    the same way; None means no default. ``unit`` and ``help`` feed the docs.
    """

    name: str
    parse: Callable[[object], Any]
    required: bool = False
    default: object = None
    unit: str = ""
    help: str = ""


@dataclass(frozen=True)
class ExclusiveGroup:
    """Parameters of which at most one may be given; exactly one when ``required``.

    If none is given and the group is optional, the first member with a default gets it.
    """

    names: tuple[str, ...]
    required: bool = False


def parse_params(
    specs: Sequence[ParamSpec],
    groups: Sequence[ExclusiveGroup],
    raw: Mapping[str, object] | None,
    fail: Fail,
    *,
    what: str,
) -> dict[str, Any]:
    """Validate ``raw`` (the YAML mapping of params, None = empty) against ``specs``.

    Returns the parsed params, defaults filled in. Calls ``fail(key, message)`` (which
    must raise) for an unknown key, a bad value, a missing required param, or a
    violated :class:`ExclusiveGroup`; ``key`` None points at the mapping itself.
    ``what`` names the owner in messages (``"detector 'vram_above'"``).
    """
    by_name = {s.name: s for s in specs}
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        spec = by_name.get(key)
        if spec is None:
            known = ", ".join(sorted(by_name)) or "none"
            fail(key, f"unknown parameter {key!r} for {what} (known: {known})")
        try:
            out[key] = spec.parse(value)
        except (UnitError, ValueError, TypeError) as exc:
            fail(key, f"{key}: {exc}")
    grouped: set[str] = set()
    for group in groups:
        grouped.update(group.names)
        given = [n for n in group.names if n in out]
        if len(given) > 1:
            fail(given[1], f"{what} takes only one of {', '.join(group.names)}")
        if not given:
            if group.required:
                fail(None, f"{what} needs one of {', '.join(group.names)}")
            for name in group.names:
                if by_name[name].default is not None:
                    out[name] = by_name[name].parse(by_name[name].default)
                    break
    for spec in specs:
        if spec.name in out or spec.name in grouped:
            continue
        if spec.required:
            fail(None, f"{what} needs parameter {spec.name!r}")
        if spec.default is not None:
            out[spec.name] = spec.parse(spec.default)
    return out


def parse_bool(value: object) -> bool:
    """A boolean parameter.

    Raises:
        ValueError: not ``true``/``false`` (YAML booleans only, no strings)."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def percent_param(default: float, help_text: str) -> ParamSpec:
    """The ``percent`` threshold parameter (0-100), with ``default`` and help text."""
    return ParamSpec("percent", parse_percent, default=default, unit="percent", help=help_text)


def for_param(default: str) -> ParamSpec:
    """The ``for`` parameter: how long a condition must hold (a duration, ``default`` e.g.
    ``"30s"``)."""
    return ParamSpec(
        "for",
        parse_duration,
        default=default,
        unit="duration",
        help="how long the condition must hold without a break (30s, 5m)",
    )


def clear_param(above: bool, unit: str = "percent") -> ParamSpec:
    """The ``clear`` hysteresis parameter of a detector firing ``above`` (or below) its
    threshold, in ``unit`` (``percent`` or ``fraction``); no default: the threshold."""
    side = "at or below" if above else "at or above"
    return ParamSpec(
        "clear",
        parse_percent if unit == "percent" else parse_fraction,
        unit=unit,
        help=f"hysteresis: once firing, holds until the value is {side} this (default: the "
        "threshold, no hysteresis)",
    )
