"""NotifyListener: a real AF_UNIX datagram socket that records sd_notify messages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.testing.notify import NotifyListener, parse_notification


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # Short directory: Unix socket paths are limited to 107 bytes (unix(7)).
    with tempfile.TemporaryDirectory(prefix="gwn", dir="/tmp") as d:
        yield Path(d)


def _send(path: str, payload: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(payload.encode(), path)


def test_records_datagrams_parsed_and_raw(sockdir: Path) -> None:
    with NotifyListener(sockdir) as listener:
        assert Path(listener.path).is_socket()
        _send(listener.path, "READY=1\nSTATUS=watching 2 GPUs")
        raw = listener.wait_for("READY=1", timeout_s=5)
        assert raw == "READY=1\nSTATUS=watching 2 GPUs"
        assert listener.messages == [{"READY": "1", "STATUS": "watching 2 GPUs"}]
        assert listener.raw == [raw]
        assert len(listener) == 1


def test_wait_for_key_callable_and_later_message(sockdir: Path) -> None:
    with NotifyListener(sockdir) as listener:
        timer = threading.Timer(0.2, _send, (listener.path, "STATUS=tick 3"))
        timer.start()
        try:
            # The message arrives after wait_for started: it must wake up for it.
            assert listener.wait_for("STATUS", timeout_s=5) == "STATUS=tick 3"
        finally:
            timer.join()
        assert listener.wait_for(lambda m: m.get("STATUS", "").endswith("3")) == "STATUS=tick 3"


def test_wait_for_start_index_skips_earlier_messages(sockdir: Path) -> None:
    with NotifyListener(sockdir) as listener:
        _send(listener.path, "READY=1")
        listener.wait_for("READY=1")
        mark = len(listener)
        with pytest.raises(TimeoutError):
            listener.wait_for("READY=1", timeout_s=0.2, start=mark)
        _send(listener.path, "RELOADING=1")
        _send(listener.path, "READY=1")
        listener.wait_for("READY=1", start=mark)
        assert listener.messages[mark:] == [{"RELOADING": "1"}, {"READY": "1"}]


def test_timeout_names_what_was_received(sockdir: Path) -> None:
    with NotifyListener(sockdir) as listener:
        _send(listener.path, "STATUS=starting")
        listener.wait_for("STATUS")
        started = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            listener.wait_for("READY=1", timeout_s=0.3)
        assert time.monotonic() - started >= 0.3
        assert "READY=1" in str(info.value)
        assert "STATUS=starting" in str(info.value)


def test_records_sender_pid_of_another_process(sockdir: Path) -> None:
    with NotifyListener(sockdir) as listener:
        code = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "s.sendto(b'READY=1', sys.argv[1])\n"
            "print(__import__('os').getpid())\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, listener.path],
            check=True,
            timeout=30,
            capture_output=True,
            text=True,
        )
        listener.wait_for("READY=1")
        (note,) = listener.notifications
        assert note.pid == int(proc.stdout)


def test_close_stops_receiver_and_removes_socket(sockdir: Path) -> None:
    listener = NotifyListener(sockdir, name="n.sock")
    with listener:
        path = listener.path
        assert path == str(sockdir / "n.sock")
    assert not os.path.exists(path)
    assert not any(t.name == f"NotifyListener({path})" for t in threading.enumerate())
    listener.close()  # idempotent


def test_too_long_path_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ValueError, match="Unix socket address"):
        NotifyListener(deep)


def test_parse_notification_rules() -> None:
    assert parse_notification("A=1\nnoequals\nB=x=y\nA=2\n") == {"A": "2", "B": "x=y"}
    assert parse_notification("") == {}
