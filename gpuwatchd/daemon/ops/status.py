"""``status``: the daemon's state in one stable JSON object.

Request: ``{"op": "status"}``, optional ``full`` (bool, default false: each policy of
``policies.policies[]`` as ``{"name"}`` alone; true: its whole definition) and ``brief``
(bool, default false; true: each job with what ``gpuwatchctl status`` and ``top`` show,
:func:`brief_job`, and the last :data:`BRIEF_DECISIONS` decisions: the tables' reply;
a job with three knobs takes 556 bytes instead of 805, so 64 such jobs, the findings and
the decisions shown fit the line, where the whole reply leaves out jobs, then every
decision). Other params are ignored.

Reply: the object ``gpuwatchctl status --json`` prints (docs/cli.md, "gpuwatchctl status
--json"): ``version``, ``pid``, ``uptime_s``, ``ticks``, ``gpus``, ``host``, ``jobs``,
``managed``, ``policies``, ``paused``, ``findings``, ``decisions``, ``xid_events``,
``journal``, ... and ``truncated``: how many entries of each of :data:`TRUNCATED_PARTS`
were left out to keep the reply under
:data:`~gpuwatchd.control.protocol.REPLY_BUDGET_BYTES` (one protocol line). The trimming
is :func:`fit_members`'s alone: the daemon's
:class:`gpuwatchd.daemon.statusview.StatusView` calls it with its kept texts, :func:`fit`
with an object built whole (``Daemon.status()``, the tests' fake daemon).

Errors: ``bad_request`` for a ``full`` or ``brief`` that is not a boolean, or both true.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import (
    REPLY_BUDGET_BYTES,
    EncodedResult,
    ErrorCode,
    Op,
    json_text,
)
from gpuwatchd.errors import ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = [
    "BRIEF_DECISIONS",
    "NAMES",
    "TRUNCATED_PARTS",
    "brief_job",
    "brief_process",
    "brief_status",
    "execute",
    "fit",
    "fit_members",
]

NAMES: Final = (Op.STATUS,)

TRUNCATED_PARTS: Final = (
    "decisions",
    "findings",
    "jobs",
    "policies",
    "holds",
    "cordons",
    "managed",
)
"""The ``truncated`` counts of a ``status`` reply, in the order its parts are cut
(``policies``: definitions left out of a ``full`` reply, the names kept)."""

_OLDEST_FIRST: Final = frozenset({"decisions", "findings"})
"""Parts cut from their start (history: the newest stay); the others from their end."""

BRIEF_DECISIONS: Final = 10
"""The decisions of a ``brief`` reply: the latest, as many as ``gpuwatchctl status``'s
table shows (``top`` shows five)."""

_BRIEF_JOB: Final = (
    "name",
    "pid",
    "cuda_devices",
    "knobs",
    "study",
    "trial_number",
    "last_report",
    "slurm",
    "process",
)
_BRIEF_REPORT: Final = ("step_time_s", "data_wait_fraction", "samples_per_s")
_BRIEF_PROCESS: Final = ("cpu_pct", "rss_bytes", "num_worker_children")
_BRIEF_KNOB: Final = ("value", "min", "max", "source", "applied_at_s")


def _pick(value: Any, keys: Sequence[str]) -> Any:
    return {k: value[k] for k in keys if k in value} if isinstance(value, Mapping) else value


def brief_job(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``status`` job entry (docs/cli.md, ``jobs[]``) as a ``brief`` reply carries it:
    ``name``, ``pid``, ``cuda_devices``, ``study``, ``trial_number``, ``slurm`` as they
    are; ``knobs`` with each knob's ``value``, ``min``, ``max``, ``source``,
    ``applied_at_s``; ``last_report`` with ``step_time_s``, ``data_wait_fraction``,
    ``samples_per_s``; ``process`` with ``cpu_pct``, ``rss_bytes``,
    ``num_worker_children``: what ``gpuwatchctl status`` and ``top`` show. Keys
    ``entry`` lacks stay out; a null ``last_report``/``process`` stays null."""
    out: dict[str, Any] = _pick(entry, _BRIEF_JOB)
    knobs = out.get("knobs")
    if isinstance(knobs, Mapping):
        out["knobs"] = {name: _pick(knob, _BRIEF_KNOB) for name, knob in knobs.items()}
    if "last_report" in out:
        out["last_report"] = _pick(out["last_report"], _BRIEF_REPORT)
    if "process" in out:
        out["process"] = brief_process(out["process"])
    return out


def brief_process(process: Mapping[str, Any] | None) -> Any:
    """A job's ``process`` member as a ``brief`` reply carries it: ``cpu_pct``,
    ``rss_bytes``, ``num_worker_children`` (null stays null)."""
    return _pick(process, _BRIEF_PROCESS)


def brief_status(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` (the object built whole) as a ``brief`` reply carries it: each job by
    :func:`brief_job`, the last :data:`BRIEF_DECISIONS` decisions; a new dict (the
    rest shared)."""
    out = dict(status)
    if isinstance(status.get("jobs"), list):
        out["jobs"] = [
            brief_job(job) if isinstance(job, Mapping) else job for job in status["jobs"]
        ]
    if isinstance(status.get("decisions"), list):
        out["decisions"] = status["decisions"][-BRIEF_DECISIONS:]
    return out


Member = tuple[str | None, str | list[str]]
"""One piece of the reply object: ``(key, JSON text of its value)``, ``(key, [JSON text of
each item])`` for a list part of :data:`TRUNCATED_PARTS`, or ``(None, text)`` for
members already joined (``"a":1,"b":2``, no braces)."""


@functools.lru_cache(maxsize=64)
def _member_head(key: str) -> str:
    """``"key":``, the member's name as JSON text (the reply's few names, kept)."""
    return json_text(key) + ":"


_NOTHING_TRUNCATED: Final = '"truncated":{' + ",".join(f'"{n}":0' for n in TRUNCATED_PARTS) + "}"
"""The ``truncated`` member of a reply that left nothing out."""


def fit_members(
    members: Sequence[Member],
    budget_bytes: int = REPLY_BUDGET_BYTES,
    *,
    policy_names: tuple[str, int] | None = None,
) -> tuple[str, dict[str, int]]:
    """The ``status`` object's JSON text from ``members`` (:data:`Member`, in order), with
    ``"truncated"`` last, cut to at most ``budget_bytes`` characters (ASCII: bytes).

    Cuts the oldest decisions, then the oldest findings, then the last attached jobs,
    then the policies' definitions (``policy_names``: the ``policies`` member's text with
    names only, and how many definitions that leaves out), then the last knob holds, GPU
    cordons and managed jobs, until the text fits or nothing of them is left. The item
    lists of ``members`` lose the entries cut (the caller's lists: pass copies).
    Returns ``(text, truncated)``: ``truncated`` counts each of :data:`TRUNCATED_PARTS`.
    """
    values: dict[str | None, str | list[str]] = {}
    order: list[str | None] = []
    fragments: list[str] = []
    for key, value in members:
        if key is None:
            fragments.append(value if isinstance(value, str) else ",".join(value))
            order.append(None)
        else:
            values[key] = value
            order.append(key)
    truncated = dict.fromkeys(TRUNCATED_PARTS, 0)

    def text() -> str:
        out = []
        raw = iter(fragments)
        for key in order:
            if key is None:
                out.append(next(raw))
                continue
            value = values[key]
            head = _member_head(key)
            out.append(head + (value if isinstance(value, str) else f"[{','.join(value)}]"))
        cut = any(truncated.values())
        out.append(_NOTHING_TRUNCATED if not cut else '"truncated":' + json_text(truncated))
        return "{" + ",".join(out) + "}"

    out = text()
    for name in TRUNCATED_PARTS:
        if len(out) <= budget_bytes:
            break
        if name == "policies":
            if policy_names is not None and "policies" in values:
                values["policies"], truncated["policies"] = policy_names
                out = text()
            continue
        items = values.get(name)
        if not isinstance(items, list):
            continue
        at = 0 if name in _OLDEST_FIRST else -1
        excess = len(out) - budget_bytes
        while excess > 0 and items:  # by sizes first: one text per part, not per entry
            excess -= len(items.pop(at)) + 1
            truncated[name] += 1
        out = text()  # the counts' digits may have grown it: check again
        while len(out) > budget_bytes and items:
            items.pop(at)
            truncated[name] += 1
            out = text()
    return out, truncated


def fit(status: dict[str, Any], budget_bytes: int = REPLY_BUDGET_BYTES) -> dict[str, Any]:
    """``status`` (the object built whole) fitted to ``budget_bytes`` by :func:`fit_members`.

    Adds ``truncated`` and removes the entries cut from ``status``'s lists (the
    ``policies`` definitions become ``{"name"}`` when cut); changes ``status`` and returns
    it as an :class:`~gpuwatchd.control.protocol.EncodedResult` carrying its text, so the
    reply is encoded only once. A value JSON cannot carry leaves ``status`` whole (the
    server's encode reports it).
    """
    lists = {
        key: value
        for key, value in status.items()
        if key in TRUNCATED_PARTS and key != "policies" and isinstance(value, list)
    }
    policies = status.get("policies")
    short: dict[str, Any] | None = None
    if isinstance(policies, Mapping) and isinstance(policies.get("policies"), list):
        names = [{"name": p.get("name")} for p in policies["policies"] if isinstance(p, Mapping)]
        if names != policies["policies"]:
            short = {**policies, "policies": names}
    try:
        members: list[Member] = [
            (key, [json_text(item) for item in lists[key]] if key in lists else json_text(value))
            for key, value in status.items()
            if key != "truncated"
        ]
        policy_names = None if short is None else (json_text(short), len(short["policies"]))
    except ProtocolError:
        status["truncated"] = dict.fromkeys(TRUNCATED_PARTS, 0)
        return status
    text, truncated = fit_members(members, budget_bytes, policy_names=policy_names)
    for key, items in lists.items():
        cut = truncated[key]
        if cut and key in _OLDEST_FIRST:
            del items[:cut]
        elif cut:
            del items[len(items) - cut :]
    if truncated["policies"] and short is not None:
        status["policies"] = short
    status.pop("truncated", None)
    status["truncated"] = truncated
    out = EncodedResult(status)
    out.json_text = text
    return out


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> Any:
    """Answer ``status`` (module docstring)."""
    full, brief = params.get("full", False), params.get("brief", False)
    for name, value in (("full", full), ("brief", brief)):
        if not isinstance(value, bool):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name!r} must be true or false")
    if full and brief:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'full' and 'brief' exclude each other")
    return target.status_reply(full=full, brief=brief)
