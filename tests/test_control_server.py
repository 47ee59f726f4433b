"""ControlServer over real Unix sockets: job sessions, rights, daemon->job commands, robustness.

The server runs in an asyncio loop on a background thread; clients are the real blocking
ControlClient or raw sockets (to send what a well-behaved client never would).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import gpuwatchd
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.fairness import ConnectionLimits
from gpuwatchd.control.protocol import (
    ADMIN_OPS,
    MAX_LINE_BYTES,
    ErrorCode,
    Reply,
    Request,
    encode,
    error_reply,
    ok_reply,
)
from gpuwatchd.control.server import (
    MAX_WRITE_BUFFER_BYTES,
    ControlServer,
    PeerCredentials,
)
from gpuwatchd.errors import ControlError, GpuwatchError, ProtocolError
from gpuwatchd.model import JobReport, Knob

T = TypeVar("T")
NOBODY = 65534
"""uid/gid the root-only tests drop to (nobody/nogroup on Debian-like systems)."""


# ---------------------------------------------------------------------- harness


class RecordingLogger:
    """A structlog-style logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self.records.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, **fields)

    def events(self, level: str | None = None) -> list[str]:
        return [e for lv, e, _ in self.records if level is None or lv == level]


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def demo_handler(request: Request, peer: PeerCredentials) -> Any:
    """What a daemon's handler might do, enough to exercise the server."""
    if request.op == "status":
        return {
            "state": "running",
            "peer_pid": peer.pid,
            "peer_uid": peer.uid,
            "peer_groups": sorted(peer.groups),
        }
    if request.op == "boom":
        raise RuntimeError("kaput")
    if request.op == "big":
        return {"blob": "x" * 60_000}
    if request.op == "huge":
        return {"blob": "x" * (MAX_LINE_BYTES + 1)}
    if request.op == "unencodable":
        return {"pids": {1, 2}}
    if request.op == "sleep":
        await asyncio.sleep(float(request.params["seconds"]))
        return {"slept": True}
    if request.op in ADMIN_OPS:
        return {"done": request.op}
    raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {request.op!r}")


class LoopThread:
    """An asyncio loop running forever on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Harness:
    def __init__(self, loop: LoopThread, directory: Path) -> None:
        self.loop = loop
        self.dir = directory
        self.servers: list[ControlServer] = []

    def start(
        self,
        handler: Any = demo_handler,
        *,
        path: Path | None = None,
        **kwargs: Any,
    ) -> ControlServer:
        kwargs.setdefault("logger", RecordingLogger())
        server = ControlServer(path or self.dir / "control.sock", handler, **kwargs)
        self.loop.run(server.start())
        self.servers.append(server)
        return server

    def jobs(self, server: ControlServer) -> tuple[Any, ...]:
        return self.loop.call(server.jobs)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.loop.call(predicate):
                return
            time.sleep(0.01)
        raise AssertionError("condition not reached in time")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short, world-traversable directory (sun_path holds at most 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="gwctl-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def harness(short_dir: Path) -> Iterator[Harness]:
    loop = LoopThread()
    h = Harness(loop, short_dir)
    try:
        yield h
    finally:
        for server in h.servers:
            loop.run(server.close())
        loop.stop()


def raw(path: Path, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(os.fspath(path))
    return sock


def read_line(sock: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise EOFError(f"connection closed after {data!r}")
        data += chunk
    message: dict[str, Any] = json.loads(data)
    return message


def read_until_eof(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def hello(client: ControlClient, job: str = "digits", **overrides: Any) -> Any:
    params: dict[str, Any] = {
        "role": "job",
        "job": job,
        "pid": os.getpid(),
        "cuda_devices": ["0"],
        "knobs": {
            "num_workers": {"value": 2, "min": 0, "max": 8},
            "prefetch_factor": {"value": 2, "min": 1, "max": 16},
            "persistent_workers": {"value": False},
        },
        "study": "criteria",
        "trial": {"number": 7, "params": {"lr": 0.01}},
    }
    params.update(overrides)
    return client.call("hello", **params)


REPORT = {
    "steps": 120,
    "epoch": 1,
    "step_time_s": 0.25,
    "data_wait_s": 0.2,
    "data_wait_fraction": 0.8,
    "samples_per_s": 256.0,
}


def assert_still_serving(path: Path) -> None:
    with ControlClient(path, timeout_s=5) as other:
        assert other.call("status")["state"] == "running"


# ---------------------------------------------------------------------- basics


def test_status_goes_to_the_handler_with_the_peer_credentials(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client:
        status = client.call("status")
    assert status["state"] == "running"
    assert status["peer_pid"] == os.getpid()
    assert status["peer_uid"] == os.getuid()


def test_socket_file_is_a_0660_socket_of_the_socket_group_not_the_admin_group(
    harness: Harness,
) -> None:
    socket_gid = NOBODY if os.geteuid() == 0 else os.getegid()
    path = harness.dir / "run" / "gpuwatchd" / "control.sock"
    server = harness.start(path=path, socket_gid=socket_gid, admin_gid=4242)
    info = path.stat()
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert info.st_gid == socket_gid
    assert path.parent.is_dir()
    harness.loop.run(server.close())
    assert not path.exists(), "close() removes the socket file"
    harness.loop.run(server.close())  # idempotent


def test_unknown_op_is_the_handlers_unknown_op(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client, pytest.raises(ControlError) as err:
        client.call("frobnicate")
    assert err.value.code == "unknown_op"
    assert "frobnicate" in err.value.message


def test_handler_exception_becomes_internal_and_is_logged(harness: Harness) -> None:
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    with ControlClient(server.path) as client:
        with pytest.raises(ControlError) as err:
            client.call("boom")
        assert err.value.code == "internal"
        assert "RuntimeError" in err.value.message and "kaput" in err.value.message
        assert client.call("status")["state"] == "running", "same connection still served"
    assert "control.handler_failed" in logger.events("error")


def test_result_the_protocol_cannot_carry_becomes_an_error_reply(harness: Harness) -> None:
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    with ControlClient(server.path) as client:
        with pytest.raises(ControlError) as err:
            client.call("huge")
        assert err.value.code == "too_large"
        with pytest.raises(ControlError) as err:
            client.call("unencodable")
        assert err.value.code == "internal"
        assert client.call("status")["state"] == "running"
    assert logger.events("error").count("control.reply_unencodable") == 2


def test_job_command_op_sent_by_a_client_is_bad_request(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client, pytest.raises(ControlError) as err:
        client.call("set_knob", knob="num_workers", value=4)
    assert err.value.code == "bad_request"


# ---------------------------------------------------------------------- job sessions


def test_hello_and_report_make_the_job_visible_with_knobs_and_last_report(
    harness: Harness,
) -> None:
    clock = FakeClock(1_000.0)
    server = harness.start(clock=clock)
    with ControlClient(server.path) as job:
        welcome = hello(job)
        assert welcome["protocol"] == 1
        assert welcome["daemon_version"] == gpuwatchd.__version__
        assert isinstance(welcome["session"], int)

        (info,) = harness.jobs(server)
        assert info.name == "digits"
        assert info.pid == os.getpid()
        assert info.connected_at_s == 1_000.0
        assert info.cuda_devices == ("0",)
        assert info.study == "criteria"
        assert info.trial_number == 7
        assert info.knobs["num_workers"] == Knob("num_workers", 2, 0, 8)
        assert info.knobs["persistent_workers"] == Knob("persistent_workers", False)
        assert info.last_report is None

        clock.now = 1_005.5
        assert job.call("report", report=REPORT) == {}
        (info,) = harness.jobs(server)
        assert info.last_report == JobReport(timestamp_s=1_005.5, **REPORT)  # type: ignore[arg-type]

        with ControlClient(server.path) as second:
            hello(second, job="other", trial=None, study=None, knobs={})
            assert [j.name for j in harness.jobs(server)] == ["digits", "other"]
    harness.wait_for(lambda: server.jobs() == ())


def test_report_before_hello_is_bad_request(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client, pytest.raises(ControlError) as err:
        client.call("report", report=REPORT)
    assert err.value.code == "bad_request"
    assert "hello" in err.value.message


def test_second_hello_on_one_connection_is_conflict(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        with pytest.raises(ControlError) as err:
            hello(job, job="again")
        assert err.value.code == "conflict"
        assert [j.name for j in harness.jobs(server)] == ["digits"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"role": "admin"},
        {"job": ""},
        {"job": "j" * 129},
        {"job": 5},
        {"pid": "123"},
        {"pid": True},
        {"cuda_devices": [0]},
        {"cuda_devices": "0"},
        {"knobs": []},
        {"knobs": {f"k{i}": {"value": 1} for i in range(65)}},
        {"study": 3},
        {"trial": {"number": "7", "params": {}}},
        {"trial": {"number": -1}},
        {"trial": {"number": 7, "params": [1]}},
        {"trial": 7},
    ],
    ids=lambda o: json.dumps(o)[:40],
)
def test_malformed_hello_is_bad_request_and_nothing_attaches(
    harness: Harness, overrides: dict[str, Any]
) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        with pytest.raises(ControlError) as err:
            hello(job, **overrides)
        assert err.value.code == "bad_request"
        assert harness.jobs(server) == ()
        hello(job)  # the connection is still usable
        assert len(harness.jobs(server)) == 1


def test_a_refused_hello_is_logged_with_the_jobs_pid_never_silent(harness: Harness) -> None:
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    with ControlClient(server.path) as job, pytest.raises(ControlError):
        hello(job, job="digits", cuda_devices="0")
    (fields,) = [f for lv, e, f in logger.records if e == "control.hello_refused"]
    assert fields["pid"] == os.getpid() and fields["job"] == "digits"
    assert fields["error"] == "bad_request" and "cuda_devices" in fields["detail"]
    assert "control.hello_refused" in logger.events("warning")


def test_a_bad_knob_is_dropped_the_job_attaches_and_the_drop_is_logged(
    harness: Harness,
) -> None:
    """Issue 21: one malformed knob descriptor must not leave the job unwatched."""
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    with ControlClient(server.path) as job:
        knobs = {"num_workers": {"value": 2, "min": 0, "max": 8}, "lr": {"value": 9, "max": 4}}
        result = hello(job, job="digits", knobs=knobs)
        (attached,) = harness.jobs(server)
        assert set(attached.knobs) == {"num_workers"}
    assert result["dropped_knobs"] == [
        {"knob": "lr", "reason": "knob 'lr' value 9 is outside [None, 4]"}
    ]
    (fields,) = [f for lv, e, f in logger.records if e == "control.knobs_dropped"]
    assert fields["pid"] == os.getpid() and fields["job"] == "digits"
    assert fields["dropped"] == result["dropped_knobs"]
    assert "control.knobs_dropped" in logger.events("warning")
    assert not [e for lv, e, f in logger.records if e == "control.hello_refused"]


def test_a_boolean_knob_attaches_with_or_without_boolean_bounds(harness: Harness) -> None:
    """``persistent_workers`` (docs/hook.md) has no range: hooks send null bounds; hooks of
    0.1.0 sent False/True, which must not keep the job from attaching either."""
    server = harness.start()
    for bounds in ({"min": None, "max": None}, {"min": False, "max": True}):
        with ControlClient(server.path) as job:
            knobs = {"num_workers": {"value": 2}, "persistent_workers": {"value": True, **bounds}}
            hello(job, knobs=knobs)
            (attached,) = harness.jobs(server)
            knob = attached.knobs["persistent_workers"]
            assert (knob.value, knob.min, knob.max) == (True, None, None)
        harness.wait_for(lambda: server.jobs() == ())


def test_trial_without_a_number_attaches_without_one(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job, trial={"number": None, "params": {}})
        assert harness.jobs(server)[0].trial_number is None


def test_non_finite_knob_value_is_bad_request(harness: Harness) -> None:
    server = harness.start()
    with raw(server.path) as sock:
        line = (
            f'{{"id":1,"op":"hello","role":"job","job":"j","pid":{os.getpid()},'
            '"knobs":{"lr":{"value":1e400}}}\n'
        )
        sock.sendall(line.encode())
        reply = read_line(sock)
    assert reply["error"]["code"] == "bad_request"


@pytest.mark.parametrize(
    "change",
    [
        {"steps": -1},
        {"steps": 1.5},
        {"epoch": None},
        {"step_time_s": "fast"},
        {"data_wait_s": -0.1},
        {"data_wait_fraction": 1.5},
        {"samples_per_s": True},
    ],
    ids=lambda c: json.dumps(c),
)
def test_malformed_report_is_bad_request_and_keeps_the_last_good_one(
    harness: Harness, change: dict[str, Any]
) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        job.call("report", report=REPORT)
        with pytest.raises(ControlError) as err:
            job.call("report", report={**REPORT, **change, "steps": change.get("steps", 999)})
        assert err.value.code == "bad_request"
        (info,) = harness.jobs(server)
        assert info.last_report is not None and info.last_report.steps == 120


def test_report_with_a_missing_field_is_bad_request(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        partial = {k: v for k, v in REPORT.items() if k != "samples_per_s"}
        with pytest.raises(ControlError) as err:
            job.call("report", report=partial)
        assert err.value.code == "bad_request"
        assert "samples_per_s" in err.value.message


# ---------------------------------------------------------------------- daemon -> job


def serve_commands(
    job: ControlClient, answer: Callable[[Request], dict[str, Any]], count: int = 1
) -> threading.Thread:
    """A fake job thread: wait for `count` daemon requests and answer each."""

    def run() -> None:
        seen = 0
        deadline = time.monotonic() + 10
        while seen < count and time.monotonic() < deadline:
            for req in job.poll_requests(timeout_s=0.5):
                job.send(answer(req))
                seen += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_set_knob_is_applied_by_the_job_and_updates_the_knob(harness: Harness) -> None:
    clock = FakeClock(2_000.0)
    server = harness.start(clock=clock)
    received: list[Request] = []

    def apply(req: Request) -> dict[str, Any]:
        received.append(req)
        clock.now = 2_042.0  # the job applies it "at the next epoch"
        return ok_reply(req.id, {"knob": req.params["knob"], "value": req.params["value"]})

    with ControlClient(server.path) as job:
        hello(job)
        thread = serve_commands(job, apply)
        replies = harness.loop.run(
            server.send_command("digits", "set_knob", {"knob": "num_workers", "value": 4})
        )
        thread.join(5)
    assert len(received) == 1
    assert received[0].op == "set_knob"
    assert isinstance(received[0].id, str) and received[0].id.startswith("d-")
    assert received[0].params == {"knob": "num_workers", "value": 4}
    assert replies == [
        Reply(id=received[0].id, ok=True, result={"knob": "num_workers", "value": 4})
    ]


def test_set_knob_tells_the_job_who_asked(harness: Harness) -> None:
    server = harness.start()
    received: list[Request] = []

    def apply(req: Request) -> dict[str, Any]:
        received.append(req)
        return ok_reply(req.id, {"knob": req.params["knob"], "value": req.params["value"]})

    with ControlClient(server.path) as job:
        hello(job)
        thread = serve_commands(job, apply)
        harness.loop.run(
            server.send_command(
                "digits",
                "set_knob",
                {"knob": "num_workers", "value": 4},
                source="policy " + "p" * 300,
            )
        )
        thread.join(5)
    (request,) = received
    assert request.params == {
        "knob": "num_workers",
        "value": 4,
        "source": ("policy " + "p" * 300)[:200],
    }


def test_applied_knob_shows_in_jobs_with_applied_at(harness: Harness) -> None:
    clock = FakeClock(2_000.0)
    server = harness.start(clock=clock)
    with ControlClient(server.path) as job:
        hello(job)
        clock.now = 2_010.0
        thread = serve_commands(
            job, lambda req: ok_reply(req.id, {"knob": "num_workers", "value": 6, "epoch": 3})
        )
        harness.loop.run(
            server.send_command(
                "digits", "set_knob", {"knob": "num_workers", "value": 6}, source="operator"
            )
        )
        thread.join(5)
        (info,) = harness.jobs(server)
    assert info.knobs["num_workers"] == Knob(
        "num_workers", 6, 0, 8, applied_at_s=2_010.0, source="operator"
    )
    assert server.knob_memory.source_of("digits", "num_workers", 6) == "operator"
    assert info.knobs["prefetch_factor"].applied_at_s is None


def test_command_goes_to_every_connection_of_the_job_or_only_the_given_pid(
    harness: Harness,
) -> None:
    server = harness.start()
    with ControlClient(server.path) as first, ControlClient(server.path) as second:
        hello(first)
        hello(second)
        threads = [
            serve_commands(c, lambda req: ok_reply(req.id, {"drained": True}))
            for c in (first, second)
        ]
        replies = harness.loop.run(server.send_command("digits", "drain", {}))
        for t in threads:
            t.join(5)
        assert [r.ok for r in replies] == [True, True]
        with pytest.raises(ControlError) as err:
            harness.loop.run(server.send_command("digits", "drain", {}, pid=1))
        assert err.value.code == "not_found"


def test_job_error_reply_is_returned_as_is(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        thread = serve_commands(
            job, lambda req: error_reply(req.id, "bad_request", "num_workers must be >= 0")
        )
        (reply,) = harness.loop.run(
            server.send_command("digits", "set_knob", {"knob": "num_workers", "value": -1})
        )
        thread.join(5)
        assert (reply.ok, reply.error_code, reply.error_message) == (
            False,
            "bad_request",
            "num_workers must be >= 0",
        )
        assert harness.jobs(server)[0].knobs["num_workers"].value == 2


def test_command_to_unknown_job_is_not_found(harness: Harness) -> None:
    server = harness.start()
    with pytest.raises(ControlError) as err:
        harness.loop.run(server.send_command("nobody-home", "stop", {"reason": "test"}))
    assert err.value.code == "not_found"
    with pytest.raises(ControlError) as err:
        harness.loop.run(server.send_command("x", "pause", {}))
    assert err.value.code == "bad_request"


def test_command_times_out_when_the_job_never_answers(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        started = time.monotonic()
        (reply,) = harness.loop.run(
            server.send_command("digits", "stop", {"reason": "test"}, timeout_s=0.3)
        )
        assert time.monotonic() - started < 3
        assert (reply.ok, reply.error_code, reply.error_message) == (False, "internal", "timeout")
        (late,) = job.poll_requests(timeout_s=1)
        assert late.op == "stop"


def test_a_job_asked_for_again_after_each_change_shows_that_change(harness: Harness) -> None:
    """The server keeps each job's JobInfo between changes: every kind of change (a
    report, a new trial, a knob the job applied on the daemon's set_knob, a job gone and
    another come) shows in the very next jobs()."""
    clock = FakeClock(3_000.0)
    server = harness.start(clock=clock)
    with ControlClient(server.path) as job:
        hello(job)
        (first,) = harness.jobs(server)
        assert harness.jobs(server)[0] is first  # unchanged: the same object
        clock.now = 3_001.0
        assert job.call("report", report={**REPORT, "trial": {"number": 9}}) == {}
        (info,) = harness.jobs(server)
        assert (info.trial_number, info.last_report.timestamp_s) == (9, 3_001.0)  # type: ignore[union-attr]
        clock.now = 3_002.0
        thread = serve_commands(
            job, lambda req: ok_reply(req.id, {"knob": "num_workers", "value": 5})
        )
        harness.loop.run(
            server.send_command("digits", "set_knob", {"knob": "num_workers", "value": 5})
        )
        thread.join(5)
        (info,) = harness.jobs(server)
        assert info.knobs["num_workers"] == Knob(
            "num_workers", 5, 0, 8, applied_at_s=3_002.0, source="job"
        )
        assert first.knobs["num_workers"].value == 2  # what was handed out stays as it was
        with ControlClient(server.path) as second:
            hello(second, job="other", trial=None, study=None, knobs={})
            assert [j.name for j in harness.jobs(server)] == ["digits", "other"]
    harness.wait_for(lambda: server.jobs() == ())
    with ControlClient(server.path) as third:
        hello(third, job="third", trial=None, study=None, knobs={})
        assert [j.name for j in harness.jobs(server)] == ["third"]


def test_late_set_knob_reply_still_updates_the_knob(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        (reply,) = harness.loop.run(
            server.send_command(
                "digits", "set_knob", {"knob": "num_workers", "value": 3}, timeout_s=0.2
            )
        )
        assert reply.error_message == "timeout"
        (req,) = job.poll_requests(timeout_s=1)
        job.send(ok_reply(req.id, {"knob": "num_workers", "value": 3}))
        harness.wait_for(lambda: server.jobs()[0].knobs["num_workers"].value == 3)


def test_an_attached_job_carries_its_peer_uid(harness: Harness) -> None:
    # the kernel's word for who attached (SO_PEERCRED), what Slurm arrays are checked against
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        harness.wait_for(lambda: len(server.jobs()) == 1)
        assert server.jobs()[0].uid == os.getuid()


def test_command_to_a_job_that_disconnects_resolves_disconnected(harness: Harness) -> None:
    server = harness.start()
    job = ControlClient(server.path)
    hello(job)
    future = asyncio.run_coroutine_threadsafe(
        server.send_command("digits", "drain", {}, timeout_s=10), harness.loop.loop
    )
    assert job.poll_requests(timeout_s=2)[0].op == "drain"
    job.close()
    (reply,) = future.result(5)
    assert (reply.ok, reply.error_code, reply.error_message) == (False, "conflict", "disconnected")
    harness.wait_for(lambda: server.jobs() == ())


# ---------------------------------------------------------------------- rights


def test_is_admin_root_own_user_and_admin_group() -> None:
    server = ControlServer("/nonexistent/x.sock", demo_handler, admin_gid=4242)
    me = os.geteuid()
    stranger = 54321 if me != 54321 else 54322
    assert server.is_admin(PeerCredentials(pid=1, uid=0, gid=0))
    assert server.is_admin(PeerCredentials(pid=1, uid=me, gid=12345))
    assert server.is_admin(PeerCredentials(pid=1, uid=stranger, gid=4242))
    assert server.is_admin(
        PeerCredentials(pid=1, uid=stranger, gid=100, groups=frozenset({27, 4242}))
    )
    assert not server.is_admin(
        PeerCredentials(pid=1, uid=stranger, gid=100, groups=frozenset({27}))
    )
    no_group = ControlServer("/nonexistent/x.sock", demo_handler)
    assert not no_group.is_admin(PeerCredentials(pid=1, uid=stranger, gid=4242))


def test_admin_op_from_an_admin_reaches_the_handler(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client:  # the daemon's own user is an admin
        assert client.call("pause") == {"done": "pause"}
        assert client.call("knob", job="digits", knob="num_workers", value=4) == {"done": "knob"}


def _fork_child(
    path: Path,
    lines: list[bytes],
    *,
    uid: int | None = None,
    gid: int | None = None,
    groups: tuple[int, ...] = (),
) -> tuple[int, int]:
    """Fork a real child process that (as ``uid``/``gid``/``groups`` when given) connects to
    ``path``, sends each line ($PID/$PPID replaced by its own and its parent's pid) and reads
    one reply per line into a pipe. Returns (child pid, pipe read end).

    Call it with no other thread alive (fork copies only the calling thread)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: raw syscalls only, then _exit
        status = 1
        try:
            os.close(read_end)
            if uid is not None and gid is not None:
                os.setgroups(list(groups))
                os.setgid(gid)
                os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(os.fspath(path))
            out = b""
            for line in lines:
                line = line.replace(b"$PPID", str(os.getppid()).encode())
                sock.sendall(line.replace(b"$PID", str(os.getpid()).encode()))
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = sock.recv(1)
                    if not chunk:
                        break
                    reply += chunk
                out += reply
            os.write(write_end, out)
            status = 0
        except BaseException as exc:
            os.write(write_end, json.dumps({"child_error": repr(exc)}).encode() + b"\n")
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def _collect(pid: int, read_end: int) -> list[dict[str, Any]]:
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return [json.loads(line) for line in b"".join(chunks).splitlines()]


def run_child_against(
    server: ControlServer,
    lines: list[bytes],
    *,
    chmod: int | None = None,
    **who: Any,
) -> list[dict[str, Any]]:
    """Start ``server`` in a fresh loop on this thread, fork the child, serve until it is done."""

    async def body() -> list[dict[str, Any]]:
        await server.start()
        try:
            if chmod is not None:
                os.chmod(server.path, chmod)
            pid, read_end = _fork_child(server.path, lines, **who)
            return await asyncio.get_running_loop().run_in_executor(None, _collect, pid, read_end)
        finally:
            await server.close()

    return asyncio.run(body())


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as a second user needs root (setuid in a child)"
)


def test_a_job_may_only_speak_for_its_own_pid(short_dir: Path) -> None:
    """A real child process claims its parent's pid (another live process): forbidden.
    As root the child first becomes nobody, since root may speak for any pid."""
    root = os.geteuid() == 0
    server = ControlServer(
        short_dir / "c.sock",
        demo_handler,
        socket_gid=NOBODY if root else None,
        logger=RecordingLogger(),
    )
    who: dict[str, Any] = {"uid": NOBODY, "gid": NOBODY} if root else {}
    spoof, honest = run_child_against(
        server,
        [
            b'{"id":1,"op":"hello","role":"job","job":"spoof","pid":$PPID}\n',
            b'{"id":2,"op":"hello","role":"job","job":"honest","pid":$PID}\n',
        ],
        **who,
    )
    assert spoof == {
        "id": 1,
        "ok": False,
        "error": {"code": "forbidden", "message": "a job may only speak for its own pid"},
    }
    assert honest["ok"] is True, honest


def test_root_may_speak_for_another_pid(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client:
        if os.geteuid() == 0:
            hello(client, pid=1)
            assert harness.jobs(server)[0].pid == 1
        else:
            with pytest.raises(ControlError) as err:
                hello(client, pid=1)
            assert err.value.code == "forbidden"


@needs_root
def test_admin_op_from_another_user_is_forbidden_but_status_is_not(short_dir: Path) -> None:
    server = ControlServer(short_dir / "c.sock", demo_handler, logger=RecordingLogger())  # no admin
    status, pause, knob = run_child_against(
        server,
        [
            b'{"id":1,"op":"status"}\n',
            b'{"id":2,"op":"pause"}\n',
            b'{"id":3,"op":"knob","job":"j","knob":"num_workers","value":1}\n',
        ],
        chmod=0o666,  # let the other user in at all; rights are then decided per op
        uid=NOBODY,
        gid=NOBODY,
    )
    assert status["ok"] is True and status["result"]["peer_uid"] == NOBODY
    assert pause["error"]["code"] == "forbidden"
    assert knob["error"]["code"] == "forbidden"


@needs_root
def test_supplementary_admin_group_grants_admin_ops(short_dir: Path) -> None:
    """Supplementary groups count (SO_PEERGROUPS), not only the primary gid. The socket
    is given to the same group so that the child may connect at all."""
    admin_gid = 4242
    server = ControlServer(
        short_dir / "c.sock",
        demo_handler,
        admin_gid=admin_gid,
        socket_gid=admin_gid,
        logger=RecordingLogger(),
    )
    status, pause = run_child_against(
        server,
        [b'{"id":1,"op":"status"}\n', b'{"id":2,"op":"pause"}\n'],
        uid=NOBODY,
        gid=NOBODY,
        groups=(admin_gid,),
    )
    assert status["result"]["peer_groups"] == [admin_gid]
    assert pause == {"id": 2, "ok": True, "result": {"done": "pause"}}


@needs_root
def test_a_job_name_is_bound_to_the_user_attached_under_it(harness: Harness) -> None:
    """Another user cannot pose as an attached job (to draw its knob changes or report
    crashes in its name); under a free name it may attach."""
    server = harness.start()
    os.chmod(server.path, 0o666)
    with ControlClient(server.path) as owner:
        hello(owner, job="criteria-hpo")
        pid, read_end = _fork_child(
            server.path,
            [
                b'{"id":1,"op":"hello","role":"job","job":"criteria-hpo","pid":$PID}\n',
                b'{"id":2,"op":"hello","role":"job","job":"mine","pid":$PID}\n',
            ],
            uid=NOBODY,
            gid=NOBODY,
        )
        posing, own = _collect(pid, read_end)
    assert posing["error"]["code"] == "forbidden"
    assert "attached by another user" in posing["error"]["message"]
    assert own["ok"] is True


@pytest.mark.parametrize("name", ["-rf", "a b", "x;y", "$(id)", "", "é"])
def test_job_names_are_plain_words(harness: Harness, name: str) -> None:
    server = harness.start()
    with ControlClient(server.path) as client, pytest.raises(ControlError) as err:
        hello(client, job=name)
    assert err.value.code == "bad_request"


def test_hello_sizes_are_capped(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client:
        with pytest.raises(ControlError) as err:
            hello(client, cuda_devices=[str(i) for i in range(65)])
        assert err.value.code == "bad_request"
        knobs = {f"k{i}": {"value": 1} for i in range(65)}
        with pytest.raises(ControlError) as err:
            hello(client, knobs=knobs)
        assert err.value.code == "bad_request"


def test_events_are_rate_limited_per_connection(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client:
        hello(client)
        outcomes = []
        for _ in range(30):  # far faster than 10 per second
            try:
                client.call("event", event={"kind": "oom", "message": "flood"})
                outcomes.append("ok")
            except ControlError as exc:
                outcomes.append(exc.code)
    assert outcomes.count("ok") <= 12 and "conflict" in outcomes
    assert len(server.drain_events()) == outcomes.count("ok")


# ---------------------------------------------------------------------- robustness


def test_malformed_json_gets_bad_request_and_the_connection_stays_open(harness: Harness) -> None:
    server = harness.start()
    with raw(server.path) as sock:
        sock.sendall(b"{not json\n")
        reply = read_line(sock)
        assert reply["id"] is None and reply["ok"] is False
        assert reply["error"]["code"] == "bad_request"
        sock.sendall(b"[1, 2, 3]\n")
        assert read_line(sock)["error"]["code"] == "bad_request"
        sock.sendall(b'{"id": 9, "params": {}}\n')  # no op: the id is still echoed
        assert read_line(sock) == {
            "id": 9,
            "ok": False,
            "error": {
                "code": "bad_request",
                "message": "a message needs 'op' (request) or 'ok' (reply)",
            },
        }
        sock.sendall(b'{"op": "status"}\n')
        assert read_line(sock)["error"]["code"] == "bad_request"
        sock.sendall(b"\xff\xfe\n")
        assert read_line(sock)["error"]["code"] == "bad_request"
        sock.sendall(encode({"id": "s", "op": "status"}))
        assert read_line(sock)["result"]["state"] == "running"
    assert_still_serving(server.path)


def test_oversized_line_gets_too_large_and_only_that_connection_closes(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as bystander:
        assert bystander.call("status")["state"] == "running"
        with raw(server.path) as sock:
            sock.sendall(b'{"id":1,"op":"status","pad":"' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n')
            reply = read_line(sock)
            assert reply["id"] is None
            assert reply["error"]["code"] == "too_large"
            assert read_until_eof(sock) == b""
        assert bystander.call("status")["state"] == "running"


def test_line_of_exactly_max_bytes_is_accepted_one_more_is_not(harness: Harness) -> None:
    server = harness.start()
    head = b'{"id":1,"op":"status","pad":"'
    tail = b'"}\n'
    exact = head + b"x" * (MAX_LINE_BYTES - len(head) - len(tail)) + tail
    assert len(exact) == MAX_LINE_BYTES
    with raw(server.path) as sock:
        sock.sendall(exact)
        assert read_line(sock)["ok"] is True
        sock.sendall(exact[:-3] + b'x"}\n')
        assert read_line(sock)["error"]["code"] == "too_large"


def test_half_a_line_then_disconnect_does_nothing(harness: Harness) -> None:
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    with raw(server.path) as sock:
        sock.sendall(b'{"id":1,"op":"pau')
    with raw(server.path) as sock:
        sock.sendall(b'{"id":1,"op":"hello","role":"job","job":"half","pid":1')
    harness.wait_for(lambda: logger.events().count("control.disconnected") == 2)
    assert_still_serving(server.path)
    assert harness.jobs(server) == ()
    assert "control.bad_line" not in logger.events(), "half a line is not answered"
    assert "control.handler_failed" not in logger.events()


def test_slow_client_holding_half_a_line_does_not_block_others(harness: Harness) -> None:
    server = harness.start()
    with raw(server.path) as slow:
        slow.sendall(b'{"id":"slow","op":"sta')
        for _ in range(3):
            assert_still_serving(server.path)
        slow.sendall(b'tus"}\n')  # and it is still served once it finishes the line
        assert read_line(slow)["id"] == "slow"


def test_slow_handler_does_not_block_other_clients(harness: Harness) -> None:
    server = harness.start()
    with raw(server.path) as sleeper:
        sleeper.sendall(encode({"id": 1, "op": "sleep", "seconds": 1.0}))
        started = time.monotonic()
        assert_still_serving(server.path)
        assert time.monotonic() - started < 0.9
        assert read_line(sleeper)["result"] == {"slept": True}


def test_client_that_does_not_read_is_disconnected(harness: Harness) -> None:
    logger = RecordingLogger()
    server = harness.start(logger=logger)
    count = 2 * MAX_WRITE_BUFFER_BYTES // 60_000 + 20
    with raw(server.path, timeout=10) as hog:
        hog.sendall(b"".join(encode({"id": i, "op": "big"}) for i in range(count)))
        harness.wait_for(lambda: "control.slow_reader_disconnected" in logger.events())
        assert_still_serving(server.path)
        received = read_until_eof(hog)  # what the kernel had buffered, then EOF
        assert 0 < received.count(b"\n") < count
    assert_still_serving(server.path)


def test_connections_beyond_the_limit_are_closed_at_once(harness: Harness) -> None:
    server = harness.start(limits=ConnectionLimits(max_connections=2, admin_reserve=0))
    with ControlClient(server.path) as one, ControlClient(server.path) as two:
        one.call("status")
        two.call("status")
        with raw(server.path) as third:
            assert read_until_eof(third) == b""
        one.call("status")
    harness.wait_for(lambda: server.connection_count == 0)
    assert_still_serving(server.path)


# ---------------------------------------------------------------------- lifecycle


def test_stale_socket_file_is_replaced(harness: Harness) -> None:
    path = harness.dir / "control.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))  # a socket file nobody listens on: a daemon that died
    dead.close()
    assert stat.S_ISSOCK(path.stat().st_mode)
    server = harness.start(path=path)
    assert_still_serving(server.path)


def test_second_server_on_a_live_socket_refuses(harness: Harness) -> None:
    server = harness.start()
    second = ControlServer(server.path, demo_handler)
    with pytest.raises(GpuwatchError, match="another gpuwatchd is listening on"):
        harness.loop.run(second.start())
    assert_still_serving(server.path)


def test_a_regular_file_in_the_way_is_not_removed(harness: Harness) -> None:
    path = harness.dir / "control.sock"
    path.write_text("precious")
    server = ControlServer(path, demo_handler)
    with pytest.raises(GpuwatchError, match="not a socket"):
        harness.loop.run(server.start())
    assert path.read_text() == "precious"


def test_close_disconnects_everyone_and_clients_then_see_unavailable(harness: Harness) -> None:
    server = harness.start()
    client = ControlClient(server.path, timeout_s=2)
    hello(client)
    future = asyncio.run_coroutine_threadsafe(
        server.send_command("digits", "drain", {}), harness.loop.loop
    )
    client.poll_requests(timeout_s=2)
    harness.loop.run(server.close())
    (reply,) = future.result(5)
    assert reply.error_message == "disconnected"
    assert not server.path.exists()
    with pytest.raises(ControlError) as err:
        client.call("status")
    assert err.value.code == "unavailable"
    client.close()


def test_job_events_are_queued_for_the_next_tick_and_drained_once(tmp_path: Path) -> None:
    from gpuwatchd.model import JobEvent

    async def body() -> None:
        server = ControlServer(tmp_path / "s.sock", demo_handler)
        crash = JobEvent(1.0, "hpo", "crash", pid=42, crash_kind="cuda_assert")
        trial = JobEvent(2.0, "hpo", "trial", trial_number=7, trial_state="COMPLETE")
        server.post_event(crash)
        server.post_event(trial)
        assert server.drain_events() == (crash, trial)
        assert server.drain_events() == ()

    asyncio.run(body())


# ---------------------------------------------------------------------- job memory, knobs, events


CUDA_MEMORY = [
    {
        "device": 0,
        "allocated_bytes": 3 * 2**30,
        "reserved_bytes": 4 * 2**30,
        "peak_allocated_bytes": 5 * 2**30,
    }
]


def test_report_carries_cuda_memory_oom_count_knobs_and_trial(harness: Harness) -> None:
    from gpuwatchd.model import CudaMemory

    clock = FakeClock(2_000.0)
    server = harness.start(clock=clock)
    with ControlClient(server.path) as job:
        hello(job)
        clock.now = 2_003.0
        body = {
            **REPORT,
            "cuda_memory": CUDA_MEMORY,
            "oom_events": 2,
            "knobs": {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": False},
            "trial": {"number": 8, "params": {"lr": 0.02}},
        }
        assert job.call("report", report=body) == {}
        (info,) = harness.jobs(server)
    assert info.last_report is not None
    assert info.last_report.cuda_memory == (CudaMemory(0, 3 * 2**30, 4 * 2**30, 5 * 2**30),)
    assert info.last_report.oom_events == 2
    assert info.trial_number == 8
    # only the knob whose value changed is marked as applied (by the job itself)
    assert info.knobs["prefetch_factor"] == Knob(
        "prefetch_factor", 4, 1, 16, applied_at_s=2_003.0, source="job"
    )
    assert info.knobs["num_workers"] == Knob("num_workers", 2, 0, 8)
    assert info.knobs["persistent_workers"].applied_at_s is None


def test_report_without_the_optional_fields_keeps_defaults(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        job.call("report", report={**REPORT, "trial": None})
        (info,) = harness.jobs(server)
    assert info.last_report is not None
    assert (info.last_report.cuda_memory, info.last_report.oom_events) == ((), 0)
    assert info.trial_number is None  # trial: null says the job runs no trial now


def test_unknown_report_fields_are_ignored(harness: Harness) -> None:
    """Documented choice: a newer hook may send fields an older daemon does not know."""
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        assert job.call("report", report={**REPORT, "gpu_temperature_c": 80, "x": [1]}) == {}
        (info,) = harness.jobs(server)
    assert info.last_report is not None and info.last_report.steps == REPORT["steps"]


@pytest.mark.parametrize(
    "extra",
    [
        {"cuda_memory": {"device": 0}},
        {"cuda_memory": [{**CUDA_MEMORY[0], "device": -1}]},
        {"cuda_memory": [{**CUDA_MEMORY[0], "reserved_bytes": 1.5}]},
        {"cuda_memory": [{**CUDA_MEMORY[0], "allocated_bytes": True}]},
        {"cuda_memory": [{"device": 0, "allocated_bytes": 1, "reserved_bytes": 1}]},
        {"cuda_memory": [CUDA_MEMORY[0], CUDA_MEMORY[0]]},
        {"cuda_memory": [{**CUDA_MEMORY[0], "device": i} for i in range(65)]},
        {"oom_events": -1},
        {"oom_events": "1"},
        {"knobs": [1]},
        {"knobs": {"learning_rate": 0.1}},
        {"knobs": {"num_workers": 100}},
        {"knobs": {"num_workers": True}},
        {"knobs": {"persistent_workers": 1}},
        {"trial": 8},
        {"trial": {"number": -2}},
    ],
    ids=lambda e: json.dumps(e)[:50],
)
def test_malformed_optional_report_fields_are_bad_request_and_change_nothing(
    harness: Harness, extra: dict[str, Any]
) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        job.call("report", report=REPORT)
        with pytest.raises(ControlError) as err:
            job.call(
                "report", report={**REPORT, "steps": 999, "knobs": {"num_workers": 3}, **extra}
            )
        assert err.value.code == "bad_request"
        (info,) = harness.jobs(server)
    assert info.last_report is not None and info.last_report.steps == 120
    assert info.knobs["num_workers"].value == 2  # not half applied
    assert info.trial_number == 7


def test_job_events_become_job_events_stamped_by_the_server(harness: Harness) -> None:
    from gpuwatchd.model import JobEvent

    clock = FakeClock(3_000.0)
    server = harness.start(clock=clock)
    with ControlClient(server.path) as job:
        hello(job)  # trial 7
        clock.now = 3_001.0
        job.call("event", event={"kind": "oom", "message": "CUDA out of memory. Tried ..."})
        job.call("event", event={"kind": "trial", "trial_state": "PRUNED", "future": 1})
        job.call(
            "event",
            event={"kind": "crash", "crash_kind": "cuda_assert", "trial_number": 9, "message": ""},
        )
        events = harness.loop.call(server.drain_events)
    pid = os.getpid()
    assert events == (
        JobEvent(
            3_001.0,
            "digits",
            "oom",
            pid=pid,
            trial_number=7,
            message="CUDA out of memory. Tried ...",
        ),
        JobEvent(3_001.0, "digits", "trial", pid=pid, trial_number=7, trial_state="PRUNED"),
        JobEvent(3_001.0, "digits", "crash", pid=pid, crash_kind="cuda_assert", trial_number=9),
    )


@pytest.mark.parametrize(
    "event",
    [
        None,
        [1],
        {},
        {"kind": "explosion"},
        {"kind": "trial"},
        {"kind": "trial", "trial_state": "RUNNING"},
        {"kind": "trial", "trial_state": "complete"},
        {"kind": "crash"},
        {"kind": "crash", "crash_kind": "segfault"},
        {"kind": "oom", "trial_number": -1},
        {"kind": "oom", "trial_number": "3"},
        {"kind": "oom", "message": 5},
        {"kind": "oom", "message": "x" * 1001},
    ],
    ids=lambda e: json.dumps(e)[:40],
)
def test_malformed_event_is_bad_request_and_posts_nothing(harness: Harness, event: object) -> None:
    server = harness.start()
    with ControlClient(server.path) as job:
        hello(job)
        with pytest.raises(ControlError) as err:
            job.call("event", event=event)
        assert err.value.code == "bad_request"
        job.call("event", event={"kind": "oom"})  # the connection is still usable
        events = harness.loop.call(server.drain_events)
    assert [e.kind for e in events] == ["oom"]


def test_event_before_hello_is_bad_request(harness: Harness) -> None:
    server = harness.start()
    with ControlClient(server.path) as client, pytest.raises(ControlError) as err:
        client.call("event", event={"kind": "oom"})
    assert err.value.code == "bad_request" and "hello" in err.value.message
    assert harness.loop.call(server.drain_events) == ()


def test_a_crash_event_names_the_slurm_array_task_of_its_hello(harness: Harness) -> None:
    server = harness.start(clock=FakeClock(3_000.0))
    slurm = {"job_id": "31", "array_job_id": "28", "array_task_id": 3}
    with ControlClient(server.path) as job:
        hello(job, slurm=slurm)
        job.call("event", event={"kind": "crash", "crash_kind": "cuda_assert"})
        job.call("event", event={"kind": "trial", "trial_state": "FAIL"})
        crash, trial = harness.loop.call(server.drain_events)
    assert (crash.slurm_job, trial.slurm_job) == ("28_3", None)  # the task requeue_task acts on
