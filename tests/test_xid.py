"""The Xid table and the recent-events log that finds a crash's Xids (pure, no NVML)."""

from __future__ import annotations

import json

import pytest

from gpuwatchd.xid import (
    XID_AFTER_CRASH_S,
    XID_BEFORE_CRASH_S,
    XID_TABLE,
    XidEvent,
    XidLog,
    cause_of,
    describe,
    merged_table,
    parse_overrides,
    summary,
)

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"


def xid(t: float, gpu: int, code: int) -> XidEvent:
    return XidEvent(t, gpu, UUID0 if gpu == 0 else UUID1, code, describe(code))


def test_table_has_the_common_codes_one_line_each() -> None:
    wanted = {13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120}
    assert wanted <= set(XID_TABLE)
    for code, info in XID_TABLE.items():
        assert info.xid == code
        assert info.description and "\n" not in info.description
        assert info.cause in ("application", "hardware", "driver")


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        (13, "application"),
        (31, "application"),
        (43, "application"),
        (45, "application"),
        (48, "hardware"),
        (63, "hardware"),
        (64, "hardware"),
        (74, "hardware"),
        (79, "hardware"),
        (94, "hardware"),
        (95, "hardware"),
        (119, "driver"),
        (120, "driver"),
    ],
)
def test_cause_application_vs_hardware_vs_driver(code: int, cause: str) -> None:
    assert cause_of(code) == cause
    assert xid(0.0, 0, code).cause == cause


def test_describe_names_nvidias_meaning_and_unknown_codes() -> None:
    assert describe(31).startswith("GPU memory page fault")
    assert describe(79).startswith("GPU has fallen off the bus")
    assert describe(48).startswith("Double Bit ECC Error")
    assert "not in gpuwatchd's table" in describe(9999)
    assert cause_of(9999) == "unknown"


def test_event_round_trips_through_json() -> None:
    event = xid(12.5, 1, 43)
    d = json.loads(json.dumps(event.to_dict()))
    assert d["cause"] == "application" and d["gpu_uuid"] == UUID1
    assert XidEvent.from_dict(d) == event
    # an entry without description (an older writer) gets the table's
    assert XidEvent.from_dict({"timestamp_s": 1, "gpu_index": 0, "xid": 79}).description == (
        describe(79)
    )
    with pytest.raises(KeyError):
        XidEvent.from_dict({"timestamp_s": 1, "gpu_index": 0})


def test_near_takes_the_crash_gpu_within_the_window() -> None:
    log = XidLog()
    crash_at = 1000.0
    log.add(
        [
            xid(crash_at - XID_BEFORE_CRASH_S - 0.1, 0, 13),  # too early
            xid(crash_at - XID_BEFORE_CRASH_S, 0, 31),  # window edge: in
            xid(crash_at - 2.0, 1, 79),  # other GPU
            xid(crash_at - 1.0, 0, 43),
            xid(crash_at + XID_AFTER_CRASH_S, 0, 45),  # edge: in
            xid(crash_at + XID_AFTER_CRASH_S + 0.1, 0, 48),  # too late
        ]
    )
    assert [e.xid for e in log.near(0, crash_at)] == [31, 43, 45]
    assert [e.xid for e in log.near(1, crash_at)] == [79]
    assert log.near(2, crash_at) == ()
    assert [e.xid for e in log.near(0, crash_at, before_s=1.0, after_s=0.0)] == [43]


def test_log_is_bounded_and_recent_is_oldest_first() -> None:
    log = XidLog(maxlen=3)
    log.add(xid(float(t), 0, 13) for t in range(5))
    assert len(log) == 3
    assert [e.timestamp_s for e in log.recent()] == [2.0, 3.0, 4.0]
    assert [e.timestamp_s for e in log.recent(2)] == [3.0, 4.0]
    assert log.recent(0) == ()
    with pytest.raises(ValueError, match="maxlen"):
        XidLog(maxlen=0)


def test_summary_names_each_distinct_xid_per_gpu_once() -> None:
    events = [xid(1.0, 0, 31), xid(1.5, 0, 31), xid(2.0, 0, 45), xid(2.0, 1, 79)]
    assert summary(events) == (
        "Xid 31 on GPU 0: GPU memory page fault; Xid 45 on GPU 0: Preemptive cleanup; "
        "Xid 79 on GPU 1: GPU has fallen off the bus"
    )
    assert summary([]) == ""


@pytest.mark.parametrize(
    ("code", "cause", "action"),
    [
        (13, "application", "restart_app"),
        (31, "application", "restart_app"),
        (43, "application", "restart_app"),
        (48, "hardware", "reset_gpu"),
        (63, "hardware", "reset_gpu"),
        (64, "hardware", "rma"),
        (74, "hardware", "reset_gpu"),
        (79, "hardware", "reboot_node"),
        (92, "hardware", "none"),  # corrected errors: informational (debug guidelines)
        (94, "hardware", "restart_app"),  # contained: the application that hit it restarts
        (95, "hardware", "reboot_node"),  # uncontained: others hit too; reboot with MIG off
        (119, "driver", "reset_gpu"),
        (120, "driver", "reset_gpu"),
    ],
)
def test_the_codes_of_issue_22_carry_nvidias_recommended_action(
    code: int, cause: str, action: str
) -> None:
    info = XID_TABLE[code]
    assert (info.cause, info.action) == (cause, action)


def test_overrides_reclassify_keep_names_and_add_codes() -> None:
    rows = parse_overrides({"13": "hardware", 500: {"class": "driver", "action": "reset_gpu"}})
    assert [(r.xid, r.cause, r.action) for r in rows] == [
        (13, "hardware", "restart_app"),
        (500, "driver", "reset_gpu"),
    ]
    assert rows[0].description == XID_TABLE[13].description
    table = merged_table(rows)
    assert cause_of(13, table) == "hardware" and cause_of(13) == "application"
    assert cause_of(500, table) == "driver" and describe(500, table) == "Xid 500 (operator's table)"
    for bad in ({}, {13: 7}, {13: {"name": ""}}, {13: {"name": "a\nb"}}, {True: "hardware"}):
        with pytest.raises(ValueError):
            parse_overrides(bad)
