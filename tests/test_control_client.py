"""The blocking ControlClient against a real ControlServer on a real Unix socket."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpuwatchd.control.client import ControlClient, default_socket_path
from gpuwatchd.control.protocol import (
    DEFAULT_SOCKET_PATH,
    MAX_LINE_BYTES,
    ErrorCode,
    Request,
    ok_reply,
)
from gpuwatchd.control.server import ControlServer, PeerCredentials
from gpuwatchd.errors import ControlError, ProtocolError

T = TypeVar("T")


class QuietLogger:
    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: None


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Daemon:
    """A real ControlServer with a small handler, run on a LoopThread."""

    def __init__(self, loop: LoopThread, path: Path) -> None:
        self.loop = loop
        self.path = path
        self.server = ControlServer(path, self.handle, logger=QuietLogger())
        self.status_calls = 0

    async def handle(self, request: Request, peer: PeerCredentials) -> Any:
        if request.op == "status":
            self.status_calls += 1
            return {"state": "running", "calls": self.status_calls}
        if request.op == "status_with_command":
            # The daemon sends a command to the caller's job *before* answering: the
            # client must keep it for poll_requests and still return the right reply.
            command = asyncio.ensure_future(
                self.server.send_command("digits", "set_knob", {"knob": "num_workers", "value": 5})
            )
            await asyncio.sleep(0)  # let it write the command line first
            self.pending_command = command
            return {"state": "running"}
        if request.op == "sleep":
            await asyncio.sleep(float(request.params["seconds"]))
            return {}
        if request.op == "echo":
            return dict(request.params)
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {request.op!r}")

    def start(self) -> None:
        self.loop.run(self.server.start())

    def stop(self) -> None:
        self.loop.run(self.server.close())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="gwcli-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture
def daemon(loop: LoopThread, short_dir: Path) -> Iterator[Daemon]:
    d = Daemon(loop, short_dir / "control.sock")
    d.start()
    yield d
    d.stop()


# ---------------------------------------------------------------------- socket path


def test_default_socket_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUWATCHD_SOCKET", raising=False)
    assert default_socket_path() == DEFAULT_SOCKET_PATH == "/run/gpuwatchd/control.sock"
    monkeypatch.setenv("GPUWATCHD_SOCKET", "/tmp/x/gw.sock")
    assert default_socket_path() == "/tmp/x/gw.sock"
    assert ControlClient().path == "/tmp/x/gw.sock"
    assert ControlClient("/elsewhere.sock").path == "/elsewhere.sock"
    monkeypatch.setenv("GPUWATCHD_SOCKET", "")
    assert default_socket_path() == DEFAULT_SOCKET_PATH


def test_client_module_stays_light() -> None:
    """The hook imports the client inside training jobs, and ``gpuwatchctl status --json``
    little else: no asyncio, no structlog, no dataclasses (it brings inspect and ast)."""
    code = (
        "import sys, gpuwatchd.control.client as c; "
        "heavy = [m for m in ('asyncio', 'structlog', 'psutil', 'pynvml', 'torch', "
        "'gpuwatchd.control.server', 'dataclasses', 'inspect') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------- no daemon


def test_no_socket_file_is_unavailable(short_dir: Path) -> None:
    path = short_dir / "missing.sock"
    with ControlClient(path) as client, pytest.raises(ControlError) as err:
        client.call("status")
    assert err.value.code == "unavailable"
    assert err.value.message.startswith(f"no gpuwatchd at {path}: ")


def test_socket_nobody_listens_on_is_unavailable(short_dir: Path) -> None:
    path = short_dir / "dead.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))
    dead.close()
    with ControlClient(path) as client, pytest.raises(ControlError) as err:
        client.call("status")
    assert err.value.code == "unavailable"
    assert "refused" in err.value.message.lower()


def test_daemon_that_does_not_answer_in_time_is_unavailable(daemon: Daemon) -> None:
    with ControlClient(daemon.path, timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(ControlError) as err:
            client.call("sleep", seconds=2)
        assert time.monotonic() - started < 1.5
        assert err.value.code == "unavailable"
        assert "no reply to 'sleep' within 0.3 s" in err.value.message
        assert client.call("status")["state"] == "running", "the next call works"


# ---------------------------------------------------------------------- replies


def test_call_returns_the_result(daemon: Daemon) -> None:
    with ControlClient(daemon.path) as client:
        assert client.call("status") == {"state": "running", "calls": 1}
        assert client.call("echo", a=1, b=[True, None], c="é") == {
            "a": 1,
            "b": [True, None],
            "c": "é",
        }
        assert client.call("status")["calls"] == 2, "one connection, many calls"


def test_error_reply_raises_control_error_with_the_daemons_code(daemon: Daemon) -> None:
    with ControlClient(daemon.path) as client:
        with pytest.raises(ControlError) as err:
            client.call("frobnicate")
        assert (err.value.code, err.value.message) == ("unknown_op", "unknown op 'frobnicate'")
        with pytest.raises(ControlError) as err:
            client.call("report", report={})
        assert err.value.code == "bad_request"


def test_request_too_large_to_send_is_refused_locally(daemon: Daemon) -> None:
    with ControlClient(daemon.path) as client:
        with pytest.raises(ControlError) as err:
            client.call("echo", blob="x" * MAX_LINE_BYTES)
        assert err.value.code == "too_large"
        assert not client.connected
        assert client.call("status")["state"] == "running"


def test_daemon_requests_arriving_during_a_call_are_kept_for_poll(daemon: Daemon) -> None:
    """The job side of a set_knob round trip, as the hook will drive it."""
    with ControlClient(daemon.path) as job:
        job.call(
            "hello",
            role="job",
            job="digits",
            pid=os.getpid(),
            knobs={"num_workers": {"value": 2, "min": 0, "max": 8}},
        )
        assert job.call("status_with_command") == {"state": "running"}
        (command,) = job.poll_requests()
        assert command.op == "set_knob"
        assert command.params == {"knob": "num_workers", "value": 5}
        assert job.poll_requests() == [], "each request is handed out once"
        job.send(ok_reply(command.id, {"knob": "num_workers", "value": 5}))
        (reply,) = daemon.loop.run(_await_command(daemon))
        assert reply.ok and reply.result == {"knob": "num_workers", "value": 5}
        (info,) = daemon.loop.run(_jobs(daemon))
        assert info.knobs["num_workers"].value == 5


async def _await_command(daemon: Daemon) -> Any:
    return await daemon.pending_command


async def _jobs(daemon: Daemon) -> Any:
    return daemon.server.jobs()


def test_poll_requests_waits_up_to_its_timeout(daemon: Daemon) -> None:
    with ControlClient(daemon.path) as job:
        job.call("hello", role="job", job="digits", pid=os.getpid())
        started = time.monotonic()
        assert job.poll_requests(timeout_s=0.2) == []
        assert 0.15 < time.monotonic() - started < 2
        future = asyncio.run_coroutine_threadsafe(
            daemon.server.send_command("digits", "stop", {"reason": "budget"}, timeout_s=5),
            daemon.loop.loop,
        )
        (stop,) = job.poll_requests(timeout_s=5)
        assert (stop.op, stop.params) == ("stop", {"reason": "budget"})
        job.send(ok_reply(stop.id))
        assert future.result(5)[0].ok


def test_client_reconnects_after_the_daemon_restarts(loop: LoopThread, short_dir: Path) -> None:
    path = short_dir / "control.sock"
    first = Daemon(loop, path)
    first.start()
    with ControlClient(path) as client:
        assert client.call("status")["calls"] == 1
        first.stop()
        second = Daemon(loop, path)
        second.start()
        try:
            assert client.call("status")["calls"] == 1, "answered by the new daemon"
        finally:
            second.stop()


def test_close_is_idempotent_and_the_context_manager_closes(daemon: Daemon) -> None:
    client = ControlClient(daemon.path)
    with client:
        client.call("status")
        assert client.connected
    assert not client.connected
    client.close()
    with pytest.raises(ValueError):
        ControlClient(daemon.path, timeout_s=0)
