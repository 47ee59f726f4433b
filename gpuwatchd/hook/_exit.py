"""A managed worker's last word: the exit line written from the process's exit path.

Secondary evidence: a daemon reads a worker's end from its launcher shim's exit file and
reads this line only for a launch without one (docs/managed-jobs.md, "How a worker's end
is known": CPython gives ``atexit`` no status). The hook, in a worker the daemon
launched, registers an :mod:`atexit` handler on the first ``attach`` that writes
:func:`gpuwatchd.control.protocol.worker_exit_line` to fd 2 (the launch's stderr file or
journal stream) when no exception went uncaught and no ``sys.exit``, ``exit()`` or
``quit()`` asked for a non-zero status (they are wrapped to note it) and the last
``attach`` block did not end with an exception (a ``raise SystemExit(N)`` outside any
block is not seen). Nothing runs at import time; ``os._exit``, ``abort()`` and signals
leave no line.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import sys
import threading
from typing import Any

from gpuwatchd.control.protocol import WORKER_ID_ENV, worker_exit_line

__all__ = ["note_block_end", "register_exit_line"]

_lock = threading.Lock()
_registered_pid: int | None = None
_exit_status: list[object] = []
"""The argument of the last ``sys.exit`` call in this process (empty: none)."""
_block_error: list[BaseException] = []
"""The exception that left the last ``attach`` block (empty: it ended cleanly)."""


def note_block_end(exc: BaseException | None) -> None:
    """Note how an ``attach`` block ended: an exception leaving it (a ``raise
    SystemExit(3)``, an error the process dies of) means no exit line unless a later
    block ends cleanly (the error was caught and the work went on)."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        _block_error.clear()
    else:
        _block_error[:] = [exc]


def register_exit_line() -> bool:
    """Register the exit-line handler once per process; True when registered by this call.

    Only in a worker the daemon launched (``$GPUWATCHD_WORKER_ID`` set). A forked child
    (a DataLoader worker) inherits the handler but never writes: the pid must match.
    """
    global _registered_pid
    worker_id = os.environ.get(WORKER_ID_ENV)
    if not worker_id:
        return False
    pid = os.getpid()
    with _lock:
        if _registered_pid == pid:
            return False
        _registered_pid = pid
    sys.exit = _noting(sys.exit)
    for name in ("exit", "quit"):  # the site module's exit()/quit() in scripts
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, _noting(getattr(builtins, name)))
    atexit.register(_write_exit_line, pid, worker_id)
    return True


def _noting(original: Any) -> Any:
    """``original`` (an exit function) that first notes its status argument."""

    def noting_exit(status: object = None) -> Any:
        _exit_status[:] = [status]
        return original(status)

    return noting_exit


def _write_exit_line(pid: int, worker_id: str) -> None:
    """At exit: the line, unless an exception went uncaught (CPython then sets
    ``sys.last_value``/``sys.last_exc`` before running the ``atexit`` handlers)."""
    if os.getpid() != pid or os.environ.get(WORKER_ID_ENV) != worker_id:
        return  # a forked child, or the variable was taken away (a test's monkeypatch)
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    if _exit_status and _exit_status[-1] not in (None, 0):
        return  # sys.exit(3), sys.exit("message"): not status 0
    if _block_error:
        return  # the last attach block ended with an exception
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, worker_exit_line(worker_id, pid).encode("utf-8"))
