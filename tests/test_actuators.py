"""Actuators: ``exec`` (real subprocesses, never a shell), the decision life cycle, and the
Optuna side of crash recovery on a real SQLite study (no daemon, no NVML)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.actuators import (
    EXEC_TAIL_CHARS,
    Actuator,
    DecisionRecord,
    run_exec,
)
from gpuwatchd.control.protocol import Reply
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision

PY = sys.executable


class NoJobs:
    """A control server without attached jobs (exec and managed actions never use it)."""

    async def send_command(
        self,
        job: str,
        op: str,
        params: Any,
        *,
        pid: int | None = None,
        timeout_s: float = 60.0,
        source: str | None = None,
    ) -> list[Reply]:
        raise AssertionError("no command expected")


def exec_decision(argv: list[str], timeout_s: float = 10.0, dry_run: bool = False) -> Decision:
    return Decision(
        policy="hook",
        action="exec",
        params={"argv": argv, "timeout_s": timeout_s},
        timestamp_s=time.time(),
        findings=(),
        dry_run=dry_run,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_exec_passes_every_argument_literally(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    tricky = ["a; touch PWNED", f"$(touch {marker})", "`id`", "*", "x > y", "$HOME"]
    script = "import sys; print(sys.argv[1:])"
    result = asyncio.run(run_exec([PY, "-c", script, *tricky], 30.0))
    assert result.ok, result.describe()
    assert result.stdout_tail.strip() == repr(tricky)
    assert not marker.exists() and not (tmp_path / "PWNED").exists()
    assert not list(Path.cwd().glob("PWNED"))


def test_exec_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    result = asyncio.run(run_exec([PY, "-c", script], 1.5))
    assert time.monotonic() - started < 10
    assert result.timed_out and not result.ok
    assert result.returncode == -9
    assert "timed out after" in result.describe() and "stdout: started" in result.describe()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the command's own child must die with it"


def test_exec_failures_say_why() -> None:
    result = asyncio.run(
        run_exec([PY, "-c", "import sys; print('oops', file=sys.stderr); sys.exit(3)"], 30.0)
    )
    assert not result.ok and result.returncode == 3
    assert result.describe() == "exit status 3; stderr: oops"
    missing = asyncio.run(run_exec(["/nonexistent/gpuwatchd-hook"], 30.0))
    assert not missing.ok and missing.returncode is None
    assert "cannot run '/nonexistent/gpuwatchd-hook'" in missing.describe()
    with pytest.raises(ValueError):
        asyncio.run(run_exec([], 1.0))
    with pytest.raises(ValueError):
        asyncio.run(run_exec(["true"], 0.0))


def test_exec_keeps_only_the_tail_of_a_flood() -> None:
    script = "import sys; sys.stdout.write('x' * 2_000_000 + 'END')"
    result = asyncio.run(run_exec([PY, "-c", script], 30.0))
    assert result.ok
    assert len(result.stdout_tail) == EXEC_TAIL_CHARS and result.stdout_tail.endswith("END")


def test_actuator_runs_exec_decisions_and_reports_the_outcome(tmp_path: Path) -> None:
    outcomes: list[DecisionRecord] = []
    marker = tmp_path / "ran"

    async def main() -> tuple[DecisionRecord, DecisionRecord, DecisionRecord]:
        actuator = Actuator(NoJobs(), get_logger("test"), time.time, on_outcome=outcomes.append)
        ok = actuator.apply(exec_decision([PY, "-c", f"open({str(marker)!r}, 'w')"]))
        dry = actuator.apply(exec_decision(["/bin/false"], dry_run=True))
        bad = actuator.apply(exec_decision([PY, "-c", "raise SystemExit(2)"]))
        assert ok.outcome == bad.outcome == "pending" and dry.outcome == "dry-run"
        deadline = time.monotonic() + 30
        while len(outcomes) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await actuator.close()
        return ok, dry, bad

    ok, _, bad = asyncio.run(main())
    assert marker.exists()
    assert (ok.outcome, ok.detail) == ("applied", "exit status 0")
    assert (bad.outcome, bad.detail) == ("failed", "exit status 2")
    assert sorted(r.outcome for r in outcomes) == ["applied", "failed"]  # not the dry run
    assert ok.finished_at_s is not None


def test_managed_actions_fail_without_managed_jobs() -> None:
    actuator = Actuator(NoJobs(), get_logger("test"), time.time)
    decision = Decision("ladder", "lower_parallelism", {"job": "x", "to": 1}, 0.0, ())
    record = actuator.plan(decision)
    assert (record.outcome, record.detail) == (
        "failed",
        "no managed jobs (the config has no jobs:)",
    )
