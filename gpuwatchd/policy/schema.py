"""Policy files: strict validation into immutable :class:`PolicySet` values.

Specification: docs/modules.md#gpuwatchdpolicyschema
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, NoReturn

from gpuwatchd.detectors import DETECTORS, ExclusiveGroup, Fail, ParamSpec, parse_params
from gpuwatchd.errors import PolicyError
from gpuwatchd.units import format_bytes, format_duration, parse_duration
from gpuwatchd.yamlsrc import LocatedDict, LocatedList, fail_at, load_located

__all__ = [
    "ACTIONS",
    "LADDER_MODES",
    "LOG_LEVELS",
    "POLICY_KEYS",
    "SCOPES",
    "Action",
    "ActionSpec",
    "Condition",
    "Policy",
    "PolicySet",
    "RateLimit",
    "merge_policy_sets",
    "parse_policies",
]

LOG_LEVELS: Final = ("info", "warning", "error")
"""Levels of the ``log`` action (structlog/stdlib level names)."""

LADDER_MODES: Final = ("drain", "now")
"""How ``lower_parallelism`` removes a worker: ``drain`` (finish its trial, then exit) or
``now`` (stop it at once; its trial is failed and re-enqueued)."""
SCOPES: Final = ("gpu", "job", "global")
"""Policy scopes: conditions judged per GPU, per job, or all together."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS: Final = ("policies",)


def _parse_text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _parse_level(value: object) -> str:
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return str(value)


def _parse_number(value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


def _parse_knob_value(value: object) -> int | float | bool:
    if isinstance(value, bool):
        return value
    return _parse_number(value)


def _parse_factor(value: object) -> float:
    number = _parse_number(value)
    if number <= 0:
        raise ValueError(f"factor must be > 0, got {value!r}")
    return float(number)


def _parse_step(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"step must be an integer (may be negative), got {value!r}")
    if value == 0:
        raise ValueError("step 0 changes nothing")
    return value


def _parse_positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def _parse_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return value


def _parse_mode(value: object) -> str:
    if value not in LADDER_MODES:
        raise ValueError(f"expected one of {', '.join(LADDER_MODES)}, got {value!r}")
    return str(value)


def _parse_positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"expected a duration > 0, got {value!r}")
    return seconds


def _parse_argv(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"argv must be a list of arguments such as [/usr/bin/notify-send, hi], never a "
            f"shell string (got {value!r})"
        )
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of arguments, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"every argument must be a non-empty string, got {item!r}")
    return tuple(value)


def _parse_scope(value: object) -> str:
    if value not in SCOPES:
        raise ValueError(f"expected one of {', '.join(SCOPES)}, got {value!r}")
    return str(value)


def _parse_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _check_set_knob(params: Mapping[str, Any], fail: Fail) -> None:
    low, high = params.get("min"), params.get("max")
    if low is not None and high is not None and low > high:
        fail("max", f"max ({high}) is below min ({low})")


@dataclass(frozen=True)
class ActionSpec:
    """An action of the ``do:`` vocabulary: its params and an optional cross-check.

    ``check(params, fail)`` sees the parsed params and calls ``fail(key, message)`` to
    reject a combination (e.g. ``min > max``).
    """

    name: str
    description: str
    params: tuple[ParamSpec, ...]
    groups: tuple[ExclusiveGroup, ...] = ()
    check: Callable[[Mapping[str, Any], Fail], None] | None = None


def _job_param(default_help: str) -> ParamSpec:
    return ParamSpec("job", _parse_text, unit="name", help=default_help)


_STEP = ParamSpec(
    "step", _parse_positive_int, default=1, unit="workers", help="workers per move (>= 1)"
)

ACTIONS: Final[Mapping[str, ActionSpec]] = MappingProxyType(
    {
        "log": ActionSpec(
            "log",
            "write a log event (journald) with the policy's findings",
            (
                ParamSpec(
                    "message",
                    _parse_text,
                    unit="text",
                    help="text to log (default: the findings' messages)",
                ),
                ParamSpec(
                    "level",
                    _parse_level,
                    default="info",
                    unit="info|warning|error",
                    help="log level",
                ),
            ),
        ),
        "set_knob": ActionSpec(
            "set_knob",
            "change a knob of attached jobs (e.g. the DataLoader's num_workers)",
            (
                ParamSpec(
                    "knob",
                    _parse_text,
                    required=True,
                    unit="name",
                    help="knob as the job declared it (num_workers, prefetch_factor)",
                ),
                ParamSpec("value", _parse_knob_value, unit="number|bool", help="new value"),
                ParamSpec(
                    "factor",
                    _parse_factor,
                    unit="number > 0",
                    help="multiply the current value (ints round half up, move >= 1)",
                ),
                ParamSpec(
                    "step",
                    _parse_step,
                    unit="integer",
                    help="add to the current value (may be negative)",
                ),
                ParamSpec("min", _parse_number, unit="number", help="lower bound of the result"),
                ParamSpec("max", _parse_number, unit="number", help="upper bound of the result"),
                ParamSpec(
                    "job",
                    _parse_text,
                    unit="name",
                    help="only this job (default: the jobs the findings name, else the jobs "
                    "on the findings' GPUs, else every attached job with the knob)",
                ),
            ),
            groups=(ExclusiveGroup(("value", "factor", "step"), required=True),),
            check=_check_set_knob,
        ),
        "lower_parallelism": ActionSpec(
            "lower_parallelism",
            "move a managed job one step down its parallelism ladder (fewer worker processes)",
            (
                _job_param(
                    "managed job (default: the managed jobs the findings concern; every "
                    "managed job for host findings); not checked against the config"
                ),
                _STEP,
                ParamSpec(
                    "floor",
                    _parse_positive_int,
                    unit="workers",
                    help="never below this (default and lowest: the job's min_workers)",
                ),
                ParamSpec(
                    "mode",
                    _parse_mode,
                    default="drain",
                    unit="drain|now",
                    help="drain: the worker finishes its trial first; now: stop it at once",
                ),
            ),
        ),
        "raise_parallelism": ActionSpec(
            "raise_parallelism",
            "move a managed job one step up its parallelism ladder (more worker processes)",
            (
                _job_param(
                    "managed job (default: the managed jobs the findings concern); not "
                    "checked against the config"
                ),
                _STEP,
                ParamSpec(
                    "ceiling",
                    _parse_positive_int,
                    unit="workers",
                    help="never above this (default and highest: the job's workers)",
                ),
            ),
        ),
        "place_on_idle_gpu": ActionSpec(
            "place_on_idle_gpu",
            "start the next worker of a managed job on the idle GPU (scope gpu)",
            (
                _job_param(
                    "managed job (default: every managed job); not checked against the config"
                ),
            ),
        ),
        "restart_worker": ActionSpec(
            "restart_worker",
            "relaunch the crashed worker of a managed job (needs a job_crashed condition)",
            (),
        ),
        "restart_study": ActionSpec(
            "restart_study",
            "fail the crashed worker's Optuna trial and re-enqueue its params; the "
            "supervisor relaunches the worker with the job's restart: backoff and budget "
            "(needs a job_crashed condition)",
            (
                ParamSpec(
                    "max_retries",
                    _parse_count,
                    default=3,
                    unit="count",
                    help="re-enqueue a failed trial's params at most this often",
                ),
            ),
        ),
        "exec": ActionSpec(
            "exec",
            "run a command (argv list, no shell) with {job}, {gpu_index}, {gpu_uuid}, "
            "{policy}, {subject} replaced in its arguments",
            (
                ParamSpec(
                    "argv",
                    _parse_argv,
                    required=True,
                    unit="list",
                    help="program and arguments; a string is an error (never a shell string)",
                ),
                ParamSpec(
                    "timeout",
                    _parse_positive_duration,
                    default="30s",
                    unit="duration",
                    help="kill the command after this long",
                ),
            ),
        ),
    }
)
"""Every action a policy's ``do:`` may name, by name."""


def _as_is(value: object) -> object:
    """Structured keys (``when``, ``do``, ``limit``) are parsed by the policy parser itself."""
    return value


POLICY_KEYS: Final[tuple[ParamSpec, ...]] = (
    ParamSpec("name", _parse_text, required=True, unit="name", help="unique across all files"),
    ParamSpec("description", _as_is, unit="text", help="what the policy is for"),
    ParamSpec(
        "when", _as_is, required=True, unit="mapping", help="detector -> params; all must hold"
    ),
    ParamSpec(
        "do", _as_is, required=True, unit="list", help="actions, in order: - action: {params}"
    ),
    ParamSpec(
        "scope",
        _parse_scope,
        unit="gpu|job|global",
        help="judge the conditions per GPU, per job or together (default: job if a condition "
        "is about jobs, else gpu if one is about GPUs, else global)",
    ),
    ParamSpec(
        "cooldown",
        parse_duration,
        default="0s",
        unit="duration",
        help="after acting on a target, do not act on it again for this long",
    ),
    ParamSpec(
        "limit",
        _as_is,
        unit="{max, per}",
        help="rate limit: at most max firings per duration, e.g. {max: 3, per: 1h}",
    ),
    ParamSpec(
        "dry_run",
        _parse_bool,
        default=False,
        unit="bool",
        help="decide and log, but change nothing",
    ),
)
"""The keys of a policy, for validation and the reference docs."""
_POLICY_KEYS: Final = tuple(spec.name for spec in POLICY_KEYS)
_LIMIT_KEYS: Final = ("max", "per")
_NEEDS_CRASH: Final = ("restart_worker", "restart_study")


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
        """JSON-able form: ``{"action", "params", "source"}``."""
        return {"action": self.action, "params": dict(self.params), "source": self.source}


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


def _fail(container: LocatedDict | LocatedList, where: str | int | None, message: str) -> NoReturn:
    fail_at(container, where, message, error=PolicyError)


def _param_failer(params: object, parent: LocatedDict, parent_key: str) -> Fail:
    def fail(key: str | None, message: str) -> NoReturn:
        if key is not None and isinstance(params, LocatedDict):
            _fail(params, key, message)
        _fail(parent, parent_key, message)

    return fail


def _params_mapping(raw: object, parent: LocatedDict, key: str, what: str) -> LocatedDict | None:
    if raw is None or isinstance(raw, LocatedDict):
        return raw
    _fail(parent, key, f"params of {what} must be a mapping such as {{key: value}}, got {raw!r}")


def _where(container: LocatedDict, key: str) -> str:
    return f"{container.path}:{container.key_line(key)}"


def _parse_conditions(policy: LocatedDict) -> tuple[Condition, ...]:
    when = policy["when"]
    if not isinstance(when, LocatedDict) or not when:
        _fail(policy, "when", "'when' must be a non-empty mapping of detector -> params")
    out = []
    for detector, raw in when.items():
        cls = DETECTORS.get(detector)
        if cls is None:
            known = ", ".join(sorted(DETECTORS))
            _fail(when, detector, f"unknown detector {detector!r} (known: {known})")
        params = _params_mapping(raw, when, detector, f"detector {detector!r}")
        parsed = cls.parse_params(params, _param_failer(params, when, detector))
        out.append(Condition(detector, MappingProxyType(parsed), _where(when, detector)))
    return tuple(out)


def _parse_actions(policy: LocatedDict) -> tuple[Action, ...]:
    do = policy["do"]
    if not isinstance(do, LocatedList) or not do:
        _fail(policy, "do", "'do' must be a non-empty list of actions, e.g. - log: {}")
    out = []
    for index, item in enumerate(do):
        if isinstance(item, str):  # "- log" is short for "- log: {}"
            holder = LocatedDict(do.path, do.item_line(index))
            holder[item] = None
            item = holder
        if not isinstance(item, LocatedDict) or len(item) != 1:
            _fail(do, index, "each action must be a single-key mapping such as - log: {...}")
        ((name, raw),) = item.items()
        spec = ACTIONS.get(name)
        if spec is None:
            known = ", ".join(sorted(ACTIONS))
            _fail(item, name, f"unknown action {name!r} (known: {known})")
        params = _params_mapping(raw, item, name, f"action {name!r}")
        fail = _param_failer(params, item, name)
        parsed = parse_params(spec.params, spec.groups, params, fail, what=f"action {name!r}")
        if spec.check is not None:
            spec.check(parsed, fail)
        out.append(Action(name, MappingProxyType(parsed), _where(item, name)))
    return tuple(out)


def _parse_policy(item: object, items: LocatedList, index: int) -> Policy:
    if not isinstance(item, LocatedDict):
        _fail(items, index, "each policy must be a mapping with name, when and do")
    for key in item:
        if key not in _POLICY_KEYS:
            _fail(item, key, f"unknown key {key!r} in a policy (known: {', '.join(_POLICY_KEYS)})")
    for key in ("name", "when", "do"):
        if key not in item:
            _fail(item, None, f"policy needs {key!r}")
    name = item["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        _fail(item, "name", f"policy name must be letters, digits, '-', '_' or '.', got {name!r}")
    description = item.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        _fail(item, "description", f"description must be a string, got {description!r}")
    cooldown_s = 0.0
    if item.get("cooldown") is not None:
        try:
            cooldown_s = parse_duration(item["cooldown"])
        except ValueError as exc:
            _fail(item, "cooldown", f"cooldown: {exc}")
    dry_run = item.get("dry_run", False)
    if not isinstance(dry_run, bool):
        _fail(item, "dry_run", f"dry_run must be true or false, got {dry_run!r}")
    conditions = _parse_conditions(item)
    actions = _parse_actions(item)
    scope = derive_scope([c.detector for c in conditions])
    if item.get("scope") is not None:
        try:
            scope = _parse_scope(item["scope"])
        except ValueError as exc:
            _fail(item, "scope", f"scope: {exc}")
    _check_actions(item, conditions, actions, scope)
    return Policy(
        name=name,
        description=description,
        conditions=conditions,
        actions=actions,
        cooldown_s=cooldown_s,
        dry_run=dry_run,
        source=f"{items.path}:{items.item_line(index)}",
        scope=scope,
        limit=_parse_limit(item),
    )


def _parse_limit(policy: LocatedDict) -> RateLimit | None:
    raw = policy.get("limit")
    if raw is None:
        return None
    if not isinstance(raw, LocatedDict):
        _fail(policy, "limit", f"limit must be a mapping such as {{max: 3, per: 1h}}, got {raw!r}")
    for key in raw:
        if key not in _LIMIT_KEYS:
            _fail(raw, key, f"unknown key {key!r} in limit (known: max, per)")
    for key in _LIMIT_KEYS:
        if key not in raw:
            _fail(raw, None, f"limit needs {key!r}, e.g. {{max: 3, per: 1h}}")
    try:
        most = _parse_positive_int(raw["max"])
    except ValueError as exc:
        _fail(raw, "max", f"max: {exc}")
    try:
        per_s = _parse_positive_duration(raw["per"])
    except ValueError as exc:
        _fail(raw, "per", f"per: {exc}")
    return RateLimit(most, per_s)


def _check_actions(
    item: LocatedDict, conditions: Sequence[Condition], actions: Sequence[Action], scope: str
) -> None:
    detectors = {c.detector for c in conditions}
    do = item["do"]
    for index, action in enumerate(actions):
        if action.action in _NEEDS_CRASH and "job_crashed" not in detectors:
            _fail(
                do,
                index,
                f"{action.action} needs a job_crashed condition in 'when' "
                "(it acts on the crashed worker)",
            )
        if action.action == "place_on_idle_gpu" and scope != "gpu":
            _fail(
                do,
                index,
                f"place_on_idle_gpu needs scope gpu (the policy's scope is {scope}); "
                "use a GPU condition such as idle_gpu",
            )


def parse_policies(text: str, path: str) -> PolicySet:
    """Validate the policy file ``text`` (``path`` names it in messages and ``sources``).

    Returns a :class:`PolicySet` with ``sources == (path,)``. Raises
    :class:`~gpuwatchd.errors.PolicyError` ``"<path>:<line>: <message>"`` on the first
    problem (see the module doc). Pure: reads nothing.
    """
    doc = load_located(text, path, error=PolicyError)
    if doc is None:
        raise PolicyError("empty policy file; expected 'policies:' with a list", path=path, line=1)
    if not isinstance(doc, LocatedDict):
        raise PolicyError("a policy file must be a mapping with 'policies:'", path=path, line=1)
    for key in doc:
        if key not in _TOP_KEYS:
            _fail(doc, key, f"unknown top-level key {key!r} (known: {', '.join(_TOP_KEYS)})")
    if "policies" not in doc:
        _fail(doc, None, "missing 'policies:' list")
    items = doc["policies"]
    if items is None:
        items = LocatedList(path, doc.key_line("policies"))
    if not isinstance(items, LocatedList):
        _fail(doc, "policies", "'policies' must be a list of policies")
    policies: list[Policy] = []
    first_seen: dict[str, str] = {}
    for index, item in enumerate(items):
        policy = _parse_policy(item, items, index)
        if policy.name in first_seen:
            _fail(
                item,
                "name",
                f"duplicate policy name {policy.name!r} "
                f"(first defined at {first_seen[policy.name]})",
            )
        first_seen[policy.name] = policy.source
        policies.append(policy)
    return PolicySet(tuple(policies), (path,))


def merge_policy_sets(sets: Sequence[PolicySet]) -> PolicySet:
    """Join policy sets parsed from several files, in order, into one.

    Names must be unique across all of them: a repeated name raises
    :class:`~gpuwatchd.errors.PolicyError` at the second definition (file and line).
    """
    policies: list[Policy] = []
    sources: list[str] = []
    first_seen: dict[str, str] = {}
    for loaded in sets:
        for policy in loaded.policies:
            if policy.name in first_seen:
                path, _, line = policy.source.rpartition(":")
                raise PolicyError(
                    f"duplicate policy name {policy.name!r} "
                    f"(first defined at {first_seen[policy.name]})",
                    path=path,
                    line=int(line),
                )
            first_seen[policy.name] = policy.source
            policies.append(policy)
        sources.extend(loaded.sources)
    return PolicySet(tuple(policies), tuple(sources))
