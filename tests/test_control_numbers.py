"""Numbers a client sends are range-checked at the protocol edge: an integer beyond
SQLite's 64-bit INTEGER or a float JSON cannot carry is ``bad_request``, never
``internal`` with a traceback in the log. Against a real daemon over its real socket."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable

from conftest import RunningDaemon

HUGE = 18446744073709551616  # 2**64
FRAMES = [
    {"op": "events", "after_id": HUGE},
    {"op": "events", "after_id": 2**63},
    {"op": "events", "since_s": int("9" * 400)},
    {"op": "events", "limit": -HUGE},
    {"op": "knob", "job": "j", "knob": "num_workers", "value": HUGE},
    {"op": "knob", "job": "j", "knob": "num_workers", "value": 1, "wait_s": HUGE},
    {"op": "hello", "role": "job", "job": "j", "pid": HUGE},
    {"op": "hello", "role": "job", "job": "j", "pid": 2**40},
    {"op": "status", "extra": -(10**30)},
]


def test_out_of_range_numbers_are_bad_request_and_leave_no_traceback(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(daemon.socket))
        replies = sock.makefile("rb")
        for number, frame in enumerate(FRAMES, 1):
            sock.sendall(json.dumps({"id": number, **frame}).encode() + b"\n")
            reply = json.loads(replies.readline())
            assert reply["ok"] is False, (frame, reply)
            assert reply["error"]["code"] == "bad_request", (frame, reply)
            assert len(reply["error"]["message"]) < 300
        # a 400-digit float and an id beyond 64 bits, written by hand
        sock.sendall(b'{"id":90,"op":"events","since_s":' + b"9" * 400 + b".5}\n")
        assert json.loads(replies.readline())["error"]["code"] == "bad_request"
        sock.sendall(b'{"id":' + str(HUGE).encode() + b',"op":"status"}\n')
        assert json.loads(replies.readline())["error"]["code"] == "bad_request"
        sock.sendall(b'{"id":91,"op":"events","after_id":3}\n')  # the connection still serves
        assert json.loads(replies.readline())["ok"] is True
    log = daemon.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "handler_failed" not in log and "internal" not in log


def test_an_ordinary_pid_and_large_ids_within_range_still_work(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    pid = os.getpid()  # not a parameter: pytest-xdist's workers must collect the same ids
    daemon = run_daemon()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(daemon.socket))
        replies = sock.makefile("rb")
        sock.sendall(json.dumps({"id": 2**63 - 1, "op": "events", "after_id": 2**63 - 1}).encode())
        sock.sendall(b"\n")
        reply = json.loads(replies.readline())
        assert reply["id"] == 2**63 - 1 and reply["ok"] is True and reply["result"]["events"] == []
        hello = {"id": 2, "op": "hello", "role": "job", "job": "j", "pid": pid}
        sock.sendall(json.dumps(hello).encode() + b"\n")
        assert json.loads(replies.readline())["ok"] is True
