"""The launcher shim (gpuwatchd/jobs/exit_shim.py) on real processes: it reports the
worker's pid, mirrors its status, writes it into the exit file, forwards a signal sent
to the shim alone, and reports a command that cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.jobs.exit_shim import shim_argv
from gpuwatchd.jobs.launch import read_exit_file


def _start(tmp_path: Path, command: list[str]) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Start the shim as the daemon does; return it, the pipe's read end and the exit file."""
    exit_file = tmp_path / "exit.json"
    status_fd = os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    read_fd, write_fd = os.pipe()
    shim = subprocess.Popen(
        shim_argv(sys.executable, write_fd, status_fd, command),
        pass_fds=(write_fd, status_fd),
        start_new_session=True,
    )
    os.close(write_fd)
    os.close(status_fd)
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
    exit_file = tmp_path / "exit.json"
    status_fd = os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    shim = subprocess.Popen(
        shim_argv(sys.executable, write_fd, status_fd, command),
        pass_fds=(write_fd, status_fd),
        start_new_session=True,
        stderr=subprocess.PIPE,
    )
    os.close(write_fd)
    os.close(status_fd)
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
