"""Job messages of protocol v1 checked without sockets (gpuwatchd.control.messages): what a
hook sends is accepted as the named value the server stores, and every malformed field is
refused with ``bad_request`` and a message naming it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpuwatchd.control import messages
from gpuwatchd.control.messages import (
    Hello,
    KnobApplied,
    parse_event,
    parse_hello,
    parse_report,
    parse_set_knob_result,
    salvage_id,
)
from gpuwatchd.control.protocol import EVENT_MESSAGE_MAX_CHARS, ErrorCode
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import CudaMemory, Knob

HELLO: dict[str, Any] = {
    "role": "job",
    "job": "resnet.sweep-1",
    "pid": 4242,
    "cuda_devices": ["GPU-1b2c", "0"],
    "knobs": {
        "num_workers": {"value": 4, "min": 0, "max": 16},
        "pin_memory": {"value": False},
    },
    "study": "sweep",
    "trial": {"number": 3, "params": {"lr": 0.1}},
}
REPORT: dict[str, Any] = {
    "steps": 120,
    "epoch": 1,
    "step_time_s": 0.25,
    "data_wait_s": 0.1,
    "data_wait_fraction": 0.4,
    "samples_per_s": 512.0,
}
DECLARED = {"num_workers": Knob("num_workers", 4, 0, 16), "pin_memory": Knob("pin_memory", False)}


def _allow(_name: str, _pid: int) -> None:
    return None


def _refused(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ProtocolError) as caught:
        call(*args, **kwargs)
    assert caught.value.code == ErrorCode.BAD_REQUEST
    return caught.value.message


def test_a_hook_hello_becomes_a_hello() -> None:
    hello = parse_hello(HELLO, authorize=_allow)
    assert hello == Hello(
        job="resnet.sweep-1",
        pid=4242,
        cuda_devices=("GPU-1b2c", "0"),
        knobs={
            "num_workers": Knob("num_workers", 4, 0, 16),
            "pin_memory": Knob("pin_memory", False),
        },
        study="sweep",
        trial_number=3,
    )
    bare = parse_hello({"role": "job", "job": "j", "pid": 1}, authorize=_allow)
    assert (bare.cuda_devices, bare.knobs, bare.study, bare.trial_number) == ((), {}, None, None)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"role": "admin"}, "role"),
        ({"job": "-rf"}, "'job'"),
        ({"job": "a/b"}, "'job'"),
        ({"job": "x" * 129}, "'job'"),
        ({"pid": 0}, "'pid'"),
        ({"pid": True}, "'pid'"),
        ({"cuda_devices": "0"}, "'cuda_devices'"),
        ({"cuda_devices": ["x" * 65]}, "'cuda_devices'"),
        ({"knobs": {f"k{i}": {"value": 1} for i in range(65)}}, "at most 64 knobs"),
        ({"knobs": ["num_workers"]}, "'knobs' must be an object"),
        ({"study": 5}, "'study'"),
        ({"trial": {"number": -1}}, "'trial.number'"),
        ({"trial": {"number": 1, "params": [1]}}, "'trial.params'"),
    ],
)
def test_a_bad_hello_is_refused_naming_the_field(change: dict[str, Any], names: str) -> None:
    assert names in _refused(parse_hello, {**HELLO, **change}, authorize=_allow)


@pytest.mark.parametrize(
    ("name", "spec", "names"),
    [
        ("", {"value": 1}, "knob names"),
        ("k" * 65, {"value": 1}, "knob names must be 1..64"),
        ("k", 4, "knob 'k' must be {value"),
        ("k", {"value": "4"}, "knob 'k' must be {value"),
        ("k", {"value": math.nan}, "knob 'k' must be {value"),
        ("k", {"value": 1, "min": "0"}, "knob 'k' 'min' must be a number"),
        ("k", {"value": 1, "min": 2, "max": 1}, "min > max"),
        ("k", {"value": 9, "max": 4}, "outside"),
    ],
)
def test_a_bad_knob_is_dropped_with_its_reason_and_the_others_attach(
    name: str, spec: object, names: str
) -> None:
    """One malformed knob descriptor no longer refuses the whole hello (issue 21): the
    job attaches with the valid knobs and the hello names the dropped one."""
    knobs = {**HELLO["knobs"], name: spec}
    hello = parse_hello({**HELLO, "knobs": knobs}, authorize=_allow)
    assert set(hello.knobs) == {"num_workers", "pin_memory"}
    (dropped,) = hello.dropped_knobs
    assert dropped.knob == name and names in dropped.reason
    assert dropped.as_reply() == {"knob": name, "reason": dropped.reason}


def test_rights_are_checked_once_name_and_pid_are_valid_before_the_rest() -> None:
    seen: list[tuple[str, int]] = []

    def forbid(name: str, pid: int) -> None:
        seen.append((name, pid))
        raise ProtocolError(ErrorCode.FORBIDDEN, "not yours")

    with pytest.raises(ProtocolError) as caught:
        parse_hello({**HELLO, "knobs": "garbage"}, authorize=forbid)
    assert caught.value.code == ErrorCode.FORBIDDEN
    assert seen == [("resnet.sweep-1", 4242)]
    _refused(parse_hello, {**HELLO, "pid": -1}, authorize=forbid)  # shape of the pid first
    assert len(seen) == 1


def test_a_report_becomes_the_job_report_with_knobs_and_trial() -> None:
    body = {
        **REPORT,
        "oom_events": 1,
        "cuda_memory": [
            {"device": 0, "allocated_bytes": 10, "reserved_bytes": 20, "peak_allocated_bytes": 15}
        ],
        "knobs": {"num_workers": 8, "pin_memory": True},
        "trial": None,
        "from_a_newer_hook": {"ignored": True},
    }
    update = parse_report({"report": body}, declared=DECLARED, timestamp_s=99.5)
    assert update.report.timestamp_s == 99.5
    assert (update.report.steps, update.report.epoch, update.report.oom_events) == (120, 1, 1)
    assert update.report.data_wait_fraction == 0.4
    assert update.report.cuda_memory == (CudaMemory(0, 10, 20, 15),)
    assert update.knob_values == {"num_workers": 8, "pin_memory": True}
    assert (update.trial_given, update.trial_number) == (True, None)
    plain = parse_report({"report": REPORT}, declared=DECLARED, timestamp_s=1.0)
    assert (plain.trial_given, plain.knob_values, plain.report.oom_events) == (False, {}, 0)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"steps": -1}, "'steps'"),
        ({"epoch": 1.5}, "'epoch'"),
        ({"step_time_s": math.inf}, "'step_time_s'"),
        ({"data_wait_s": "0.1"}, "'data_wait_s'"),
        ({"data_wait_fraction": 1.5}, "'data_wait_fraction'"),
        ({"samples_per_s": None}, "'samples_per_s'"),
        ({"oom_events": True}, "'oom_events'"),
        ({"cuda_memory": [{"device": 0}]}, "'allocated_bytes'"),
        ({"cuda_memory": [1]}, "'cuda_memory'"),
        (
            {
                "cuda_memory": [
                    {
                        "device": 0,
                        "allocated_bytes": 0,
                        "reserved_bytes": 0,
                        "peak_allocated_bytes": 0,
                    }
                ]
                * 2
            },
            "device 0 twice",
        ),
        ({"cuda_memory": [{}] * 65}, "at most 64"),
        ({"knobs": {"batch_size": 64}}, "not declared"),
        ({"knobs": {"num_workers": True}}, "must be a int"),
        ({"knobs": {"pin_memory": 1}}, "must be a bool"),
        ({"knobs": {"num_workers": 17}}, "outside"),
        ({"trial": 3}, "'trial'"),
    ],
)
def test_a_bad_report_is_refused_whole(change: dict[str, Any], names: str) -> None:
    message = _refused(
        parse_report, {"report": {**REPORT, **change}}, declared=DECLARED, timestamp_s=0.0
    )
    assert names in message
    missing = {k: v for k, v in REPORT.items() if k != "samples_per_s"}
    assert "'samples_per_s'" in _refused(
        parse_report, {"report": missing}, declared=DECLARED, timestamp_s=0.0
    )
    assert "'report'" in _refused(parse_report, {"report": []}, declared={}, timestamp_s=0.0)


def test_an_event_is_stamped_with_the_session_and_defaults_to_its_trial() -> None:
    def event(body: dict[str, Any]) -> Any:
        return parse_event({"event": body}, job="j", pid=7, default_trial=5, timestamp_s=12.0)

    oom = event({"kind": "oom", "message": None})
    assert (oom.job, oom.pid, oom.kind, oom.trial_number, oom.message) == ("j", 7, "oom", 5, "")
    assert oom.timestamp_s == 12.0
    trial = event({"kind": "trial", "trial_state": "PRUNED", "trial_number": 9})
    assert (trial.trial_state, trial.trial_number) == ("PRUNED", 9)
    crash = event({"kind": "crash", "crash_kind": "cuda_oom", "message": "x" * 1000})
    assert crash.crash_kind == "cuda_oom" and len(crash.message) == EVENT_MESSAGE_MAX_CHARS
    # The hook's kind for Optuna's own errors ("Cannot tell a COMPLETE trial.").
    assert event({"kind": "crash", "crash_kind": "optuna_error"}).crash_kind == "optuna_error"
    for body, names in [
        ({"kind": "boom"}, "'kind'"),
        ({"kind": "trial"}, "'trial_state'"),
        ({"kind": "trial", "trial_state": "RUNNING"}, "'trial_state'"),
        ({"kind": "crash"}, "'crash_kind'"),
        ({"kind": "oom", "trial_number": -2}, "'trial.number'"),
        ({"kind": "oom", "message": "x" * 1001}, "'message'"),
        ({"kind": "oom", "message": 3}, "'message'"),
    ]:
        assert names in _refused(event, body)
    assert "'event'" in _refused(
        parse_event, {"event": "oom"}, job="j", pid=7, default_trial=None, timestamp_s=0.0
    )


def test_set_knob_replies_and_salvaged_ids() -> None:
    assert parse_set_knob_result({"knob": "num_workers", "value": 2}) == KnobApplied(
        "num_workers", 2
    )
    for bad in (None, [], {"knob": 1, "value": 2}, {"knob": "k", "value": "2"}):
        assert parse_set_knob_result(bad) is None
    assert salvage_id(b'{"id": 7, "op": 3}\n') == 7
    assert salvage_id(b'{"id": "a", "op": 3}\n') == "a"
    for line in (b"[1]\n", b"{oops\n", b'{"id": true}\n', b'{"id": 1.5}\n'):
        assert salvage_id(line) is None
    assert messages.is_knob_value(True) and not messages.is_number(True)
