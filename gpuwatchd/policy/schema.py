"""Policy files: strict validation into immutable :class:`PolicySet` values.

Specification: docs/modules.md#gpuwatchdpolicyschema
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import MappingProxyType
from typing import Final, NoReturn

from gpuwatchd.detectors import DETECTORS, Fail, ParamSpec, parse_params
from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.actions import ACTIONS, LADDER_MODES, LOG_LEVELS, ActionSpec
from gpuwatchd.policy.actions.params import (
    parse_bool,
    parse_positive_duration,
    parse_positive_int,
    parse_text,
)
from gpuwatchd.policy.policies import (
    Action,
    Condition,
    Policy,
    PolicySet,
    RateLimit,
    derive_scope,
)
from gpuwatchd.units import parse_duration
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

SCOPES: Final = ("gpu", "job", "global")
"""Policy scopes: conditions judged per GPU, per job, or all together."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS: Final = ("policies",)


def _parse_scope(value: object) -> str:
    if value not in SCOPES:
        raise ValueError(f"expected one of {', '.join(SCOPES)}, got {value!r}")
    return str(value)


def _as_is(value: object) -> object:
    """Structured keys (``when``, ``do``, ``limit``) are parsed by the policy parser itself."""
    return value


POLICY_KEYS: Final[tuple[ParamSpec, ...]] = (
    ParamSpec("name", parse_text, required=True, unit="name", help="unique across all files"),
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
        parse_bool,
        default=False,
        unit="bool",
        help="decide and log, but change nothing",
    ),
)
"""The keys of a policy, for validation and the reference docs."""
_POLICY_KEYS: Final = tuple(spec.name for spec in POLICY_KEYS)
_LIMIT_KEYS: Final = ("max", "per")
_SCOPE_HINTS: Final = {"gpu": "use a GPU condition such as idle_gpu"}


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
        most = parse_positive_int(raw["max"])
    except ValueError as exc:
        _fail(raw, "max", f"max: {exc}")
    try:
        per_s = parse_positive_duration(raw["per"])
    except ValueError as exc:
        _fail(raw, "per", f"per: {exc}")
    return RateLimit(most, per_s)


def _check_actions(
    item: LocatedDict, conditions: Sequence[Condition], actions: Sequence[Action], scope: str
) -> None:
    detectors = {c.detector for c in conditions}
    do = item["do"]
    for index, action in enumerate(actions):
        spec = ACTIONS[action.action]
        needed = spec.needs_detector
        if needed is not None and needed not in detectors:
            why = f" ({spec.because})" if spec.because else ""
            _fail(do, index, f"{action.action} needs a {needed} condition in 'when'{why}")
        if spec.needs_scope is not None and scope != spec.needs_scope:
            hint = _SCOPE_HINTS.get(spec.needs_scope, "")
            _fail(
                do,
                index,
                f"{action.action} needs scope {spec.needs_scope} (the policy's scope is "
                f"{scope})" + (f"; {hint}" if hint else ""),
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
