"""The ``do:`` vocabulary of policies: every action, its params and their checks (pure).

Specification: docs/modules.md#gpuwatchdpolicyschema; reference: docs/policy-reference.md
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from gpuwatchd.detectors import ExclusiveGroup, Fail, ParamSpec
from gpuwatchd.units import parse_duration

LOG_LEVELS: Final = ("info", "warning", "error")
"""Levels of the ``log`` action (structlog/stdlib level names)."""

LADDER_MODES: Final = ("drain", "now")
"""How ``lower_parallelism`` removes a worker: ``drain`` (finish its trial, then exit) or
``now`` (stop it at once; its trial is failed and re-enqueued)."""


def parse_text(value: object) -> str:
    """A non-empty string parameter.

    Raises:
        ValueError: not a string, or only whitespace."""
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


def parse_positive_int(value: object) -> int:
    """An integer parameter >= 1 (booleans refused).

    Raises:
        ValueError: anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def _parse_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return value


def _parse_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _parse_mode(value: object) -> str:
    if value not in LADDER_MODES:
        raise ValueError(f"expected one of {', '.join(LADDER_MODES)}, got {value!r}")
    return str(value)


def parse_positive_duration(value: object) -> float:
    """A duration parameter (``30s``, ``5m`` or seconds) in seconds, > 0.

    Raises:
        ValueError: unparsable, zero or negative."""
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


TUNE_DIRECTIONS: Final = ("auto", "up", "down")
"""``tune_loader``'s first move: ``auto`` is down when the host CPU is saturated, else up."""


def _parse_direction(value: object) -> str:
    if value not in TUNE_DIRECTIONS:
        raise ValueError(f"expected one of {', '.join(TUNE_DIRECTIONS)}, got {value!r}")
    return str(value)


def _parse_growth(value: object) -> float:
    number = _parse_number(value)
    if number <= 1:
        raise ValueError(f"factor must be > 1 (the tuner moves both ways), got {value!r}")
    return float(number)


def _parse_fraction(value: object) -> float:
    number = _parse_number(value)
    if not 0 <= number < 1:
        raise ValueError(f"expected a fraction 0 <= x < 1 (0.05 is 5 %), got {value!r}")
    return float(number)


def _parse_knob_names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a knob name or a list of them, got {value!r}")
    return tuple(parse_text(item) for item in value)


NOTIFY_MAX_URLS: Final = 16
"""URLs one ``notify`` action may name at most."""
NOTIFY_MAX_URL_CHARS: Final = 2048
"""Characters of one ``notify`` URL at most (a URL longer than most servers take)."""
_URL: Final = re.compile(r"[a-z][a-z0-9+.-]{0,31}://\S+")


def _parse_urls(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or len(value) > NOTIFY_MAX_URLS:
        raise ValueError(f"expected a list of 1 to {NOTIFY_MAX_URLS} apprise URLs, got {value!r}")
    for item in value:
        if not isinstance(item, str) or len(item) > NOTIFY_MAX_URL_CHARS:
            raise ValueError(f"every URL must be a string of at most {NOTIFY_MAX_URL_CHARS} chars")
        if not _URL.fullmatch(item):
            scheme = item.split("://", 1)[0] if "://" in item else item[:20]
            raise ValueError(
                f"not an apprise URL such as json://host/path or slack://...: {scheme!r}..."
            )
    return tuple(value)


def public_params(action: str, params: Mapping[str, object]) -> dict[str, object]:
    """``params`` as logs, the journal and ``status`` show them: a ``notify`` action's
    URLs (which hold webhook tokens and passwords) cut to their scheme (``slack://…``)."""
    shown = dict(params)
    urls = shown.get("urls")
    if action == "notify" and isinstance(urls, (list, tuple)):
        shown["urls"] = [str(u).split("://", 1)[0] + "://…" for u in urls]
    return shown


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
    return ParamSpec("job", parse_text, unit="name", help=default_help)


_STEP = ParamSpec(
    "step", parse_positive_int, default=1, unit="workers", help="workers per move (>= 1)"
)

ACTIONS: Final[Mapping[str, ActionSpec]] = MappingProxyType(
    {
        "log": ActionSpec(
            "log",
            "write a log event (journald) with the policy's findings",
            (
                ParamSpec(
                    "message",
                    parse_text,
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
                    parse_text,
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
                    parse_text,
                    unit="name",
                    help="only this job (default: the jobs the findings name, else the jobs "
                    "on the findings' GPUs, else every attached job with the knob)",
                ),
            ),
            groups=(ExclusiveGroup(("value", "factor", "step"), required=True),),
            check=_check_set_knob,
        ),
        "tune_loader": ActionSpec(
            "tune_loader",
            "tune a DataLoader knob of the jobs concerned in closed loop: move it, measure "
            "the job's samples/s, keep the better setting, hold on a plateau "
            "(docs/tuning.md)",
            (
                ParamSpec(
                    "knob",
                    parse_text,
                    default="num_workers",
                    unit="name",
                    help="int knob as the job declared it (num_workers, prefetch_factor)",
                ),
                ParamSpec(
                    "min", _parse_count, unit="count", help="never below (and the knob's own)"
                ),
                ParamSpec(
                    "max",
                    _parse_count,
                    unit="count",
                    help="never above (and the knob's own; num_workers also never above the "
                    "host's logical CPUs divided by the jobs tuned on it)",
                ),
                ParamSpec(
                    "factor",
                    _parse_growth,
                    unit="number > 1",
                    help="step rule: multiply (up) or divide (down), moving >= 1 (default 2)",
                ),
                ParamSpec(
                    "step", parse_positive_int, unit="count", help="step rule: add or subtract"
                ),
                ParamSpec(
                    "settle_epochs",
                    _parse_count,
                    default=1,
                    unit="epochs",
                    help="epochs skipped after a change is applied, before measuring",
                ),
                ParamSpec(
                    "measure",
                    parse_positive_duration,
                    default="5s",
                    unit="duration",
                    help="throughput measured per setting (at least one epoch boundary)",
                ),
                ParamSpec(
                    "noise",
                    _parse_fraction,
                    default=0.05,
                    unit="fraction",
                    help="noise margin: a gain below it is a plateau (hold)",
                ),
                ParamSpec(
                    "direction",
                    _parse_direction,
                    default="auto",
                    unit="auto|up|down",
                    help="first move; auto: down when the host CPU is saturated, else up",
                ),
                ParamSpec(
                    "then",
                    _parse_knob_names,
                    unit="name|list",
                    help="knobs tuned next, each once the previous one holds (e.g. "
                    "prefetch_factor after num_workers; upwards, within the knob's bounds)",
                ),
                _job_param(
                    "only this job (default: the jobs the findings name, else the jobs on the "
                    "findings' GPUs, else every attached job with the knob)"
                ),
            ),
            groups=(ExclusiveGroup(("factor", "step")),),
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
                    parse_positive_int,
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
                    parse_positive_int,
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
        "cordon_gpu": ActionSpec(
            "cordon_gpu",
            "cordon the GPU (scope gpu): no managed worker is placed on it; those on it are "
            "relaunched on other GPUs and their trials retried; kept across restarts",
            (
                ParamSpec(
                    "relaunch",
                    _parse_bool,
                    default=True,
                    unit="bool",
                    help="move the managed workers on the GPU now (false: only keep new "
                    "ones off it)",
                ),
            ),
        ),
        "uncordon_gpu": ActionSpec(
            "uncordon_gpu",
            "lift the GPU's cordon if a policy set it (scope gpu; an operator's cordon "
            "stays until gpuwatchctl gpu uncordon)",
            (),
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
        "notify": ActionSpec(
            "notify",
            "send a notification through apprise (Slack, PagerDuty, e-mail, JSON webhook "
            "URLs), off the tick, under the policy's cooldown and limits",
            (
                ParamSpec(
                    "urls",
                    _parse_urls,
                    required=True,
                    unit="list",
                    help="apprise URLs, e.g. json://host:port/path, slack://T/B/C, "
                    "pagerduty://KEY@RKEY, mailtos://user:pw@host (at most 16; shown as "
                    "scheme://… in logs, journal and status)",
                ),
                ParamSpec(
                    "title",
                    parse_text,
                    unit="text",
                    help="title (default: gpuwatchd POLICY on HOSTNAME)",
                ),
                ParamSpec(
                    "message",
                    parse_text,
                    unit="text",
                    help="body (default: the findings' messages)",
                ),
                ParamSpec(
                    "timeout",
                    parse_positive_duration,
                    default="10s",
                    unit="duration",
                    help="give up on the sending after this long (outcome failed)",
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
                    parse_positive_duration,
                    default="30s",
                    unit="duration",
                    help="kill the command after this long",
                ),
            ),
        ),
    }
)
"""Every action a policy's ``do:`` may name, by name."""
