"""Parsers of policy action params, shared by the action modules (pure).

Each ``parse_*`` takes the YAML value and returns the stored one, or raises ValueError
with a one-line reason (the schema locates it). Reference: docs/policy-reference.md
"""

from __future__ import annotations

import re
from typing import Final

from gpuwatchd.units import parse_duration

LOG_LEVELS: Final = ("info", "warning", "error")
"""Levels of the ``log`` action (structlog/stdlib level names)."""

LADDER_MODES: Final = ("drain", "now")
"""How ``lower_parallelism`` removes a worker: ``drain`` (finish its trial, then exit) or
``now`` (stop it at once; its trial is failed and re-enqueued)."""


def parse_text(value: object) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def parse_level(value: object) -> str:
    """One of :data:`LOG_LEVELS`."""
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return str(value)


def parse_number(value: object) -> int | float:
    """A finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


def parse_knob_value(value: object) -> int | float | bool:
    """A knob value: a bool or a finite number."""
    if isinstance(value, bool):
        return value
    return parse_number(value)


def parse_factor(value: object) -> float:
    """A multiplier > 0, as a float."""
    number = parse_number(value)
    if number <= 0:
        raise ValueError(f"factor must be > 0, got {value!r}")
    return float(number)


def parse_step(value: object) -> int:
    """A non-zero integer (may be negative)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"step must be an integer (may be negative), got {value!r}")
    if value == 0:
        raise ValueError("step 0 changes nothing")
    return value


def parse_positive_int(value: object) -> int:
    """An integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def parse_count(value: object) -> int:
    """An integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return value


def parse_bool(value: object) -> bool:
    """``true`` or ``false``."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def parse_mode(value: object) -> str:
    """One of :data:`LADDER_MODES`."""
    if value not in LADDER_MODES:
        raise ValueError(f"expected one of {', '.join(LADDER_MODES)}, got {value!r}")
    return str(value)


def parse_positive_duration(value: object) -> float:
    """A duration (``30s``, ``5m``) > 0, in seconds."""
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"expected a duration > 0, got {value!r}")
    return seconds


def parse_argv(value: object) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (an argv); a string is refused (no shell)."""
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


def parse_direction(value: object) -> str:
    """One of :data:`TUNE_DIRECTIONS`."""
    if value not in TUNE_DIRECTIONS:
        raise ValueError(f"expected one of {', '.join(TUNE_DIRECTIONS)}, got {value!r}")
    return str(value)


def parse_growth(value: object) -> float:
    """A factor > 1, as a float."""
    number = parse_number(value)
    if number <= 1:
        raise ValueError(f"factor must be > 1 (the tuner moves both ways), got {value!r}")
    return float(number)


def parse_fraction(value: object) -> float:
    """A fraction 0 <= x < 1, as a float."""
    number = parse_number(value)
    if not 0 <= number < 1:
        raise ValueError(f"expected a fraction 0 <= x < 1 (0.05 is 5 %), got {value!r}")
    return float(number)


def parse_knob_names(value: object) -> tuple[str, ...]:
    """A knob name or a list of them, as a tuple."""
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


def parse_urls(value: object) -> tuple[str, ...]:
    """1 to :data:`NOTIFY_MAX_URLS` apprise URLs (``scheme://...``), as a tuple."""
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
