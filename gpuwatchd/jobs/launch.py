"""Starting, signalling and awaiting worker processes: the supervisor's one ``subprocess`` user.

A worker is an argv (never a shell string) started with :class:`subprocess.Popen` under
the launcher shim (:mod:`.exit_shim`, which writes its exit status into the launch's exit
file) in its own session, stdin ``/dev/null``, stdout/stderr appended to its files; its
end is awaited through a pidfd. Why not asyncio's subprocess transport:
docs/supervisor-internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatchd.config import JobConfig
from gpuwatchd.control.protocol import JOB_ENV, SOCKET_ENV, WORKER_ID_ENV
from gpuwatchd.errors import SupervisorError
from gpuwatchd.jobs import exit_shim
from gpuwatchd.jobs.job import Job
from gpuwatchd.jobs.output import OutputFiles
from gpuwatchd.jobs.procfs import child_pids, is_same_process, read_stat
from gpuwatchd.jobs.worker import Worker
from gpuwatchd.systemd import strip_notify_env

__all__ = [
    "SPAWN_ERRORS",
    "Spawned",
    "exit_file",
    "kill_launch",
    "kill_session",
    "probe",
    "read_exit_file",
    "read_worker_pid",
    "run_tool",
    "signal_worker",
    "spawn",
    "user_settings",
    "wait_exit",
    "worker_env",
]

SPAWN_ERRORS = (OSError, ValueError, subprocess.SubprocessError)
"""What :func:`spawn` raises when the command cannot be started."""


def user_settings(cfg: JobConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """``Popen`` keyword arguments and environment for ``cfg.user`` (empty when unset)."""
    if cfg.user is None:
        return {}, {}
    try:
        pw = pwd.getpwnam(cfg.user)
    except KeyError:
        raise SupervisorError(f"job {cfg.name!r}: no such user {cfg.user!r}") from None
    env = {"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name}
    euid = os.geteuid()
    if euid == pw.pw_uid:
        return {}, env  # already that user: nothing to switch
    if euid != 0:
        raise SupervisorError(
            f"job {cfg.name!r}: 'user: {cfg.user}' needs gpuwatchd to run as root "
            f"(it runs as uid {euid})",
            code="forbidden",
        )
    groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": groups}, env


def worker_env(
    job: Job, w: Worker, *, socket_path: str, environ: Mapping[str, str] | None
) -> dict[str, str]:
    """The environment of worker ``w``: ``environ`` (default ``os.environ``) without
    systemd's notify variables, the user's, the job's, then the ``GPUWATCHD_*`` and CUDA ones."""
    base = os.environ if environ is None else environ
    env = strip_notify_env(base)
    env.update(job.user_env)
    env.update(job.cfg.env)
    # CUDA numbers devices fastest-first unless told otherwise; PCI order makes the
    # index in CUDA_VISIBLE_DEVICES the NVML/nvidia-smi index (CUDA Programming Guide,
    # "CUDA Environment Variables").
    if "CUDA_DEVICE_ORDER" not in job.cfg.env:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = "" if w.gpu is None else str(w.gpu)
    env[JOB_ENV] = job.cfg.name
    env[SOCKET_ENV] = socket_path
    env["GPUWATCHD_WORKER"] = str(w.number)
    if w.worker_id is not None:
        env[WORKER_ID_ENV] = w.worker_id
    return env


def exit_file(job: Job, worker_id: str) -> Path:
    """The exit file of launch ``worker_id``: ``<state_dir>/jobs/<job>/exit-<id>.json``,
    created empty at the launch and written by the launcher shim when the worker ends."""
    return job.directory / f"exit-{worker_id}.json"


@dataclass(frozen=True)
class Spawned:
    """A worker started under the launcher shim (:mod:`.exit_shim`): ``shim`` is the
    shim's process (the daemon's child: its status is the worker's); ``pid_fd`` the read
    end of the pipe that brings the worker's pid (:func:`read_worker_pid`)."""

    shim: subprocess.Popen[bytes]
    pid_fd: int


def spawn(job: Job, files: OutputFiles, env: dict[str, str], exit_path: Path) -> Spawned:
    """Start ``job``'s command under the launcher shim: the shim in a new session, the
    worker in a process group of its own inside it, output in ``files``; ``exit_path``
    (:func:`exit_file`) is created empty and handed to the shim, which writes the
    worker's exit status there.

    The shim runs as the daemon's user with the daemon's environment (without systemd's
    notify variables): ``env``, the worker's, reaches only the worker (through a memfd
    the shim reads, :data:`.exit_shim.ENV_MAX_BYTES` at most), so the job's
    ``LD_PRELOAD`` or ``PYTHON*`` never load into the daemon user's interpreter and the
    worker gets exactly ``env``.

    Raises one of :data:`SPAWN_ERRORS` when the shim cannot be started (a command that
    cannot be: :func:`read_worker_pid`).
    """
    out_fd, err_fd = files.open_for_child()
    status_fd = env_fd = read_fd = write_fd = -1
    try:
        read_fd, write_fd = os.pipe()
        env_fd = os.memfd_create("gpuwatchd-worker-env")
        data = json.dumps(env).encode()
        if len(data) > exit_shim.ENV_MAX_BYTES:
            raise ValueError(f"the worker's environment passes {exit_shim.ENV_MAX_BYTES} bytes")
        written = 0
        while written < len(data):
            written += os.write(env_fd, data[written:])
        os.lseek(env_fd, 0, os.SEEK_SET)
        status_fd = os.open(exit_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        argv = exit_shim.shim_argv(
            sys.executable, write_fd, status_fd, env_fd, job.cfg.command, job.popen_user
        )
        shim = subprocess.Popen(  # as the daemon's user; the worker as the job's
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out_fd,
            stderr=err_fd,
            cwd=job.cfg.cwd,
            env=strip_notify_env(os.environ),
            start_new_session=True,
            close_fds=True,
            pass_fds=(write_fd, status_fd, env_fd),
        )
    except BaseException:
        if read_fd >= 0:
            os.close(read_fd)
        raise
    finally:
        for fd in (out_fd, err_fd, write_fd, status_fd, env_fd):
            if fd >= 0:
                os.close(fd)
    return Spawned(shim, read_fd)


def read_worker_pid(spawned: Spawned, timeout_s: float = 30.0) -> int:
    """The worker's pid, as the shim reports it (blocking: call it off the event loop).

    Raises :class:`OSError` with the shim's reason when the command could not be started
    (the shim exits 127), or when the shim said nothing within ``timeout_s`` (then the
    shim and any worker it started are killed, :func:`kill_launch`).
    """
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([spawned.pid_fd], [], [], left)[0]:
                kill_launch(spawned, None)
                raise OSError(f"the launcher shim did not start the worker within {timeout_s:g} s")
            chunk = os.read(spawned.pid_fd, 512)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(spawned.pid_fd)
    line = data.decode(errors="replace").strip()
    if line.isdigit():
        return int(line)
    spawned.shim.wait()
    reason = line.removeprefix("error ") or f"the launcher shim exited {spawned.shim.returncode}"
    raise OSError(reason)


def kill_launch(spawned: Spawned, worker_pid: int | None) -> None:
    """SIGKILL a launch that will not be watched: the shim's process group (with a
    worker not yet in a group of its own), then the worker's group (``worker_pid``; when
    None, each child of the shim, as ``/proc`` listed them before); reaps the shim.
    Quiet about processes already gone."""
    shim = spawned.shim
    pids = [worker_pid] if worker_pid is not None else child_pids(shim.pid)
    kill_session(shim.pid)
    for pid in pids:  # in this order: one moving out of the shim's group is caught here
        kill_session(pid)
    shim.wait()


def read_exit_file(path: Path) -> int | None:
    """The worker's return code from its launch's exit file (``-N``: killed by signal N);
    None when the shim wrote nothing (it died with the worker, or the file is gone) or
    something unreadable (bounded: 4 KiB)."""
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    code = record.get("returncode") if isinstance(record, dict) else None
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    return code


def probe(
    argv: list[str], *, env: Mapping[str, str], cwd: str | None, timeout_s: float = 30.0
) -> tuple[int | None, str]:
    """Run ``argv`` (no shell) to completion for a check; return (exit status, stdout).

    ``None`` as the status when it could not be started or ran past ``timeout_s``
    (the text says why). Used by ``gpuwatchd check-config`` (an interpreter's imports).
    """
    try:
        done = subprocess.run(
            argv,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:g} s"
    except SPAWN_ERRORS as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return done.returncode, done.stdout


def run_tool(argv: list[str], *, timeout_s: float = 30.0) -> tuple[int | None, str, str]:
    """Run a system tool (``systemd-run``, ``systemctl``, ``journalctl``: an argv, no shell)
    with the daemon's environment; return (exit status, stdout, stderr).

    ``None`` as the status when it could not be started or ran past ``timeout_s`` (the
    third item says why). Blocking: call it off the event loop (``asyncio.to_thread``).
    """
    try:
        done = subprocess.run(
            argv,
            env=strip_notify_env(os.environ),  # systemd tools would notify as the daemon
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, "", f"{argv[0]} did not finish within {timeout_s:g} s"
    except SPAWN_ERRORS as exc:
        return None, "", f"{type(exc).__name__}: {exc}"
    return done.returncode, done.stdout, done.stderr


def kill_session(pid: int) -> None:
    """SIGKILL what is left of worker ``pid``'s session (its DataLoader workers); quiet."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def signal_worker(w: Worker, sig: signal.Signals) -> bool:
    """Send ``sig`` to the worker's process group (its own session). False if gone.

    An adopted worker is checked first (same pid and start time) and signalled alone when
    it does not lead its process group. Raises :class:`PermissionError`.
    """
    pid = w.pid
    if pid is None or pid <= 0:  # <= 0: a unit that ended before its pid was read
        return False
    try:
        if w.adopted:
            stat = read_stat(pid)
            if stat is None or not is_same_process(pid, w.start_ticks):
                return False
            if stat.pgrp == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        else:
            os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


async def wait_exit(
    pid: int, shim: subprocess.Popen[bytes] | None, start_ticks: int | None, poll_s: float
) -> int | None:
    """Wait until process ``pid`` ends; with ``shim``, the launcher shim this daemon
    started for it, the shim's return code (the worker's, mirrored), else None.

    A pidfd (``os.pidfd_open``) becomes readable when the process ends, for children and
    for adopted processes alike; it is watched with ``loop.add_reader``. Without pidfds
    (kernel < 5.3) a child is polled with ``Popen.poll`` and an adopted process through
    ``/proc/<pid>/stat`` (same pid, same start time), every 50 ms to ``poll_s``.
    """
    if shim is not None:
        pid = shim.pid  # the launcher shim: it ends after the worker, with its status
    loop = asyncio.get_running_loop()
    fd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    if fd is not None and (shim is not None or is_same_process(pid, start_ticks)):
        ended: asyncio.Future[None] = loop.create_future()

        def _readable() -> None:
            if not ended.done():
                ended.set_result(None)

        try:
            loop.add_reader(fd, _readable)
            try:
                await ended
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)
        return None if shim is None else shim.wait()
    if fd is not None:
        os.close(fd)
    delay = 0.05
    while True:
        if shim is not None:
            returncode = shim.poll()
            if returncode is not None:
                return returncode
        elif not is_same_process(pid, start_ticks):
            return None
        await asyncio.sleep(delay)
        delay = min(delay * 2, max(poll_s, 0.05))
