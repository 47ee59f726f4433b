"""Supervisor cases that exist only with the systemd launcher: systemd keeps an ended
worker unit's exit status, and a running unit names its slot even when ``workers.json``
does not. Not collected by ``make test`` directly (no ``test_`` prefix):
tests/test_supervisor_units.py runs this file inside a booted systemd, with
``GPUWATCHD_TEST_LAUNCHER=systemd``; elsewhere each case fails saying so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.jobs.records import WorkerInfo
from gpuwatchd.jobs.supervisor import UNIT_CLEAN_NOTE
from gpuwatchd.jobs.transient_unit import unit_name
from gpuwatchd.jobs.workers_file import STATE_FILE
from test_supervisor import (
    LAUNCHER,
    Env,
    RecordingLogger,
    alive,
    emitted,
    env,
    make,
    run,
    run_until_failed,
    until,
)

__all__ = ["env"]  # the fixture, used by name


@pytest.fixture(autouse=True)
def _inside_systemd() -> None:
    assert LAUNCHER == "systemd", "run by tests/test_supervisor_units.py inside systemd"


def _show(unit: str, prop: str) -> str:
    done = subprocess.run(
        ["systemctl", "show", "-p", prop, "--value", "--", unit],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return done.stdout.strip()


def _load_state(unit: str) -> str:
    return _show(unit, "LoadState")


def _leave_two(env: Env) -> list[WorkerInfo]:
    """Start two ``drainable`` workers (SIGUSR1: exit 0) and leave them running."""
    first = make(env, [env.job("drainable", workers=2)])

    async def leave() -> list[WorkerInfo]:
        await first.start()
        await until(lambda: len(env.env_files()) == 2)
        infos = first.workers("hpo")
        await first.stop("leave")
        return infos

    return run(leave())


def _adopted_by_a_second(env: Env, log: RecordingLogger) -> list[WorkerInfo]:
    """Start a second supervisor of ``_leave_two``'s job: its workers right after start."""
    second = make(env, [env.job("drainable", workers=2)], log=log)

    async def body() -> list[WorkerInfo]:
        await second.start()
        infos = second.workers("hpo")
        await second.stop()
        return infos

    return run(body())


def test_a_unit_that_ended_while_no_daemon_ran_is_read_exactly(env: Env) -> None:
    """Worker 0 exits 0 and worker 1 is SIGKILLed while no supervisor runs: the next one
    reads each unit's status (no exit line needed), holds 0 finished, reports 1's SIGKILL."""
    left = _leave_two(env)
    pids = [w.pid for w in left if w.pid is not None]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    os.kill(pids[0], signal.SIGUSR1)  # exits 0
    os.kill(pids[1], signal.SIGKILL)

    async def gone() -> None:
        await until(lambda: not alive(pids[0]) and not alive(pids[1]))

    run(gone())
    assert _load_state(unit_name("hpo", 0)) == "loaded"  # kept: RemainAfterExit=yes
    log = RecordingLogger()
    second = make(env, [env.job("drainable", workers=2)], log=log)

    async def body() -> list[WorkerInfo]:
        await second.start()
        at_start = second.workers("hpo")
        await second.stop()
        return at_start

    at_start = run(body())
    by_worker = {w.worker: w for w in at_start}
    assert (by_worker[0].state, by_worker[0].held, by_worker[0].note) == (
        "stopped", "finished", UNIT_CLEAN_NOTE,
    )  # fmt: skip
    down = [c for c in emitted(second) if not c.intentional]
    assert [(c.worker, c.pid, c.returncode) for c in down] == [(1, pids[1], -signal.SIGKILL)]
    assert down[0].crash_info.signal == "SIGKILL"
    # No OOM kill on the host since its launch (/proc/vmstat, kept in workers.json): a
    # kill from outside, not a host OOM (its trial is then retried, not left FAIL).
    assert down[0].crash_info.kind == "other", down[0].crash_info
    assert down[0].worker_id == left[1].worker_id
    ended: dict[int, dict[str, Any]] = {}
    for e in log.events("worker.unit_ended"):
        ended.setdefault(e["worker"], e)  # the first end of each slot: the one while down
    assert ended[0]["result"] == "success" and ended[0]["returncode"] == 0
    assert ended[1]["result"] == "signal" and ended[1]["returncode"] == -signal.SIGKILL
    assert _load_state(unit_name("hpo", 0)) == "not-found"  # read, then released


def test_a_running_unit_missing_from_workers_json_is_adopted(env: Env) -> None:
    """The daemon died after systemd-run and before workers.json named the worker: the
    next supervisor finds the running unit by name and adopts it (no second launch)."""
    left = _leave_two(env)
    (env.state / "jobs" / "hpo" / STATE_FILE).unlink()
    log = RecordingLogger()
    adopted = _adopted_by_a_second(env, log)
    assert [(w.worker, w.pid, w.adopted, w.worker_id) for w in adopted] == [
        (w.worker, w.pid, True, w.worker_id) for w in left
    ]
    assert len(env.env_files()) == 2  # nothing launched twice
    found = log.events("worker.unit_not_recorded")
    assert [(f["worker"], f["unit"], f["running"]) for f in found] == [
        (0, unit_name("hpo", 0), True),
        (1, unit_name("hpo", 1), True),
    ]
    assert not any(alive(w.pid) for w in left)


def test_a_job_sandboxes_its_worker_units(env: Env) -> None:
    """``unit_properties`` ProtectSystem=strict with ReadWritePaths: the worker writes where
    allowed (``out``) and a write elsewhere dies with "Read-only file
    system": crash kind ``environment``, that line the evidence, no restart loop."""
    probe = env.root / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "open(os.path.join(os.environ['TEST_OUT'], 'allowed'), 'w').write('written')\n"
        "open(sys.argv[1], 'w').write('written')\n"
    )
    job = env.job(
        "done",
        unit_properties={"ProtectSystem": "strict", "ReadWritePaths": str(env.out)},
    )
    job = replace(job, command=(job.command[0], str(probe), str(env.root / "denied")))
    sup = make(env, [job])

    info = run_until_failed(sup)
    assert (env.out / "allowed").read_text() == "written"  # under ReadWritePaths=
    assert not (env.root / "denied").exists()
    (crash,) = [c for c in emitted(sup) if not c.intentional]
    assert crash.crash_info.kind == "environment"
    assert "Read-only file system" in (crash.crash_info.evidence or "")
    assert info.restarts == 0 and info.note.startswith("environment failure at start")


LEAVES_A_CHILD = r"""
import os, signal, subprocess, sys, time
out = os.environ["TEST_OUT"]
ignores_term = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    f"open('{out}/ready-child', 'w').close(); time.sleep(120)"
)
child = subprocess.Popen([sys.executable, "-c", ignores_term])
while not os.path.exists(f"{out}/ready-child"):  # its SIGTERM handler is in place
    time.sleep(0.02)
with open(f"{out}/child-0", "w") as f:
    f.write(str(child.pid))
signal.signal(signal.SIGUSR1, lambda *a: os._exit(3))
while True:
    time.sleep(0.5)
"""


def test_a_unit_still_deactivating_while_no_daemon_ran_is_read_exactly(env: Env) -> None:
    """The worker exited 3 while no supervisor ran, leaving a child that ignores SIGTERM:
    systemd keeps the unit ``deactivating`` (it waits TimeoutStopSec= for the child). The
    next supervisor still reads status 3 from the unit and kills the leftover."""
    script = env.root / "leaves_a_child.py"
    script.write_text(LEAVES_A_CHILD)
    job = replace(env.job("sleep"), command=(env.cmd()[0], str(script)))
    first = make(env, [job])

    async def leave() -> int:
        await first.start()
        await until(lambda: (env.out / "child-0").exists(), what="the child")
        pid = first.workers("hpo")[0].pid
        await first.stop("leave")
        assert pid is not None
        return pid

    pid = run(leave())
    child = int((env.out / "child-0").read_text())
    os.kill(pid, signal.SIGUSR1)  # exits 3; the child stays

    async def ended() -> None:
        await until(lambda: not alive(pid), what="the worker's end")
        unit = unit_name("hpo", 0)
        await until(lambda: _show(unit, "ActiveState") == "deactivating", what="deactivating")

    run(ended())
    log = RecordingLogger()
    second = make(env, [job], log=log)

    async def body() -> None:
        await second.start()
        await second.stop()

    run(body())
    down = [c for c in emitted(second) if not c.intentional]
    assert [(c.worker, c.pid, c.returncode) for c in down] == [(0, pid, 3)]
    assert log.events("worker.unit_ended")[0]["result"] == "exit-code"
    assert not alive(child)  # the unit's leftover was killed with it


def test_a_recorded_launch_that_ended_and_a_running_restart_is_adopted(env: Env) -> None:
    """workers.json still names an ended launch of slot 0 (the daemon died after it
    restarted the slot and before it wrote the file): the unit's running process is
    adopted, nothing is launched twice."""
    left = _leave_two(env)
    state_file = env.state / "jobs" / "hpo" / STATE_FILE
    saved = json.loads(state_file.read_text())
    dead = subprocess.Popen(["true"])  # a pid that is gone
    dead.wait()
    saved["workers"][0]["pid"] = dead.pid
    state_file.write_text(json.dumps(saved))
    log = RecordingLogger()
    adopted = _adopted_by_a_second(env, log)
    assert [(w.pid, w.adopted) for w in adopted] == [(w.pid, True) for w in left]
    assert len(env.env_files()) == 2
    (found,) = log.events("worker.unit_not_recorded")
    assert (found["worker"], found["pid"], found["running"]) == (0, left[0].pid, True)


def test_a_worker_units_environment_is_not_shown_to_other_users(env: Env) -> None:
    """A job's ``env`` (tokens, storage passwords) reaches the worker through a root-only
    ``EnvironmentFile=`` that is removed once the worker runs: not on systemd-run's command
    line, not in ``systemctl show -p Environment`` (any user may run it), not in the
    transient unit file (mode 0644)."""
    secret = "postgresql://u:s3cret-token@db/optuna"
    job = env.job("drainable", env={"TEST_OUT": str(env.out), "JOB_VAR": secret})
    sup = make(env, [job])
    unit = unit_name("hpo", 0)

    async def body() -> tuple[str, str, list[str]]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 1)
        shown = subprocess.run(
            ["systemctl", "show", "-p", "Environment", "-p", "EnvironmentFiles", "--", unit],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        transient = (Path("/run/systemd/transient") / unit).read_text()
        left = [p.name for p in (env.state / "jobs" / "hpo").glob("*.env")]
        await sup.stop()
        return shown, transient, left

    shown, transient, left = run(body())
    (info,) = env.env_files()
    assert info["JOB_VAR"] == secret  # the worker has it
    assert "EnvironmentFiles=" in shown  # as the unit's environment file ...
    assert secret not in shown and secret not in transient  # ... never its value
    assert left == []


def test_a_start_that_systemd_refuses_leaves_no_failed_unit(env: Env) -> None:
    """A missing ``cwd``: systemd-run fails (status 200/CHDIR); the crash says why and the
    failed unit is reset, so the next daemon does not report that start a second time as
    a worker that ended while it was down."""
    log = RecordingLogger()
    job = env.job("sleep", cwd=str(env.root / "no-such-dir"))
    sup = make(env, [job], log=log)

    info = run_until_failed(sup)
    assert "ExecMainStatus=200" in info.note and "No such file or directory" in info.note
    assert _load_state(unit_name("hpo", 0)) == "not-found"
    log2 = RecordingLogger()
    second = make(env, [job], log=log2)

    async def again() -> None:
        await second.start()
        await second.stop()

    run(again())
    assert log2.events("worker.unit_not_recorded") == []
    assert log2.events("worker ended while gpuwatchd was down") == []
