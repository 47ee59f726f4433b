"""``gpuwatchctl top`` as a user sees it: in a real tmux terminal, against a daemon
replaying the real 8-GPU H100 trace (tmux comes from Debian; ``make tmux`` installs it)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import BIN, TRACES, RunningDaemon

TRACE = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"


class Tmux:
    """A private tmux server (its own socket) with one fixed-size session."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-S", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )

    def screen(self) -> str:
        result = self("capture-pane", "-p", "-t", "top")
        return result.stdout

    def alive(self) -> bool:
        return self("has-session", "-t", "top").returncode == 0


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    assert shutil.which("tmux"), "tmux is missing: `make tmux` (apt-get install tmux)"
    server = Tmux(tmp_path / "tmux.sock")
    yield server
    server("kill-server")


def test_top_shows_gpus_findings_and_keys_work(
    run_daemon: Callable[..., RunningDaemon], tmux: Tmux
) -> None:
    # 8x real time: the trace's 105 s idle start (all 8 GPUs at 0 %) lasts ~13 s; the
    # default gpu-underused finding (for: 20s, 2.5 s real) is on screen for ~10 s of it.
    daemon = run_daemon(
        script={"devices": []}, args=["--devices", f"replay:{TRACE}", "--replay-speed", "8"]
    )
    command = shlex.join(
        [str(BIN / "gpuwatchctl"), "--socket", str(daemon.socket), "top", "--interval", "0.5"]
    )
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in daemon.env.items() if k == "PYTHONPATH")
    # pytest exports COLUMNS/LINES; a user's terminal size comes from the tty.
    shell = f"env -u COLUMNS -u LINES {env} TERM=xterm-256color {command}; echo top exited $?"
    started = tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "60", shell + "; sleep 30")
    assert started.returncode == 0, started.stderr

    def screen_has(*texts: str) -> str | None:
        screen = tmux.screen()
        return screen if all(t in screen for t in texts) else None

    screen = daemon.wait_until(
        lambda: screen_has("GPU 7", "low_utilization"),
        timeout_s=30,
        what=f"top with a finding; screen:\n{tmux.screen()}",
    )
    lines = screen.splitlines()
    for index in range(8):
        assert any(line.lstrip("│ ").startswith(f"GPU {index} ") for line in lines), screen
    assert "keys: p pause" in screen
    assert "Open findings" in screen and "Last decisions" in screen
    # Bars: the training phase runs at 100 % (a full utilization bar).
    daemon.wait_until(lambda: screen_has("██████████"), timeout_s=60, what="utilization bars")

    tmux("send-keys", "-t", "top", "p")
    daemon.wait_until(lambda: daemon.status()["paused"], timeout_s=10, what="paused by p")
    daemon.wait_until(lambda: screen_has("PAUSED"), timeout_s=10, what="PAUSED on screen")
    tmux("send-keys", "-t", "top", "r")
    daemon.wait_until(lambda: not daemon.status()["paused"], timeout_s=10, what="resumed by r")

    tmux("send-keys", "-t", "top", "q")
    # top leaves its full screen and exits 0; the shell after it says so.
    screen = daemon.wait_until(
        lambda: screen_has("top exited 0"), timeout_s=10, what="top exits on q"
    )
    assert "keys: p pause" not in screen


def test_top_without_tty_prints_plain_snapshots(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon(
        script={"devices": []}, args=["--devices", f"replay:{TRACE}", "--replay-speed", "5"]
    )
    result = daemon.ctl("top", "--once")
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout  # no escape sequences in a pipe
    for index in range(8):
        assert f"GPU {index} " in result.stdout
    assert "Jobs (0)" in result.stdout
