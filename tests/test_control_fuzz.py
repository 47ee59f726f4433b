"""Fuzzing the control protocol against a real daemon: seeded frames (random bytes,
truncated JSON, wrong types, unknown ops, huge numbers, NaN, deep nesting, invalid UTF-8,
mutated requests), pipelined over a few connections: 20,000 in ``make test``, 100,000 in
``make test-long`` (the same seed: the first 20,000 are the same frames). Every frame is
answered or refused with a stable code, never ``internal``, and a well-behaved client's
requests are answered throughout."""

from __future__ import annotations

import contextlib
import json
import random
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import RunningDaemon
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import MAX_LINE_BYTES, ErrorCode

SEED = 20261125
CONNECTIONS = 4
BATCH = 250
"""Frames written to one connection before its replies are read back (pipelined)."""

OPS = [
    "status", "jobs", "events", "policy.show", "hello", "report", "event", "knob",
    "pause", "resume", "set_knob", "drain", "stop", "", "STATUS", "status ", "x" * 65,
]  # fmt: skip
KEYS = [
    "job", "pid", "role", "knobs", "cuda_devices", "trial", "study", "report", "kind",
    "after_id", "since_s", "limit", "knob", "value", "wait_s", "path", "steps",
    "trial_state", "crash_kind", "message", "\u00e9", "",
]  # fmt: skip
NUMBERS = [
    "18446744073709551616", "-9223372036854775809", "9" * 400, "1e999", "-1e999", "NaN",
    "Infinity", "-Infinity", "1e-400", "0.0", "-0", "1" * 4400, "2.5e308", "0x10", "01",
]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, 5e-324, rng.uniform(-1e6, 1e6)])
    if kind == 4:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(0, 12)))
    if kind == 5:
        return rng.choice(["fz-a", "fz-b", "num_workers", "COMPLETE", "oom", "job", ""])
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _request(rng: random.Random, number: int) -> dict[str, Any]:
    op = rng.choice(OPS)
    message: dict[str, Any] = {"id": rng.choice([number, str(number), number])}
    message["op"] = op
    for _ in range(rng.randrange(0, 4)):
        message[rng.choice(KEYS)] = _value(rng)
    if op == "hello":
        message.update(role="job", job=rng.choice(["fz-a", "fz-b", "-bad", "x" * 200]))
    if op == "knob":  # jobs named kn-* never attach: a knob never waits on a fuzz connection
        message["job"] = rng.choice(["kn-a", 3, None])
    message.pop("path", None)  # root may name a policy path: keep reloads off the fuzz
    return message


def _frame(rng: random.Random, number: int) -> bytes:
    """One fuzz line (without its newline); never blank, never longer than the limit."""
    kind = rng.randrange(100)
    if kind < 15:  # random bytes
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 120)))
        data = data.replace(b"\n", b"?")
    elif kind < 40:  # a request with wrong types and odd values
        data = json.dumps(_request(rng, number)).encode()
    elif kind < 50:  # truncated
        data = json.dumps(_request(rng, number)).encode()
        data = data[: rng.randrange(1, max(2, len(data)))]
    elif kind < 62:  # huge numbers, NaN, Infinity written into a field
        field = rng.choice([*KEYS, "id"])
        op = rng.choice(["events", "status", "knob", "hello", "report"])
        data = f'{{"id":{number},"op":"{op}","{field}":{rng.choice(NUMBERS)}}}'.encode()
    elif kind < 64:  # deep nesting
        depth = rng.choice([100, 1000, 20_000, 30_000])
        data = f'{{"id":{number},"op":"status","x":'.encode() + b"[" * depth + b"]" * depth
        data += b"}"
    elif kind < 72:  # invalid UTF-8 in a string
        data = f'{{"id":{number},"op":"status","job":"'.encode() + b"\xff\xfe\xc3(" + b'"}'
    elif kind < 88:  # a mutated request
        data = bytearray(json.dumps(_request(rng, number)).encode())
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data).replace(b"\n", b"?")
    elif kind < 92:  # not an object
        data = rng.choice([b"[]", b"1", b'"op"', b"null", b"true", b"{}", b'{"id":1}'])
    else:  # well-formed reads
        op = rng.choice(["status", "jobs", "policy.show", "events"])
        data = json.dumps({"id": number, "op": op}).encode()
    if not data.strip() or b'"ok"' in data:  # a blank line or a reply gets no answer
        data = b"#" + data.replace(b'"ok"', b'"no"')
    return data[: MAX_LINE_BYTES - 1]


def _frames(rng: random.Random, count: int) -> Iterator[bytes]:
    for number in range(count):
        yield _frame(rng, number)


def _read_replies(sock: socket.socket, buffer: bytearray, count: int) -> list[dict[str, Any]]:
    replies = []
    while len(replies) < count:
        end = buffer.find(b"\n")
        if end < 0:
            chunk = sock.recv(1 << 20)
            assert chunk, f"connection closed after {len(replies)} of {count} replies"
            buffer += chunk
            continue
        line = bytes(buffer[:end])
        del buffer[: end + 1]
        replies.append(json.loads(line))
    return replies


@pytest.mark.parametrize("count", [20_000, pytest.param(100_000, marks=pytest.mark.long)])
def test_fuzzed_frames_are_all_answered_with_stable_codes(
    run_daemon: Callable[..., RunningDaemon], count: int
) -> None:
    daemon = run_daemon()
    rng = random.Random(SEED)
    frames = _frames(rng, count)
    socks = []
    for _ in range(CONNECTIONS):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)  # a safety net against a hang, not a measure
        sock.connect(str(daemon.socket))
        socks.append(sock)
    buffers = [bytearray() for _ in socks]
    codes: dict[str, int] = {}
    sent = 0
    with ControlClient(daemon.socket, timeout_s=30) as watcher:
        while sent < count:
            for sock, buffer in zip(socks, buffers, strict=True):
                batch = [f for _, f in zip(range(BATCH), frames, strict=False)]
                if not batch:
                    break
                sock.sendall(b"\n".join(batch) + b"\n")
                sent += len(batch)
                for reply in _read_replies(sock, buffer, len(batch)):
                    if reply["ok"] is False:
                        code = reply["error"]["code"]
                        assert code in ErrorCode.ALL and code != ErrorCode.INTERNAL, reply
                        codes[code] = codes.get(code, 0) + 1
            # a well-behaved client is answered throughout
            assert watcher.call("status")["pid"] == daemon.process.pid
    for sock in socks:
        sock.close()
    assert sent == count
    assert codes.get(ErrorCode.BAD_REQUEST, 0) > count // 4  # the fuzz did reach the checks
    assert daemon.process.poll() is None
    log = daemon.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "handler_failed" not in log


def test_oversize_lines_are_refused_and_the_daemon_serves_on(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon()
    for size in (MAX_LINE_BYTES - 1, MAX_LINE_BYTES, MAX_LINE_BYTES + 1, 4 * MAX_LINE_BYTES):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(str(daemon.socket))
            line = b'{"id":1,"op":"status","pad":"' + b"x" * size + b'"}\n'
            # the daemon may answer the first 64 KiB and close before the rest has come
            with contextlib.suppress(BrokenPipeError):
                sock.sendall(line)
            reply = json.loads(sock.makefile("rb").readline())
            assert reply["ok"] is False and reply["error"]["code"] == "too_large"
    with ControlClient(daemon.socket) as client:
        assert client.call("status")["pid"] == daemon.process.pid
