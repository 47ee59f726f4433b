"""Validated policies: ``Policy``, its ``Condition``/``Action``/``RateLimit`` parts and
``PolicySet`` (immutable values, pure).

Specification: docs/modules.md#gpuwatchdpolicyschema
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.detectors import DETECTORS, ParamSpec
from gpuwatchd.policy.actions import ACTIONS, public_params
from gpuwatchd.units import format_bytes, format_duration


@dataclass(frozen=True)
class RateLimit:
    """``limit: {max, per}``: at most ``max`` firings in any ``per_s`` seconds."""

    max: int
    per_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"max", "per_s"}``."""
        return {"max": self.max, "per_s": self.per_s}


@dataclass(frozen=True)
class Condition:
    """One ``when:`` entry: a detector name, its parsed params, and ``"path:line"``."""

    detector: str
    params: Mapping[str, Any]
    source: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"detector", "params", "source"}`` (seconds, bytes, percent)."""
        return {"detector": self.detector, "params": dict(self.params), "source": self.source}


@dataclass(frozen=True)
class Action:
    """One ``do:`` entry: an action name, its parsed params, and ``"path:line"``."""

    action: str
    params: Mapping[str, Any]
    source: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"action", "params", "source"}`` (a ``notify`` action's URLs
        cut to their scheme: they hold tokens, and ``status`` is open to socket users)."""
        params = public_params(self.action, self.params)
        return {"action": self.action, "params": params, "source": self.source}


def derive_scope(detectors: Sequence[str]) -> str:
    """The default scope of a policy whose conditions name ``detectors``.

    ``job`` if one is about jobs, else ``gpu`` if one is about GPUs, else ``global``.
    Raises KeyError for an unknown detector.
    """
    scopes = {DETECTORS[d].scope for d in detectors}
    if "job" in scopes:
        return "job"
    if "gpu" in scopes:
        return "gpu"
    return "global"


@dataclass(frozen=True)
class Policy:
    """A validated policy. ``cooldown_s`` in seconds; ``source`` is ``"path:line"``.

    ``scope`` is resolved (given, or derived: :func:`derive_scope`); ``limit`` is None
    when the policy has no rate limit.
    """

    name: str
    description: str
    conditions: tuple[Condition, ...]
    actions: tuple[Action, ...]
    cooldown_s: float = 0.0
    dry_run: bool = False
    source: str = ""
    scope: str = "global"
    limit: RateLimit | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for ``gpuwatchctl policy show --json``."""
        return {
            "name": self.name,
            "description": self.description,
            "when": [c.to_dict() for c in self.conditions],
            "do": [a.to_dict() for a in self.actions],
            "scope": self.scope,
            "cooldown_s": self.cooldown_s,
            "limit": None if self.limit is None else self.limit.to_dict(),
            "dry_run": self.dry_run,
            "source": self.source,
        }

    def describe(self) -> str:
        """Several human lines: name, source, conditions, actions, cooldown."""
        flags = " (dry run)" if self.dry_run else ""
        lines = [f"{self.name}{flags}  [{self.source}]  scope {self.scope}"]
        if self.description:
            lines.append(f"  {self.description}")
        for c in self.conditions:
            specs = {s.name: s for s in DETECTORS[c.detector].params}
            lines.append(f"  when {c.detector} {_format_params(c.params, specs)}".rstrip())
        for a in self.actions:
            specs = {s.name: s for s in ACTIONS[a.action].params}
            lines.append(f"  do   {a.action} {_format_params(a.params, specs)}".rstrip())
        if self.cooldown_s:
            lines.append(f"  cooldown {format_duration(self.cooldown_s)}")
        if self.limit is not None:
            lines.append(f"  limit {self.limit.max} per {format_duration(self.limit.per_s)}")
        return "\n".join(lines)


def _format_value(value: Any, spec: ParamSpec | None, params: Mapping[str, Any]) -> str:
    unit = spec.unit if spec else ""
    if unit == "percent|bytes":  # vram_above's clear: the unit of its threshold
        unit = "bytes" if "bytes" in params else "percent"
    if unit == "duration":
        return format_duration(float(value))
    if unit == "bytes":
        return format_bytes(float(value))
    if unit == "percent":
        return f"{value:g}%"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value) if " " in value else value
    return str(value)


def _format_params(params: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> str:
    return " ".join(f"{k}={_format_value(v, specs.get(k), params)}" for k, v in params.items())


@dataclass(frozen=True)
class PolicySet:
    """Validated policies in load order, and the files they came from.

    Iterating yields the :class:`Policy` objects; ``len()`` counts them.
    """

    policies: tuple[Policy, ...] = ()
    sources: tuple[str, ...] = field(default=())

    def __iter__(self) -> Iterator[Policy]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    @property
    def names(self) -> tuple[str, ...]:
        """Policy names in load order."""
        return tuple(p.name for p in self.policies)

    def get(self, name: str) -> Policy | None:
        """The policy called ``name``, or None."""
        for policy in self.policies:
            if policy.name == name:
                return policy
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"sources": [...], "policies": [Policy.to_dict(), ...]}``."""
        return {"sources": list(self.sources), "policies": [p.to_dict() for p in self.policies]}

    def describe(self) -> str:
        """Human text of every policy (for ``gpuwatchctl policy show`` and ``check-policy``)."""
        head = f"{len(self.policies)} policies from {', '.join(self.sources) or 'nowhere'}"
        return "\n".join([head, *(p.describe() for p in self.policies)])
