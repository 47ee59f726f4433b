"""Protocol v1 framing and message rules (pure: no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatchd.control.protocol import (
    ADMIN_OPS,
    CLIENT_OPS,
    JOB_COMMAND_OPS,
    JOB_OPS,
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Reply,
    Request,
    decode_line,
    encode,
    error_reply,
    ok_reply,
    parse_reply,
    request,
)
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import NA


def padded_request(total_bytes: int) -> bytes:
    """A valid request line (newline included) of exactly ``total_bytes`` bytes."""
    head, tail = b'{"id":1,"op":"status","pad":"', b'"}\n'
    return head + b"x" * (total_bytes - len(head) - len(tail)) + tail


# ---------------------------------------------------------------------- vocabulary


def test_error_codes_are_the_stable_v1_set() -> None:
    assert {
        "bad_request",
        "unknown_op",
        "forbidden",
        "not_found",
        "conflict",
        "too_large",
        "internal",
    } == ErrorCode.ALL


def test_op_families_match_the_design_table_and_do_not_overlap() -> None:
    assert PROTOCOL_VERSION == 1
    assert MAX_LINE_BYTES == 64 * 1024
    assert {"hello", "report", "event"} == JOB_OPS
    assert {"status", "jobs", "policy.show", "events"} == CLIENT_OPS
    assert {
        "policy.reload",
        "knob",
        "pause",
        "resume",
        "job.start",
        "job.stop",
        "job.restart",
        "gpu.cordon",
        "gpu.uncordon",
        "node.resume",
    } == ADMIN_OPS
    assert {"set_knob", "drain", "stop"} == JOB_COMMAND_OPS
    families = [JOB_OPS, CLIENT_OPS, ADMIN_OPS, JOB_COMMAND_OPS]
    assert sum(len(f) for f in families) == len(frozenset().union(*families))


# ---------------------------------------------------------------------- encode


def test_encode_is_one_compact_line() -> None:
    line = encode(request(7, "knob", job="digits", knob="num_workers", value=4))
    assert line == b'{"id":7,"op":"knob","job":"digits","knob":"num_workers","value":4}\n'
    assert line.count(b"\n") == 1


def test_encode_escapes_newlines_inside_strings() -> None:
    line = encode(request(1, "echo", text="two\nlines"))
    assert line.count(b"\n") == 1
    assert decode_line(line).params == {"text": "two\nlines"}  # type: ignore[union-attr]


def test_encode_sends_na_as_null_and_tuples_as_lists() -> None:
    assert json.loads(encode({"utilization_gpu_pct": NA, "devices": ("0", "1")})) == {
        "utilization_gpu_pct": None,
        "devices": ["0", "1"],
    }


def test_encode_limit_counts_the_newline() -> None:
    assert len(encode(json.loads(padded_request(MAX_LINE_BYTES)))) == MAX_LINE_BYTES
    with pytest.raises(ProtocolError) as err:
        encode(json.loads(padded_request(MAX_LINE_BYTES + 1)))
    assert err.value.code == "too_large"


@pytest.mark.parametrize("value", [object(), {1, 2}, b"bytes", float("nan"), float("inf")])
def test_encode_refuses_what_json_cannot_carry(value: Any) -> None:
    with pytest.raises(ProtocolError) as err:
        encode({"id": 1, "ok": True, "result": value})
    assert err.value.code == "internal"


# ---------------------------------------------------------------------- decode


def test_decode_request_splits_id_op_and_params() -> None:
    message = decode_line(b'{"id":"a-1","op":"hello","role":"job","pid":42}\n')
    assert message == Request(id="a-1", op="hello", params={"role": "job", "pid": 42})


def test_decode_tolerates_crlf() -> None:
    assert decode_line(b'{"id":1,"op":"status"}\r\n') == Request(1, "status", {})


def test_decode_replies() -> None:
    assert decode_line(b'{"id":"d-3","ok":true,"result":{"knob":"x","value":2}}') == Reply(
        id="d-3", ok=True, result={"knob": "x", "value": 2}
    )
    assert decode_line(
        b'{"id":null,"ok":false,"error":{"code":"too_large","message":"big"}}'
    ) == Reply(id=None, ok=False, error_code="too_large", error_message="big")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{not json", "line is not JSON"),
        (b"", "line is not JSON"),
        (b"NaN", "line is not JSON"),
        (b'{"id":1,"op":"x","v":Infinity}', "line is not JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1,2]", "must be a JSON object"),
        (b'"status"', "must be a JSON object"),
        (b'{"id":1}', "needs 'op' (request) or 'ok' (reply)"),
        (b'{"op":"status"}', "needs an 'id'"),
        (b'{"id":null,"op":"status"}', "'id' must be"),
        (b'{"id":true,"op":"status"}', "'id' must be"),
        (b'{"id":1.5,"op":"status"}', "'id' must be"),
        (b'{"id":[1],"op":"status"}', "'id' must be"),
        (b'{"id":"' + b"i" * 129 + b'","op":"status"}', "longer than 128"),
        (b'{"id":1,"op":""}', "'op' must be"),
        (b'{"id":1,"op":7}', "'op' must be"),
        (b'{"id":1,"op":"' + b"o" * 65 + b'"}', "'op' must be"),
        (b'{"id":1,"ok":"yes"}', "'ok' must be a boolean"),
        (b'{"id":1,"ok":false}', "needs an 'error' object"),
        (b'{"id":1,"ok":false,"error":"nope"}', "needs an 'error' object"),
        (b"[" * 30_000, "line is not JSON"),  # deep nesting: RecursionError, not a crash
    ],
)
def test_decode_rejects_malformed_lines_as_bad_request(line: bytes, message: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_line(line)
    assert err.value.code == "bad_request"
    assert message in err.value.message


def test_decode_accepts_the_longest_id_and_op() -> None:
    line = b'{"id":"' + b"i" * 128 + b'","op":"' + b"o" * 64 + b'"}'
    message = decode_line(line)
    assert isinstance(message, Request) and len(message.op) == 64


def test_decode_rejects_oversized_lines_as_too_large() -> None:
    with pytest.raises(ProtocolError) as err:
        decode_line(padded_request(MAX_LINE_BYTES + 100))
    assert err.value.code == "too_large"
    assert isinstance(decode_line(padded_request(MAX_LINE_BYTES)), Request)


def test_decode_limit_counts_the_newline_like_encode() -> None:
    with pytest.raises(ProtocolError):
        decode_line(padded_request(MAX_LINE_BYTES + 1))


def test_decode_rejects_numbers_that_overflow_to_infinity() -> None:
    with pytest.raises(ProtocolError):
        decode_line(b'{"id":1,"op":"report","v":1e400}')


def test_parse_reply_keeps_unknown_codes_as_text() -> None:
    reply = parse_reply({"id": 4, "ok": False, "error": {"code": 5}})
    assert (reply.error_code, reply.error_message) == ("5", "")


# ---------------------------------------------------------------------- builders


def test_ok_reply_defaults_to_an_empty_object_but_keeps_falsy_results() -> None:
    assert ok_reply(1) == {"id": 1, "ok": True, "result": {}}
    assert ok_reply(1, []) == {"id": 1, "ok": True, "result": []}
    assert ok_reply(1, 0)["result"] == 0


def test_error_reply_maps_unknown_codes_to_internal_and_caps_the_message() -> None:
    assert error_reply(2, "forbidden", "no") == {
        "id": 2,
        "ok": False,
        "error": {"code": "forbidden", "message": "no"},
    }
    assert error_reply(None, "teapot", "x")["error"]["code"] == "internal"
    assert len(error_reply(3, "internal", "m" * 5000)["error"]["message"]) == 1000


# ---------------------------------------------------------------------- round trips

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
ids = st.integers(min_value=-(2**53), max_value=2**53) | st.text(max_size=128)
ops = st.text(min_size=1, max_size=64)
params = st.dictionaries(
    st.text(max_size=10).filter(lambda k: k not in ("id", "op")), json_values, max_size=5
)


@given(request_id=ids, op=ops, fields=params)
def test_request_round_trip(request_id: str | int, op: str, fields: dict[str, Any]) -> None:
    line = encode(request(request_id, op, **fields))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_line(line) == Request(id=request_id, op=op, params=fields)


@given(request_id=st.none() | ids, result=json_values)
def test_ok_reply_round_trip(request_id: str | int | None, result: Any) -> None:
    expected = {} if result is None else result
    assert decode_line(encode(ok_reply(request_id, result))) == Reply(
        id=request_id, ok=True, result=expected
    )


@given(
    request_id=st.none() | ids,
    code=st.sampled_from(sorted(ErrorCode.ALL)),
    message=st.text(max_size=50),
)
def test_error_reply_round_trip(request_id: str | int | None, code: str, message: str) -> None:
    assert decode_line(encode(error_reply(request_id, code, message))) == Reply(
        id=request_id, ok=False, error_code=code, error_message=message
    )


@given(st.binary(max_size=200))
def test_decode_never_raises_anything_but_protocol_error(line: bytes) -> None:
    try:
        decode_line(line)
    except ProtocolError as exc:
        assert exc.code in ErrorCode.ALL
