"""Fair use of the control socket under attack: one uid's idle connections cannot lock out
root or another user's job; silent connections are closed; the log does not grow with the
attack. Real sockets, a real daemon, real processes as other uids (fork + setuid)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.fairness import Admission, ConnectionLimits, LogLimiter
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import Request
from gpuwatchd.control.server import ControlServer

NOBODY = 65534
REPORT = {
    "steps": 1,
    "epoch": 0,
    "step_time_s": 0.1,
    "data_wait_s": 0.0,
    "data_wait_fraction": 0.0,
    "samples_per_s": 1.0,
}
OTHER_USER = 4243
"""A uid with no account: a second, unrelated user whose job attaches."""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as other users needs root (setuid in a child)"
)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory every user may traverse (sun_path holds 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="gwfair-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _as_user(uid: int, body: Callable[[], bytes]) -> tuple[int, int]:
    """Fork a child that becomes ``uid`` (gid too, no groups), runs ``body`` and writes
    what it returns to a pipe. Returns (pid, read end). Everything the child needs must be
    imported already: after setuid it may not read the interpreter's files."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write_end, body())
            status = 0
        except BaseException as exc:
            os.write(write_end, f"child_error {exc!r}".encode())
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def _read_all(pid: int, read_end: int) -> bytes:
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return b"".join(chunks)


@needs_root
def test_idle_flood_by_one_uid_does_not_lock_out_root_or_another_users_job(
    run_daemon: Callable[..., RunningDaemon], short_dir: Path
) -> None:
    from gpuwatchd.hook import attach  # imported before the fork: nobody cannot read it

    sock_path = short_dir / "c.sock"
    daemon = run_daemon(args=["--socket", str(sock_path)])
    daemon.socket = sock_path
    daemon.env["GPUWATCHD_SOCKET"] = str(sock_path)
    os.chmod(sock_path, 0o666)  # let other users in at all; rights are per op

    hold_read, hold_write = os.pipe()

    def flood() -> bytes:
        os.close(hold_write)
        held = []
        for _ in range(320):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: waits for accept
            try:
                s.connect(str(sock_path))
            except OSError:
                s.close()
                continue
            held.append(s)
        os.write(ready_write, b"x")
        os.read(hold_read, 1)  # hold them until the parent is done
        return str(len(held)).encode()

    ready_read, ready_write = os.pipe()
    flooder, flood_out = _as_user(NOBODY, flood)
    os.close(hold_read)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"x"
        time.sleep(0.5)  # let the daemon accept (or refuse) them all
        status = daemon.ctl("--json", "status")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["pid"] == daemon.process.pid

        def job() -> bytes:
            with attach(job="other-users-job", knobs={"num_workers": 2}, socket=sock_path) as w:
                time.sleep(1.5)
                return b"attached" if w.connected else b"not attached"

        job_pid, job_out = _as_user(OTHER_USER, job)
        assert _read_all(job_pid, job_out) == b"attached"
        attached = [e for e in daemon.events() if e.get("event") == "control.job_attached"]
        assert [e["job"] for e in attached] == ["other-users-job"]
    finally:
        os.close(hold_write)
        os.close(ready_read)
        held = _read_all(flooder, flood_out)
    assert held == b"320", held  # connect() succeeds; the daemon closes the refused ones
    refused = [e for e in daemon.events() if e.get("event") == "control.too_many_connections"]
    assert len(refused) == 1, refused  # one line for nobody's uid this minute
    assert refused[0]["uid"] == NOBODY


# ---------------------------------------------------------------------- the server alone


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    debug = info = warning = error = _add


async def _status(request: Request, peer: PeerCredentials) -> Any:
    return {"state": "running"}


def _eof_within(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_silent_connections_close_and_job_sessions_stay(short_dir: Path) -> None:
    limits = ConnectionLimits(first_line_timeout_s=2.0, idle_timeout_s=3.0)
    log = Log()

    async def body() -> None:
        server = ControlServer(short_dir / "c.sock", _status, logger=log, limits=limits)
        await server.start()
        loop = asyncio.get_running_loop()

        def clients() -> None:
            silent = []
            for _ in range(50):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(server.path))
                silent.append(s)
            asker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            asker.connect(str(server.path))
            with ControlClient(server.path) as job, asker:
                job.call(
                    "hello", role="job", job="steady", pid=os.getpid(), cuda_devices=[], knobs={}
                )
                asker.sendall(b'{"id":1,"op":"status"}\n')
                assert b'"running"' in asker.recv(4096)
                assert all(_eof_within(s, 10.0) for s in silent)  # said nothing: closed
                time.sleep(3.5)  # past the idle timeout
                assert job.call("report", report=REPORT) == {}  # a job session stays
                assert job.connected
                assert _eof_within(asker, 10.0)  # asked once, then silent: closed
            for s in silent:
                s.close()

        try:
            await loop.run_in_executor(None, clients)
        finally:
            await server.close()

    asyncio.run(body())
    idle = [fields for event, fields in log.lines if event == "control.idle_closed"]
    assert len(idle) == 1 and idle[0]["uid"] == os.geteuid(), idle  # 51 closed, one line


def test_admission_per_uid_total_and_admin_reserve() -> None:
    admins = {0}
    admission = Admission(
        ConnectionLimits(max_connections=4, per_uid=2, admin_reserve=1),
        lambda peer: peer.uid in admins,
    )
    a, b, c, root = (PeerCredentials(pid=1, uid=u, gid=u) for u in (1000, 1001, 1002, 0))
    assert [admission.admit(a) for _ in range(3)] == [None, None, "per_uid"]
    assert [admission.admit(b) for _ in range(2)] == [None, None]
    assert admission.admit(c) == "total"
    assert admission.admit(root) is None  # the reserve
    assert admission.admit(root) == "total"
    admission.release(a)
    assert admission.admit(c) == "total"  # root's connections count too
    admission.release(root)
    assert admission.admit(c) is None


def test_log_limiter_counts_what_it_suppressed() -> None:
    now = [0.0]
    limiter = LogLimiter(interval_s=60.0, clock=lambda: now[0])
    assert limiter.due("k") == 0
    assert [limiter.due("k") for _ in range(5)] == [None] * 5
    assert limiter.due("other") == 0
    now[0] = 61.0
    assert limiter.due("k") == 5


@needs_root
def test_forbidden_ops_from_one_user_log_one_line_a_minute(short_dir: Path) -> None:
    """500 admin ops from a non-admin (nobody) are each refused; the log has one line."""
    log = Log()

    async def body() -> bytes:
        server = ControlServer(short_dir / "c.sock", _status, logger=log)
        await server.start()
        os.chmod(server.path, 0o666)  # let nobody in at all; rights are per op

        def attack() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(server.path))
                sock.sendall(b"".join(b'{"id":%d,"op":"pause"}\n' % i for i in range(500)))
                reader = sock.makefile("rb")
                return b"".join(reader.readline() for _ in range(500))

        try:
            pid, out = _as_user(NOBODY, attack)
            return await asyncio.get_running_loop().run_in_executor(None, _read_all, pid, out)
        finally:
            await server.close()

    replies = [json.loads(line) for line in asyncio.run(body()).splitlines()]
    assert len(replies) == 500
    assert {r["error"]["code"] for r in replies} == {"forbidden"}
    forbidden = [fields for event, fields in log.lines if event == "control.forbidden"]
    assert len(forbidden) == 1 and forbidden[0]["uid"] == NOBODY, forbidden
