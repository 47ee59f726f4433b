"""Supervisor cases that exist only with the systemd launcher: systemd keeps an ended
worker unit's exit status, and a running unit names its slot even when ``workers.json``
does not. Not collected by ``make test`` directly (no ``test_`` prefix):
tests/test_supervisor_units.py runs this file inside a booted systemd, with
``GPUWATCHD_TEST_LAUNCHER=systemd``; elsewhere each case fails saying so."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import replace
from typing import Any

import pytest

from gpuwatchd.supervisor import STATE_FILE, WorkerCrash, WorkerInfo
from gpuwatchd.supervisor.adoption import UNIT_CLEAN_NOTE
from gpuwatchd.supervisor.transient_unit import unit_name
from test_supervisor import LAUNCHER, Env, RecordingLogger, alive, env, make, run, until

__all__ = ["env"]  # the fixture, used by name


@pytest.fixture(autouse=True)
def _inside_systemd() -> None:
    assert LAUNCHER == "systemd", "run by tests/test_supervisor_units.py inside systemd"


def _load_state(unit: str) -> str:
    done = subprocess.run(
        ["systemctl", "show", "-p", "LoadState", "--value", "--", unit],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return done.stdout.strip()


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


def test_a_unit_that_ended_while_no_daemon_ran_is_read_exactly(env: Env) -> None:
    """Worker 0 exits 0 and worker 1 is SIGKILLed while no supervisor runs: the next one
    reads each unit's status (no exit_hint asked), holds 0 finished, reports 1's SIGKILL."""
    left = _leave_two(env)
    pids = [w.pid for w in left if w.pid is not None]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    os.kill(pids[0], signal.SIGUSR1)  # exits 0
    os.kill(pids[1], signal.SIGKILL)

    async def gone() -> None:
        await until(lambda: not alive(pids[0]) and not alive(pids[1]))

    run(gone())
    assert _load_state(unit_name("hpo", 0)) == "loaded"  # kept: RemainAfterExit=yes
    asked: list[int] = []
    crashes: list[WorkerCrash] = []

    async def hint(job: str, pid: int, worker_id: str | None, quiet: bool) -> bool:
        asked.append(pid)
        return True  # would call every end clean: it must not be needed

    log = RecordingLogger()
    second = make(env, [env.job("drainable", workers=2)], on_crash=crashes.append,
                  exit_hint=hint, log=log)  # fmt: skip

    async def body() -> list[WorkerInfo]:
        await second.start()
        at_start = second.workers("hpo")
        await second.stop()
        return at_start

    at_start = run(body())
    assert asked == []
    by_worker = {w.worker: w for w in at_start}
    assert (by_worker[0].state, by_worker[0].held, by_worker[0].note) == (
        "stopped", "finished", UNIT_CLEAN_NOTE,
    )  # fmt: skip
    down = [c for c in crashes if not c.intentional]
    assert [(c.worker, c.pid, c.returncode) for c in down] == [(1, pids[1], -signal.SIGKILL)]
    assert down[0].crash_info.signal == "SIGKILL"
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
    second = make(env, [env.job("drainable", workers=2)], log=log)

    async def body() -> list[WorkerInfo]:
        await second.start()
        infos = second.workers("hpo")
        await second.stop()
        return infos

    adopted = run(body())
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
    crashes: list[WorkerCrash] = []
    job = env.job(
        "done",
        unit_properties={"ProtectSystem": "strict", "ReadWritePaths": str(env.out)},
    )
    job = replace(job, command=(job.command[0], str(probe), str(env.root / "denied")))
    sup = make(env, [job], on_crash=crashes.append)

    async def body() -> WorkerInfo:
        await sup.start()
        await until(lambda: sup.workers("hpo")[0].state == "failed", what="environment failure")
        info = sup.workers("hpo")[0]
        await sup.stop()
        return info

    info = run(body())
    assert (env.out / "allowed").read_text() == "written"  # under ReadWritePaths=
    assert not (env.root / "denied").exists()
    (crash,) = [c for c in crashes if not c.intentional]
    assert crash.crash_info.kind == "environment"
    assert "Read-only file system" in (crash.crash_info.evidence or "")
    assert info.restarts == 0 and info.note.startswith("environment failure at start")
