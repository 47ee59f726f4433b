"""The journal wired into the daemon: write-ahead in process, and end to end with real
daemons killed with SIGKILL and restarted on the same state directory.

Only NVML is fake (the conftest ``run_daemon`` fixture, or install_fake_nvml in
process): fake GPU 1 sits at 3 % utilization, so ``low_utilization`` fires on it and
the policies below decide.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, TWO_GPUS, RunningDaemon, restart_on_same_state
from gpuwatchd.actuators import Actuator
from gpuwatchd.config import Settings, SlurmArrayConfig, SlurmConfig
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Reply
from gpuwatchd.daemon import Daemon
from gpuwatchd.daemon.restore import restore_horizon_s
from gpuwatchd.errors import ControlError
from gpuwatchd.journal import JOURNAL_FILENAME, Journal, Outcome
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision, JobInfo, Knob
from gpuwatchd.policy.schema import parse_policies
from gpuwatchd.testing import FakeClock, FakeNvml, install_fake_nvml

GPU1 = TWO_GPUS["devices"][1]["uuid"]

COOLDOWN_POLICY = """\
policies:
  - name: gpu-idle
    when:
      low_utilization: {percent: 20, for: 0.5s}
    do:
      - log: {message: "GPU idle", level: warning}
    cooldown: 1h
"""

CHATTY_POLICY = """\
policies:
  - name: gpu-idle-chatty
    when:
      low_utilization: {percent: 20, for: 0.4s}
    do:
      - log: {message: "still idle"}
    cooldown: 0.5s
"""


def events(daemon: RunningDaemon, *args: str) -> list[dict[str, Any]]:
    """``gpuwatchctl events --json ARGS`` parsed (one JSON object per line)."""
    result = daemon.ctl("events", "--json", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def of_kind(stream: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in stream if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


STARVED_KNOB_POLICY = """\
policies:
  - name: idle-more-workers
    when:
      low_utilization: {percent: 20, for: 0s}
    do:
      - set_knob: {knob: num_workers, factor: 2, max: 16}
    cooldown: 1h
"""

NO_COOLDOWN_POLICY = """\
policies:
  - name: idle-log
    when:
      low_utilization: {percent: 20, for: 0s}
    do:
      - log: {message: "GPU idle"}
"""


def in_process_daemon(tmp_path: Path, policy_text: str, clock: FakeClock) -> Daemon:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text)
    settings = Settings(devices="nvml", state_dir=str(tmp_path), policies=(str(policy),))
    daemon = Daemon(settings, clock=clock)
    daemon.open_samplers()
    daemon.open_journal()
    return daemon


def test_restore_horizon_is_the_longest_cooldown_or_limit() -> None:
    policies = parse_policies(
        """\
policies:
  - name: a
    when: {low_utilization: {percent: 20, for: 1m}}
    do: [{log: {}}]
    cooldown: 1h
  - name: b
    when: {low_utilization: {percent: 20, for: 1m}}
    do: [{log: {}}]
    limit: {max: 3, per: 2h}
""",
        "horizon.yaml",
    )
    assert restore_horizon_s(policies) == 7200.0


def test_set_knob_is_journaled_before_it_is_sent(tmp_path: Path) -> None:
    """Write-ahead: when the command reaches the job, the decision is already committed."""
    clock = FakeClock(1_700_000_000.0)
    journal_path = tmp_path / JOURNAL_FILENAME
    seen_by_job: list[list[tuple[str, str]]] = []

    class Commander:
        """Stands in for the control server at the moment it would write to the job."""

        async def send_command(
            self,
            job: str,
            op: str,
            params: Any,
            *,
            pid: int | None = None,
            timeout_s: float = 60,
            source: str | None = None,
        ) -> list[Reply]:
            outside = sqlite3.connect(journal_path)  # another connection: sees commits only
            seen_by_job.append(outside.execute("SELECT action, outcome FROM decisions").fetchall())
            outside.close()
            return [Reply("d-1", ok=True, result={"applied": True})]

    job = JobInfo(
        name="digits",
        pid=4242,
        connected_at_s=clock(),
        knobs={"num_workers": Knob("num_workers", 2, 0, 32)},
    )

    async def scenario() -> dict[str, Any]:
        with install_fake_nvml(FakeNvml.h100s(1, utilization_pct=3.0)):
            daemon = in_process_daemon(tmp_path, STARVED_KNOB_POLICY, clock)
            actuator = Actuator(
                Commander(), get_logger("test"), clock, on_outcome=daemon.keeper.on_outcome
            )
            daemon.ticker.act_with(actuator)
            clock.advance(1.0)
            daemon.tick((job,))
            await asyncio.sleep(0.05)  # the set_knob task runs and reports its outcome
            status = daemon.status()
            result = daemon.events({"since_s": 0})
            daemon.close_journal()
            return {"status": status, "events": result["events"]}

    out = asyncio.run(scenario())
    assert seen_by_job == [[("set_knob", "pending")]]
    kinds = [(e["kind"], e.get("outcome")) for e in out["events"]]
    assert kinds == [("finding_started", None), ("decision", None), ("outcome", "applied")]
    (record,) = out["status"]["decisions"]
    assert record["outcome"] == "applied" and record["id"] == out["events"][1]["decision_id"]


def test_no_action_without_a_record(tmp_path: Path) -> None:
    """A tick whose journal write fails carries out none of its decisions and says so."""
    clock = FakeClock(1_700_000_000.0)
    with install_fake_nvml(FakeNvml.h100s(1, utilization_pct=3.0)):
        daemon = in_process_daemon(tmp_path, NO_COOLDOWN_POLICY, clock)
        locker = sqlite3.connect(tmp_path / JOURNAL_FILENAME, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # e.g. an operator's sqlite3 shell mid-transaction
        clock.advance(1.0)
        daemon.tick()
        status = daemon.status()
        (record,) = status["decisions"]
        assert record["outcome"] == "failed" and "journal write failed" in record["detail"]
        assert record["id"] is None
        assert status["journal"]["failed_writes"] == 1
        assert "locked" in status["journal"]["error"]
        locker.execute("ROLLBACK")
        clock.advance(1.0)
        daemon.tick()
        status = daemon.status()
        assert status["journal"]["error"] is None
        assert status["decisions"][-1]["id"] is not None
        events = daemon.events({"since_s": 0})["events"]
        daemon.close_journal()
    # Nothing of the failed tick was committed; the next tick made good its finding.
    assert [e["kind"] for e in events] == ["finding_started", "decision", "outcome"]


@pytest.mark.slow
def test_sigkill_restart_keeps_cooldown_and_every_record(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "cooldown.yaml"
    policy.write_text(COOLDOWN_POLICY)
    first = run_daemon(args=["--policies", str(policy)])
    first.wait_until(
        lambda: of_kind(events(first), "outcome", policy="gpu-idle"), what="a logged decision"
    )
    before = events(first, "--since", "1h")
    assert len(of_kind(before, "decision", policy="gpu-idle")) == 1
    assert of_kind(before, "finding_started", detector="low_utilization", subject=f"gpu:{GPU1}")

    first.process.kill()  # SIGKILL: no clean-up, no checkpoint
    assert first.process.wait(timeout=10) == -signal.SIGKILL
    assert (first.workdir / "state" / JOURNAL_FILENAME).exists()

    second = restart_on_same_state(run_daemon, first, ["--policies", str(policy)])
    # The condition holds again after its `for:` (the windows start empty) ...
    second.wait_until(
        lambda: len(of_kind(events(second), "finding_started", subject=f"gpu:{GPU1}")) >= 2,
        what="the idle GPU found again after the restart",
    )
    ticks = second.status()["ticks"]
    second.wait_until(lambda: second.status()["ticks"] >= ticks + 10, what="ten more ticks")
    after = events(second, "--since", "1h")

    # ... but the cooldown restored from the journal holds: no second decision.
    assert len(of_kind(after, "decision", policy="gpu-idle")) == 1
    assert not any("GPU idle" in json.dumps(e) for e in second.events() if e["event"] == "policy")
    # Every event recorded before the kill is still there, unchanged, and nothing twice.
    by_id = {e["id"]: e for e in after}
    assert len(by_id) == len(after)
    for event in before:
        assert by_id[event["id"]] == event
    # The episode the killed daemon left open is closed as "stopped"; a new one began.
    (closed,) = of_kind(after, "finding_cleared", subject=f"gpu:{GPU1}")
    assert closed["clear_reason"] == "stopped"
    starts = of_kind(after, "finding_started", subject=f"gpu:{GPU1}")
    assert len(starts) == 2 and starts[0]["finding_id"] != starts[1]["finding_id"]
    assert starts[0]["finding_id"] == closed["finding_id"]
    # status shows the journaled decision and that it was restored.
    status = second.status()
    assert status["journal"]["restored_decisions"] == 1
    assert status["journal"]["error"] is None
    assert [(d["policy"], d["outcome"]) for d in status["decisions"]] == [("gpu-idle", "logged")]
    opened = [e for e in second.events() if e["event"] == "journal opened"]
    assert opened and opened[0]["restored_decisions"] == 1


@pytest.mark.slow
def test_events_since_json_table_and_follow(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "chatty.yaml"
    policy.write_text(CHATTY_POLICY)
    daemon = run_daemon(args=["--policies", str(policy)])
    daemon.wait_until(lambda: len(of_kind(events(daemon), "decision")) >= 2, what="two decisions")

    # --json: one object per line with the documented keys.
    stream = events(daemon, "--since", "1h")
    for event in stream:
        assert {"id", "time_s", "kind"} <= event.keys()
    (start,) = of_kind(stream, "finding_started")
    assert start["detector"] == "low_utilization" and start["gpu_index"] == 1
    decision = of_kind(stream, "decision")[0]
    assert decision["params"]["message"] == "still idle"
    assert decision["params"]["level"] == "info"
    assert decision["findings"][0]["subject"] == f"gpu:{GPU1}"
    outcome = of_kind(stream, "outcome", decision_id=decision["decision_id"])
    assert outcome and outcome[0]["outcome"] == "logged"

    # --since: only what happened in the last DURATION.
    time.sleep(1.0)
    asked_at = time.time()
    recent = events(daemon, "--since", "1s")
    assert recent and all(e["time_s"] >= asked_at - 1.0 - 0.5 for e in recent)
    assert len(events(daemon, "--since", "1h")) > len(recent)
    assert start["id"] not in {e["id"] for e in recent}

    # The table for people.
    table = daemon.ctl("events", "-n", "5")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["TIME", "KIND", "POLICY/DETECTOR"]
    assert len(lines) == 6 and any("gpu-idle-chatty" in line for line in lines[1:])
    assert daemon.ctl("events", "--since", "ten minutes").returncode == 2

    # --follow: new events arrive while it runs; SIGINT ends it with status 0.
    newest = events(daemon, "-n", "1")[0]["id"]
    follow = subprocess.Popen(
        [str(BIN / "gpuwatchctl"), "--socket", str(daemon.socket), "events", "--follow", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemon.env,
    )
    try:
        time.sleep(3.0)
        follow.send_signal(signal.SIGINT)
        stdout, stderr = follow.communicate(timeout=10)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0, stderr
    assert "Traceback" not in stderr
    followed = [json.loads(line) for line in stdout.splitlines()]
    ids = [e["id"] for e in followed]
    assert ids == sorted(set(ids))  # in order, none twice across polls
    fresh = [e for e in followed if e["id"] > newest]
    assert of_kind(fresh, "decision"), "no new decision arrived during --follow"


@pytest.mark.slow
def test_the_events_table_shows_a_log_decision_by_its_message_and_others_by_params() -> None:
    from gpuwatchd.cli.commands.events import format_event

    base = {"time_s": 1_700_000_000.0, "policy": "gpu-idle", "decision_id": 7, "gpu_index": 1}
    log = {**base, "kind": "decision", "action": "log"}
    log["params"] = {"level": "warning", "message": "GPU idle"}
    knob = {**base, "kind": "decision", "action": "set_knob", "job": "digits"}
    knob["params"] = {"knob": "num_workers", "value": 8}
    rows = [
        format_event(log),
        format_event({**base, "kind": "outcome", "action": "log", "outcome": "logged"}),
        format_event(knob),
        format_event({**base, "kind": "outcome", "action": "set_knob", "outcome": "applied"}),
    ]
    assert [row.split("  ")[-1].strip() for row in rows] == [
        "#7 log warning: GPU idle",
        "#7 logged",
        "#7 set_knob(knob=num_workers, value=8)",
        "#7 set_knob applied",
    ]
    assert "digits" in rows[2] and "GPU 1" in rows[0]


def test_events_op_params_and_paging(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "chatty.yaml"
    policy.write_text(CHATTY_POLICY)
    daemon = run_daemon(args=["--policies", str(policy)])
    daemon.wait_until(lambda: len(events(daemon)) >= 4, what="four events")
    with ControlClient(daemon.socket) as client:
        for bad in ({"limit": 1001}, {"limit": 0}, {"after_id": -1}, {"since_s": "yesterday"}):
            with pytest.raises(ControlError) as error:
                client.call("events", **bad)
            assert error.value.code == "bad_request"
        page = client.call("events", after_id=0, limit=1)
        assert len(page["events"]) == 1 and page["more"] is True
        seen = [page["events"][0]["id"]]
        while page["more"] and len(seen) < 4:
            page = client.call("events", after_id=page["last_id"], limit=1)
            seen.extend(e["id"] for e in page["events"])
        assert seen == sorted(set(seen)) and len(seen) == 4
        everything = client.call("events", since_s=0, limit=1000)
        assert [e["id"] for e in everything["events"]][:4] == seen
        nothing = client.call("events", after_id=10**9)
        assert nothing == {"events": [], "last_id": 10**9, "more": False}
    # A clean stop (SIGTERM) closes the open episode at the stop, read from the file itself.
    assert daemon.stop() == 0
    stopped_at = time.time()
    with Journal.open(daemon.workdir / "state" / JOURNAL_FILENAME) as journal:
        (cleared,) = [e for e in journal.events(since_s=0) if e["kind"] == "finding_cleared"]
    assert cleared["clear_reason"] == "stopped" and cleared["time_s"] <= stopped_at


@pytest.mark.slow
def test_corrupt_journal_is_moved_aside_at_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    first = run_daemon(script=TWO_GPUS)
    first.stop()
    journal = first.workdir / "state" / JOURNAL_FILENAME
    journal.write_bytes(b"garbage, not SQLite\n" * 100)
    for suffix in ("-wal", "-shm"):
        Path(str(journal) + suffix).unlink(missing_ok=True)
    second = run_daemon(
        args=["--state-dir", str(first.workdir / "state"), "--socket", str(first.socket)],
        name="second",
    )
    second.socket = first.socket
    errors = [e for e in second.events() if e["event"].startswith("journal was corrupt")]
    assert len(errors) == 1 and errors[0]["level"] == "error"
    aside = Path(errors[0]["moved_to"])
    assert aside.read_bytes() == b"garbage, not SQLite\n" * 100
    status = second.status()["journal"]
    assert status["path"] == str(journal)
    assert status["replaced"]["moved_to"] == str(aside)
    assert status["replaced"]["reason"] == "corrupt"
    assert second.ctl("events").returncode == 0


def test_a_failing_journal_is_shown_in_the_human_status(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """While the journal cannot be written (here: locked by another SQLite connection),
    ``gpuwatchctl status`` says so in red above the rest; the JSON has the same."""
    policy = tmp_path / "chatty.yaml"
    policy.write_text(NO_COOLDOWN_POLICY)
    daemon = run_daemon(args=["--policies", str(policy)])
    locker = sqlite3.connect(daemon.workdir / "state" / JOURNAL_FILENAME, isolation_level=None)
    try:
        locker.execute("BEGIN IMMEDIATE")
        journal = daemon.wait_until(
            lambda: (j := daemon.status()["journal"])["failed_writes"] and j,
            what="a failed journal write",
        )
        assert "locked" in journal["error"]
        shown = daemon.ctl("status")
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())  # rich wraps long lines
        assert "Journal: " in text and " failed writes (decisions of those ticks" in text
        assert "locked" in text.split("Journal: ", 1)[1]
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    daemon.wait_until(lambda: daemon.status()["journal"]["error"] is None, what="recovery")
    after = " ".join(daemon.ctl("status").stdout.split())
    assert "last error: none since" in after  # the count stays, the error is gone


def test_the_configured_retention_prunes_the_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``journal_retention`` reaches the journal: a decision older than it is pruned when
    the daemon opens the journal; a younger one stays."""
    clock = FakeClock(1_700_000_000.0)
    with Journal.open(tmp_path / JOURNAL_FILENAME, now_s=clock()) as journal:
        for age_days in (3, 1):
            at = clock() - age_days * 86400
            decision = Decision("p", "log", {"message": "m"}, at, ())
            journal.record_tick(at, decisions=[decision], outcomes=[Outcome("logged", "", at)])
    policy = tmp_path / "policy.yaml"
    policy.write_text(NO_COOLDOWN_POLICY)
    settings = Settings(
        devices="none",
        state_dir=str(tmp_path),
        policies=(str(policy),),
        journal_retention_s=2 * 86400,
    )
    daemon = Daemon(settings, clock=clock)
    daemon.open_samplers()
    daemon.open_journal()
    try:
        kept = [e["time_s"] for e in daemon.events({"since_s": 0})["events"]]
        assert daemon.status()["journal"]["retention_s"] == 2 * 86400
    finally:
        daemon.close_journal()
    assert len(kept) == 2 and all(t == clock() - 86400 for t in kept)  # decision + outcome
    opened = [line for line in capsys.readouterr().out.splitlines() if "journal opened" in line]
    assert "pruned_events=2" in opened[0]


def test_a_refused_ladder_move_is_not_restored_as_the_ladder(tmp_path: Path) -> None:
    """A Slurm raise held within ``raise_hold`` (refused) did not move the ladder: the
    restarted daemon's ladder is where the last lower left it (docs/slurm.md)."""
    clock = FakeClock(1_700_000_000.0)
    with Journal.open(tmp_path / JOURNAL_FILENAME, now_s=clock()) as journal:
        for action, before, to, outcome in (
            ("lower_parallelism", 4, 3, Outcome("applied", "array 7: 4 -> 3", clock() - 9)),
            ("raise_parallelism", 3, 4, Outcome("refused", "array 7: 3 held", clock() - 5)),
        ):
            params = {"job": "hpo", "from": before, "to": to, "mode": "now"}
            decision = Decision("p", action, params, outcome.finished_s or 0.0, (), job="hpo")
            journal.record_tick(decision.timestamp_s, decisions=[decision], outcomes=[outcome])
    policy = tmp_path / "policy.yaml"
    policy.write_text(NO_COOLDOWN_POLICY)
    arrays = {"hpo": SlurmArrayConfig("hpo", max_workers=4, min_workers=2)}
    slurm = SlurmConfig(node="gpu07", arrays=arrays)
    settings = Settings(
        devices="none", state_dir=str(tmp_path), policies=(str(policy),), slurm=slurm
    )
    daemon = Daemon(settings, clock=clock)
    daemon.open_samplers()
    daemon.open_journal()
    try:
        assert daemon.engine.parallelism("hpo") == 3
    finally:
        daemon.close_journal()
