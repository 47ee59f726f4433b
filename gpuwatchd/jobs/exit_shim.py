"""The launcher shim: run as ``python -I <this file>`` between the daemon
and a worker of the subprocess launcher, so that the worker's exit status is known even
to a daemon that was down when the worker ended (as conmon does for containers).

It starts the worker's argv (no shell) with the environment the daemon hands it on a
file descriptor (its own is the daemon's) in a process group of its own, tells the daemon
the worker's pid, forwards the signals it is sent, waits, writes the exit status into
the launch's exit file, and exits with the same status (docs/managed-jobs.md, "How a
worker's end is known"). Standard library only; nothing runs at import.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["ENV_MAX_BYTES", "FORWARDED_SIGNALS", "SHIM_PATH", "exit_record", "main", "shim_argv"]

SHIM_PATH: Final = os.path.abspath(__file__)
"""The script the daemon runs (``python -I <path>``: by path, not ``-m``, so that it
runs wherever gpuwatchd is installed, a user site included, which ``-I`` leaves out of
``sys.path``; it imports the standard library only)."""

ENV_MAX_BYTES: Final = 4 * 2**20
"""The most the worker's environment may take as JSON on ``--env-fd`` (bytes): Linux
itself refuses an ``execve`` whose arguments and environment pass ``ARG_MAX`` (2 MiB
with an 8 MiB stack), so more is not an environment."""

FORWARDED_SIGNALS: Final = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""Signals sent to the shim alone (``kill <shim pid>``) that it passes to the worker's
process group. The daemon signals the worker's group itself, which the shim is not in."""


def shim_argv(
    python: str,
    pid_fd: int,
    status_fd: int,
    env_fd: int,
    command: Sequence[str],
    user: Mapping[str, Any] | None = None,
) -> list[str]:
    """The argv that runs ``command`` under the shim with interpreter ``python``;
    ``pid_fd``: a pipe's write end (the worker's pid, or ``error <text>``, one line);
    ``status_fd``: the launch's exit file, open for writing (empty until the end);
    ``env_fd``: a file (or pipe) to read the worker's whole environment from, a JSON
    object of strings (at most :data:`ENV_MAX_BYTES`; the shim's own environment is not
    passed on);
    ``user``: the ``Popen`` keywords ``user``, ``group``, ``extra_groups`` (numbers) the
    worker runs with (the shim keeps the daemon's: it reads the daemon's interpreter and
    the job's user cannot kill it)."""
    argv = [python, "-I", SHIM_PATH, "--pid-fd", str(pid_fd)]
    argv += ["--status-fd", str(status_fd), "--env-fd", str(env_fd)]
    if user:
        argv += ["--user", str(int(user["user"])), "--group", str(int(user["group"]))]
        argv += ["--groups", ",".join(str(int(g)) for g in user.get("extra_groups", ()))]
    return [*argv, "--", *command]


def exit_record(pid: int, returncode: int, ended_at_s: float) -> dict[str, Any]:
    """The exit file's content: the worker's ``pid``, ``returncode`` as
    :class:`subprocess.Popen` gives it (``-N``: killed by signal N), ``exit_status`` (the
    status it passed to ``exit``, None for a signal), ``signal`` (None for an exit) and
    ``ended_at_s`` (Unix seconds)."""
    return {
        "pid": pid,
        "returncode": returncode,
        "exit_status": returncode if returncode >= 0 else None,
        "signal": -returncode if returncode < 0 else None,
        "ended_at_s": ended_at_s,
    }


def _parse(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``--name value`` pairs up to ``--``, then the command."""
    usage = f"usage: python -I {SHIM_PATH} --pid-fd N --status-fd N --env-fd N [--user ...] -- ARGV"
    options: dict[str, str] = {}
    args = list(argv)
    while args and args[0] != "--":
        if len(args) < 2 or not args[0].startswith("--"):
            raise SystemExit(usage)
        options[args[0][2:]] = args[1]
        args = args[2:]
    if not args or len(args) < 2 or not {"pid-fd", "status-fd", "env-fd"} <= options.keys():
        raise SystemExit(usage)
    return options, args[1:]


def _read_env(fd: int) -> dict[str, str]:
    """The worker's environment from ``fd`` (closed); raises :class:`ValueError` when it
    is not a JSON object of strings or passes :data:`ENV_MAX_BYTES`, :class:`OSError`."""
    data = b""
    try:
        while len(data) <= ENV_MAX_BYTES:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > ENV_MAX_BYTES:
        raise ValueError(f"the worker's environment passes {ENV_MAX_BYTES} bytes")
    env = json.loads(data)
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("the worker's environment is not a JSON object of strings")
    return env


def _write_status(status_fd: int, data: bytes) -> None:
    """Write the exit record; a failure (ENOSPC, EIO) is one line on stderr, not a
    traceback: the shim still exits with the worker's status."""
    try:
        try:
            os.write(status_fd, data)  # one small write into an empty file
            os.fsync(status_fd)
        finally:
            os.close(status_fd)
    except OSError as exc:
        print(f"gpuwatchd launcher shim: cannot write the exit file: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the shim (see the module docstring); returns the status to exit with (a worker
    killed by a signal: the shim kills itself with the same signal instead)."""
    options, command = _parse(sys.argv[1:] if argv is None else argv)
    pid_fd, status_fd = int(options["pid-fd"]), int(options["status-fd"])
    env_fd = int(options["env-fd"])
    user: dict[str, Any] = {}
    if "user" in options:
        groups = [int(g) for g in options.get("groups", "").split(",") if g]
        user = {"user": int(options["user"]), "group": int(options["group"])}
        user["extra_groups"] = groups
    child: subprocess.Popen[bytes] | None = None
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            early.append(signum)
            return
        if child.returncode is not None:  # reaped: its group id may be another's now
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    for forwarded in FORWARDED_SIGNALS:
        signal.signal(forwarded, forward)
    try:
        # its own process group (setpgid 0): the daemon signals that group, not the shim
        group: dict[str, Any] = (
            {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        )
        env = _read_env(env_fd)
        child = subprocess.Popen(command, env=env, close_fds=True, **group, **user)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        os.write(pid_fd, f"error {type(exc).__name__}: {exc}\n".encode(errors="replace"))
        os.close(pid_fd)
        return 127
    os.write(pid_fd, f"{child.pid}\n".encode())
    os.close(pid_fd)
    for signum in early:
        forward(signum, None)
    returncode = child.wait()
    _write_status(status_fd, json.dumps(exit_record(child.pid, returncode, time.time())).encode())
    if returncode < 0:
        sig = -returncode
        # the worker dumped its core, if any: not a second one of the shim, as root
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP: no handler to reset
            signal.signal(signal.Signals(sig), signal.SIG_DFL)
        os.kill(os.getpid(), sig)  # the daemon's wait sees the worker's signal
        return 128 + sig  # a signal that does not end a process (SIGCHLD...): as shells do
    return returncode


if __name__ == "__main__":
    sys.exit(main())
