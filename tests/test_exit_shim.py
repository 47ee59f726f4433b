"""The launcher shim (gpuwatchd/jobs/exit_shim.py) on real processes: it reports the
worker's pid, mirrors its status, writes it into the exit file (or says in one line that
it cannot), gives the worker exactly the environment handed to it, forwards a signal sent
to the shim alone, and reports a command that cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatchd.jobs.exit_shim import shim_argv
from gpuwatchd.jobs.launch import read_exit_file

WORKER_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JOB_VAR": "from-job"}


def _env_fd(env: dict[str, str]) -> int:
    fd = os.memfd_create("test-worker-env")
    os.write(fd, json.dumps(env).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _start(
    tmp_path: Path,
    command: list[str],
    *,
    worker_env: dict[str, str] | None = None,
    exit_file: Path | None = None,
    **popen: Any,
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Start the shim as the daemon does (``worker_env``: on ``--env-fd``); return
    it, the pipe's read end and the exit file."""
    exit_file = exit_file or tmp_path / "exit.json"
    status_fd = os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    env_fd = _env_fd(WORKER_ENV if worker_env is None else worker_env)
    read_fd, write_fd = os.pipe()
    shim = subprocess.Popen(
        shim_argv(sys.executable, write_fd, status_fd, env_fd, command),
        pass_fds=(write_fd, status_fd, env_fd),
        start_new_session=True,
        **popen,
    )
    for fd in (write_fd, status_fd, env_fd):
        os.close(fd)
    return shim, read_fd, exit_file


def _reported(read_fd: int) -> str:
    with os.fdopen(read_fd, "rb") as pipe:
        return pipe.read().decode().strip()


def test_the_shim_mirrors_the_workers_status_and_writes_it(tmp_path: Path) -> None:
    shim, read_fd, exit_file = _start(
        tmp_path, [sys.executable, "-c", "import os; print(os.getpid()); raise SystemExit(3)"]
    )
    pid = int(_reported(read_fd))
    assert shim.wait(timeout=60) == 3
    assert pid != shim.pid
    record = json.loads(exit_file.read_text())
    assert (record["pid"], record["returncode"], record["exit_status"], record["signal"]) == (
        pid,
        3,
        3,
        None,
    )
    assert read_exit_file(exit_file) == 3


def test_a_signal_sent_to_the_shim_reaches_the_worker(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    shim, read_fd, exit_file = _start(
        tmp_path,
        [
            sys.executable,
            "-c",
            "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)",
            str(ready),
        ],
    )
    pid = int(_reported(read_fd))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.02)
    assert os.getpgid(pid) == pid  # its own group: the daemon signals it, not the shim
    shim.send_signal(signal.SIGTERM)  # to the shim alone
    assert shim.wait(timeout=60) == -signal.SIGTERM  # the worker's death, mirrored
    assert read_exit_file(exit_file) == -signal.SIGTERM
    assert json.loads(exit_file.read_text())["signal"] == signal.SIGTERM


def test_a_worker_killed_by_sigkill_is_mirrored_without_a_word_from_the_shim(
    tmp_path: Path,
) -> None:
    """The shim adds nothing to the worker's stderr (it is crash evidence): a worker
    SIGKILLed from outside reads as killed, not as a shim's traceback."""
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    shim, read_fd, exit_file = _start(tmp_path, command, stderr=subprocess.PIPE)
    pid = int(_reported(read_fd))
    os.kill(pid, signal.SIGKILL)
    assert shim.stderr is not None
    assert shim.stderr.read() == b""
    assert shim.wait(timeout=60) == -signal.SIGKILL
    assert read_exit_file(exit_file) == -signal.SIGKILL


def test_a_command_that_cannot_start_is_reported_and_leaves_no_status(tmp_path: Path) -> None:
    shim, read_fd, exit_file = _start(tmp_path, [str(tmp_path / "no-such-program")])
    reported = _reported(read_fd)
    assert shim.wait(timeout=60) == 127
    assert reported.startswith("error FileNotFoundError"), reported
    assert exit_file.read_bytes() == b""
    assert read_exit_file(exit_file) is None  # no status: unknown


def test_the_worker_gets_exactly_the_environment_handed_over_and_the_shim_none_of_it(
    tmp_path: Path,
) -> None:
    """The shim runs as the daemon's user: the job's LD_PRELOAD must not load into it,
    and its interpreter's locale coercion (LC_CTYPE) must not leak into the worker."""
    shim_env = {"PATH": WORKER_ENV["PATH"], "SHIM_ONLY": "daemon"}  # C locale: coerced
    worker_env = {**WORKER_ENV, "LD_PRELOAD": "/nonexistent.so", "MARKER": "job"}
    seen = tmp_path / "seen.json"
    script = (
        "import json, os, sys\n"
        "def environ(pid):\n"
        "    raw = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
        "    return dict(e.decode().split('=', 1) for e in raw if e)\n"
        "json.dump({'worker': environ(os.getpid()), 'shim': environ(os.getppid())},"
        " open(sys.argv[1], 'w'))\n"
    )
    shim, read_fd, _ = _start(
        tmp_path,
        [sys.executable, "-c", script, str(seen)],
        worker_env=worker_env,
        env=shim_env,
        stderr=subprocess.DEVNULL,  # ld.so's word about the missing preload, the worker's
    )
    _reported(read_fd)
    assert shim.wait(timeout=60) == 0
    environs = json.loads(seen.read_text())
    assert environs["worker"] == worker_env
    assert "LD_PRELOAD" not in environs["shim"]
    assert "MARKER" not in environs["shim"]
    assert environs["shim"] == shim_env


def test_an_exit_file_that_cannot_be_written_still_mirrors_the_workers_status(
    tmp_path: Path,
) -> None:
    """ENOSPC on the exit file (/dev/full): one line on stderr, and the shim still exits
    with the worker's status 0 (not 1 with a traceback: a clean worker judged crashed)."""
    shim, read_fd, _ = _start(
        tmp_path,
        [sys.executable, "-c", "pass"],
        exit_file=Path("/dev/full"),
        stderr=subprocess.PIPE,
    )
    _reported(read_fd)
    assert shim.stderr is not None
    said = shim.stderr.read().decode()
    assert shim.wait(timeout=60) == 0
    assert "Traceback" not in said
    assert said.count("\n") == 1 and "cannot write the exit file" in said, said


def test_the_shim_runs_where_gpuwatchd_is_not_importable(tmp_path: Path) -> None:
    """``-I`` leaves a user site out of ``sys.path`` (a ``pip install --user`` daemon):
    the shim runs by path and needs the standard library only; ``-S`` (no site at all)
    proves it."""
    exit_file = tmp_path / "exit.json"
    status_fd = os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    env_fd = _env_fd(WORKER_ENV)
    read_fd, write_fd = os.pipe()
    argv = shim_argv(sys.executable, write_fd, status_fd, env_fd, [sys.executable, "-c", "pass"])
    assert argv[1] == "-I"
    shim = subprocess.Popen(
        [argv[0], "-I", "-S", *argv[2:]],
        pass_fds=(write_fd, status_fd, env_fd),
        start_new_session=True,
        cwd="/",
    )
    for fd in (write_fd, status_fd, env_fd):
        os.close(fd)
    assert _reported(read_fd).isdigit()
    assert shim.wait(timeout=60) == 0
    assert read_exit_file(exit_file) == 0
