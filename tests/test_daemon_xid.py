"""The daemon and NVML Xid errors: polled each tick, logged, in ``status``, a crash's evidence."""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TWO_GPUS, RunningDaemon
from gpuwatchd.config import Settings
from gpuwatchd.crash import CrashInfo
from gpuwatchd.daemon import Daemon
from gpuwatchd.jobs.ledger import crash_from_dict, crash_to_dict
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.testing import FakeNvml
from gpuwatchd.testing.clock import FakeClock
from gpuwatchd.xid import XID_AFTER_CRASH_S, XID_BEFORE_CRASH_S, XidEvent, describe


def _daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeNvml, clock: FakeClock
) -> Daemon:
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # restored after the test
    daemon = Daemon(Settings(devices="nvml", state_dir=str(tmp_path / "state")), clock=clock)
    daemon.open_samplers()
    return daemon


def _crash(at_s: float, gpu: int | None = 0, *, intentional: bool = False) -> WorkerCrash:
    return WorkerCrash(
        job="hpo",
        worker=0,
        pid=4242,
        gpu_index=gpu,
        crash_info=CrashInfo("other", "exited with status 1", None, 1),
        trial_number=3,
        stderr_tail="",
        timestamp_s=at_s,
        returncode=1,
        uptime_s=60.0,
        intentional=intentional,
    )


def test_tick_polls_xids_logs_them_and_status_shows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml.h100s(2)
    clock = FakeClock(1000.0)
    daemon = _daemon(tmp_path, monkeypatch, fake, clock)
    daemon.tick()
    status = daemon.status()
    assert status["xid_events"] == []
    assert status["xid_watch"] == {"gpus": [0, 1], "unsupported": {}, "error": None}
    fake.inject_xid(1, 79)
    clock.advance(1.0)
    daemon.tick()
    [event] = daemon.status()["xid_events"]
    assert event == {
        "timestamp_s": 1001.0,
        "gpu_index": 1,
        "gpu_uuid": fake.devices[1].uuid,
        "xid": 79,
        "description": describe(79),
        "cause": "hardware",
    }
    daemon.ticker.gpu_sampler.close()  # type: ignore[union-attr]


def test_status_says_which_gpus_have_no_xid_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml.h100s(2)
    fake.devices[1].unsupported = frozenset({"events"})
    daemon = _daemon(tmp_path, monkeypatch, fake, FakeClock(0.0))
    daemon.tick()
    watch = daemon.status()["xid_watch"]
    assert watch == {"gpus": [0], "unsupported": {"1": "Not Supported"}, "error": None}


def test_host_only_daemon_has_no_xid_watch(tmp_path: Path) -> None:
    daemon = Daemon(Settings(devices="none", state_dir=str(tmp_path / "state")))
    daemon.open_samplers()
    daemon.tick()
    status = daemon.status()
    assert status["xid_events"] == [] and status["xid_watch"] is None


def test_xid_evidence_is_the_crash_gpus_xids_in_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml.h100s(2)
    clock = FakeClock(1000.0)
    daemon = _daemon(tmp_path, monkeypatch, fake, clock)
    fake.inject_xid(0, 13)
    daemon.tick()  # t=1000: too early for a crash at 1000 + BEFORE + 1
    clock.advance(XID_BEFORE_CRASH_S)
    fake.inject_xid(0, 31)
    fake.inject_xid(1, 79)  # another GPU
    daemon.tick()  # t=1030
    clock.advance(1.0)
    crash = _crash(clock())  # t=1031; an Xid 45 the tick has not drained yet:
    fake.inject_xid(0, 45)
    evidence = daemon.ticker.xid_evidence(crash)
    assert [(e.gpu_index, e.xid) for e in evidence] == [(0, 31), (0, 45)]
    assert daemon.ticker.xid_evidence(dataclasses.replace(crash, intentional=True)) == ()
    assert daemon.ticker.xid_evidence(dataclasses.replace(crash, gpu_index=None)) == ()
    later = dataclasses.replace(crash, timestamp_s=clock() + XID_BEFORE_CRASH_S + XID_AFTER_CRASH_S)
    assert daemon.ticker.xid_evidence(later) == ()

    with_xids = dataclasses.replace(crash, xid_events=evidence)
    message = with_xids.to_event().message
    assert message == (
        "exited with status 1 [Xid 31 on GPU 0: GPU memory page fault; "
        "Xid 45 on GPU 0: Preemptive cleanup]"
    )
    assert crash.to_event().message == "exited with status 1"


def test_crash_ledger_entry_keeps_the_xids() -> None:
    event = XidEvent(99.0, 0, "GPU-0", 43, describe(43))
    crash = dataclasses.replace(_crash(100.0), xid_events=(event,))
    entry = crash_to_dict(crash)
    assert entry["xid_events"] == [event.to_dict()]
    assert crash_from_dict(entry) == dataclasses.replace(crash, stderr_tail="")
    old = {k: v for k, v in entry.items() if k != "xid_events"}  # a ledger from before Xids
    assert crash_from_dict(old).xid_events == ()


def test_daemon_subprocess_shows_a_scripted_xid_in_status(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    script: dict[str, Any] = copy.deepcopy(TWO_GPUS)
    script["devices"][0]["xids"] = [[3, 43]]
    script["devices"][1]["unsupported"] = ["events"]
    daemon = run_daemon(script=script)

    def xids() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = daemon.status()["xid_events"]
        return events

    [event] = daemon.wait_until(xids, what="the scripted Xid in status")
    assert (event["gpu_index"], event["xid"], event["cause"]) == (0, 43, "application")
    assert event["gpu_uuid"] == TWO_GPUS["devices"][0]["uuid"]
    status = daemon.status()
    assert status["xid_watch"] == {
        "gpus": [0],
        "unsupported": {"1": "Not Supported"},
        "error": None,
    }
    logged = [e for e in daemon.events() if e.get("event") == "gpu xid"]
    assert [(e["gpu"], e["xid"], e["level"]) for e in logged] == [(0, 43, "warning")]
    assert logged[0]["description"].startswith("GPU stopped processing")
    human = daemon.ctl("status")
    assert human.returncode == 0, human.stderr
    assert "Xid 43 on GPU 0" in human.stdout


def test_on_crash_records_the_xids_in_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    fake = FakeNvml.h100s(1)
    clock = FakeClock(1000.0)
    daemon = _daemon(tmp_path, monkeypatch, fake, clock)
    (tmp_path / "state").mkdir()  # (run() makes it)
    daemon.tick()
    fake.inject_xid(0, 31)
    asyncio.run(daemon.crashes.on_crash(_crash(clock())))
    [entry] = daemon.crashes.ledger.load()
    assert [(e.gpu_index, e.xid) for e in entry.xid_events] == [(0, 31)]


def test_xids_reach_the_detectors_once_even_when_a_crash_drained_them_between_ticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml.h100s(2)
    clock = FakeClock(1000.0)
    daemon = _daemon(tmp_path, monkeypatch, fake, clock)  # the packaged default policies
    daemon.tick()
    fake.inject_xid(1, 48)
    clock.advance(0.5)
    assert [e.xid for e in daemon.ticker.xid_evidence(_crash(1000.5, gpu=1))] == [48]
    clock.advance(0.5)
    snapshot = daemon.tick()
    assert [(x.gpu_index, x.xid) for x in snapshot.xids] == [(1, 48)]
    found = [f for f in daemon.ticker.active.values() if f.detector == "xid"]
    assert [(f.gpu_index, f.value) for f in found] == [(1, 48.0)]
    cordons = [r.decision for r in daemon.ticker.decisions if r.decision.action == "cordon_gpu"]
    assert [(d.policy, d.params["gpu_index"]) for d in cordons] == [("gpu-hardware-xid", 1)]
    clock.advance(1.0)
    assert daemon.tick().xids == ()  # taken once
    daemon.ticker.gpu_sampler.close()  # type: ignore[union-attr]
