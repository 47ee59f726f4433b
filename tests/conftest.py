"""Shared fixtures: a real gpuwatchd subprocess on a real socket, with the fake NVML only.

``run_daemon`` starts ``python -m gpuwatchd.testing.fakerun SCRIPT.json run ...`` (the
fake NVML installed at the pynvml boundary, everything else real) with a real
datagram socket as ``NOTIFY_SOCKET``, waits for ``READY=1`` and stops the daemon with
SIGTERM at the end of the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.testing import NotifyListener

pytest_plugins = ["module_order"]  # the slowest modules first (tests/module_order.py)

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "tests" / "data" / "traces"


def pytest_configure(config: pytest.Config) -> None:
    """The clients the tests run print tables as a user's pipe gets them: 160 columns
    (gpuwatchd/cli/commands/__init__.py), whatever the terminal the suite runs in says
    (``COLUMNS`` from a narrow terminal, or 80 in pytest-xdist's workers, cut columns)."""
    os.environ["COLUMNS"] = "160"
    os.environ.pop("LINES", None)

TWO_GPUS: dict[str, Any] = {
    "devices": [
        {
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {
                "utilization.gpu": [97.0],
                "memory.used": [60 * 2**30],
                "temperature.gpu": [61.0],
                "power.draw": [412.5],
            },
        },
        {
            "uuid": "GPU-11111111-1111-1111-1111-111111111111",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {
                "utilization.gpu": [3.0],
                "memory.used": [1 * 2**30],
                "temperature.gpu": [35.0],
                "power.draw": [70.0],
            },
        },
    ]
}


@dataclass
class RunningDaemon:
    """A gpuwatchd subprocess and the paths to talk to it."""

    process: subprocess.Popen[bytes]
    socket: Path
    log_path: Path
    notify: NotifyListener
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)

    def ctl(self, *args: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess[str]:
        """Run the real ``gpuwatchctl --socket ... ARGS`` and return its result."""
        return subprocess.run(
            [str(BIN / "gpuwatchctl"), "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.env,
        )

    def status(self) -> dict[str, Any]:
        """``gpuwatchctl --json status`` as a dict (asserts the command succeeded)."""
        result = self.ctl("--json", "status")
        assert result.returncode == 0, result.stderr
        status: dict[str, Any] = json.loads(result.stdout)
        return status

    def events(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines so far."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_until(
        self, predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition"
    ) -> Any:
        """Poll ``predicate`` until it returns something truthy; fail with the log tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            assert self.process.poll() is None, f"daemon exited:\n{self.log_tail()}"
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def restart_on_same_state(
    run_daemon: Callable[..., RunningDaemon],
    first: RunningDaemon,
    args: Sequence[str] = (),
    *,
    name: str = "second",
    script: dict[str, Any] | None = None,
) -> RunningDaemon:
    """A new daemon (``args`` plus ``first``'s state directory and socket), e.g. after
    ``first`` was SIGKILLed or stopped: what systemd's restart of the unit does."""
    state = first.workdir / "state"
    later = run_daemon(
        script=script,
        args=[*args, "--state-dir", str(state), "--socket", str(first.socket)],
        name=name,
    )
    later.socket = first.socket  # the fixture named its own; the last --socket won
    return later


@pytest.fixture
def run_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Factory: ``run_daemon(script=TWO_GPUS, args=[...])`` -> a ready :class:`RunningDaemon`."""
    started: list[RunningDaemon] = []

    def start(
        script: dict[str, Any] | None = None,
        args: Sequence[str] = (),
        wait_ready: bool = True,
        name: str = "d",
    ) -> RunningDaemon:
        workdir = tmp_path / name
        workdir.mkdir()
        script_path = workdir / "nvml.json"
        script_path.write_text(json.dumps(TWO_GPUS if script is None else script))
        socket = workdir / "run" / "control.sock"
        notify = NotifyListener(workdir)
        notify.__enter__()
        env = dict(os.environ, NOTIFY_SOCKET=str(notify.path), PYTHONUNBUFFERED="1")
        env.pop("GPUWATCHD_SOCKET", None)
        # A test run inside a unit (a CI runner service) must not make these daemons start
        # their workers as units of the host's systemd (launcher: auto).
        env.pop("INVOCATION_ID", None)
        log_path = workdir / "daemon.log"
        command = [
            sys.executable,
            "-m",
            "gpuwatchd.testing.fakerun",
            str(script_path),
            "run",
            "--socket",
            str(socket),
            "--state-dir",
            str(workdir / "state"),
            "--interval",
            "0.2",
            "--log-format",
            "json",
            *args,
        ]
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        daemon = RunningDaemon(
            process, socket, log_path, notify, workdir, env=dict(env, GPUWATCHD_SOCKET=str(socket))
        )
        started.append(daemon)
        if wait_ready:
            try:
                # The bound systemd gives it: DefaultTimeoutStartSec=90s
                # (systemd-system.conf(5)); systemd/gpuwatchd.service sets none. Under
                # load, a restart that first recovers pending crashes took over 30 s.
                notify.wait_for("READY=1", timeout_s=90)
            except TimeoutError:
                raise AssertionError(f"no READY=1:\n{daemon.log_tail()}") from None
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        daemon.notify.close()
