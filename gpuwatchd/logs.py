"""Logging setup: JSON lines for journald and pipes, readable console output on a terminal.

Specification: docs/modules.md#gpuwatchdlogs
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Any, Final

import structlog
from structlog.typing import Processor

from gpuwatchd.errors import ConfigError

__all__ = ["LEVELS", "STABLE_KEYS", "configure_logging", "get_logger", "wants_json"]

#: Keys every JSON line has, then the stable bound keys (see the module docstring).
STABLE_KEYS: Final[tuple[str, ...]] = (
    "event",
    "level",
    "timestamp",
    "logger",
    "gpu",
    "gpu_uuid",
    "job",
    "policy",
    "action",
)

#: Accepted ``level`` names, mapped to :mod:`logging` levels.
LEVELS: Final[dict[str, int]] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

#: Libraries whose INFO lines are per-tick noise (APScheduler logs every job run at INFO);
#: they are held at WARNING unless ``level="debug"``.
_NOISY_LOGGERS: Final[tuple[str, ...]] = ("apscheduler",)

#: Attribute that marks the handler installed by :func:`configure_logging`.
_HANDLER_MARK: Final[str] = "_gpuwatchd_handler"


def wants_json(stream: IO[str], environ: dict[str, str] | None = None) -> bool:
    """Whether automatic mode picks JSON: under systemd or when ``stream`` is not a TTY.

    systemd sets ``$JOURNAL_STREAM`` when stdout/stderr go to the journal and
    ``$INVOCATION_ID`` for every service it runs (systemd.exec(5), "Environment
    variables in spawned processes").
    """
    env = os.environ if environ is None else environ
    if env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"):
        return True
    return not _isatty(stream)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _stable_keys_first(
    _logger: Any, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """Order a JSON line as event, level, timestamp, logger, then the rest, for reading."""
    head = {k: event_dict.pop(k) for k in STABLE_KEYS[:4] if k in event_dict}
    head.update(event_dict)
    return head


def configure_logging(
    *, json: bool | None = None, level: str = "info", stream: IO[str] | None = None
) -> None:
    """Configure structlog and the root :mod:`logging` logger; idempotent.

    ``json``: ``True`` for JSON lines, ``False`` for console text, ``None`` to decide with
    :func:`wants_json`. ``level``: one of :data:`LEVELS` (case-insensitive). ``stream``:
    where lines go, default :data:`sys.stdout` at call time (journald captures stdout
    under systemd). Console output is colored only when ``stream`` is a TTY.

    Calling again replaces the previous configuration (never adds a second handler);
    loggers obtained earlier with :func:`get_logger` follow the new configuration.

    Raises :class:`~gpuwatchd.errors.ConfigError` for an unknown ``level``.
    """
    level_no = LEVELS.get(level.lower())
    if level_no is None:
        raise ConfigError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    out = sys.stdout if stream is None else stream
    use_json = wants_json(out) if json is None else json

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if use_json:
        final += [
            structlog.processors.format_exc_info,
            _stable_keys_first,
            structlog.processors.JSONRenderer(),
        ]
    else:
        final.append(
            structlog.dev.ConsoleRenderer(
                colors=_isatty(out),
                # no locals in tracebacks: they may hold secrets and flood the terminal
                exception_formatter=structlog.dev.plain_traceback,
            )
        )

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # no caching, so that a reconfiguration reaches loggers created earlier
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=final)
    )
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)
    noisy_level = logging.NOTSET if level_no <= logging.DEBUG else max(level_no, logging.WARNING)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(noisy_level)


def get_logger(name: str, **initial_values: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name`` (shown as the ``logger`` key).

    Lazy: safe to call at module level before :func:`configure_logging`; it binds to the
    configuration in force when it logs. ``initial_values`` are bound keys (e.g.
    ``job="digits"``).
    """
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name, **initial_values)
    return logger
