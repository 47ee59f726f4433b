"""Typed exceptions of gpuwatchd, all in one place.

Every error the project raises on purpose derives from :class:`GpuwatchError`, so
callers can catch the family with one ``except``. Subclasses say *what* failed;
their messages say *where* (file and line, device index, job name).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ControlError",
    "GpuwatchError",
    "NvmlUnavailable",
    "PolicyError",
    "ProtocolError",
    "ReplayError",
    "UnitError",
]


class GpuwatchError(Exception):
    """Base class of every error gpuwatchd raises on purpose."""


class UnitError(GpuwatchError, ValueError):
    """A value with a unit (``30s``, ``20GiB``, ``90%``) could not be parsed."""


class ConfigError(GpuwatchError):
    """The daemon's configuration file is invalid.

    ``path`` and ``line`` (1-based) locate the problem when known; ``str()`` gives
    ``path:line: message`` so operators can jump to it.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        self.message = message
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(f"{where}{message}")


class PolicyError(ConfigError):
    """A policy file is invalid: unknown key, bad unit, unknown detector or action."""


class ReplayError(GpuwatchError):
    """A trace file (nvidia-smi ``--format=csv`` log) could not be parsed."""


class NvmlUnavailable(GpuwatchError):
    """NVML could not be initialised (no driver, no library, driver/library mismatch).

    The daemon catches this and runs host-only; ``reason`` is the one-line text
    shown by ``gpuwatchctl status``.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class ProtocolError(GpuwatchError):
    """A control-protocol message is malformed or not allowed.

    ``code`` is one of the stable codes of :class:`gpuwatchd.control.protocol.ErrorCode`
    and travels to the peer in the error reply.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class ControlError(GpuwatchError):
    """The client side of the control socket failed: no daemon, or an error reply.

    ``code`` is the protocol error code from the daemon's reply, or
    ``"unavailable"`` when no daemon answered.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class KnobError(GpuwatchError, ValueError):
    """A job knob is declared or changed badly: unknown name, wrong type, or out of bounds.

    Raised by :func:`gpuwatchd.hook.attach` for a bad ``knobs=`` declaration; a bad
    ``set_knob`` from the daemon is answered with a ``bad_request`` reply carrying this
    message instead. ``knob`` names the knob when known.
    """

    def __init__(self, message: str, *, knob: str | None = None) -> None:
        self.knob = knob
        self.message = message
        super().__init__(message)


__all__ += ["KnobError"]


class JournalError(GpuwatchError):
    """The action journal (SQLite in the state directory) cannot be opened or written.

    Raised for a file that cannot be opened (permissions, missing directory, a lock),
    one written by a newer schema, or a failed write (disk full, I/O error). A *corrupt*
    journal is not an error: it is moved aside and a new one is started.
    """


__all__ += ["JournalError"]


class StudyError(GpuwatchError):
    """An Optuna storage or study cannot be used: a bad or unreachable storage URL (the
    password hidden), a missing SQLite or journal file, a missing database driver (or
    ``redis`` package), or no such study.

    Raised by :mod:`gpuwatchd.jobs.study`; ``gpuwatchctl study`` prints it and exits 1.
    """


__all__ += ["StudyError"]


class SupervisorError(GpuwatchError):
    """A managed-job request cannot be done: unknown job or worker, a bad value, a job that
    cannot be started (``user:`` without root, an unusable name), or a conflicting state.

    ``code`` is the control-protocol error code a server should answer with
    (``not_found``, ``bad_request``, ``conflict``, ``forbidden``).
    """

    def __init__(self, message: str, *, code: str = "bad_request") -> None:
        self.code = code
        self.message = message
        super().__init__(message)


__all__ += ["SupervisorError"]


class ActionRefused(GpuwatchError):
    """An actuator will not carry out a decision in the present state; the decision's
    outcome is ``refused`` with this message as its detail (e.g. a worker whose restart
    budget is spent is not relaunched by a policy: the budget exists to stop crash loops).
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


__all__ += ["ActionRefused"]
