"""Tests for gpuwatchd.hpo.crashes: crash recovery on real SQLite Optuna studies, and the
path of a crash event through the control server's bounded queue to the ledger."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatchd.config import JobConfig, OptunaConfig, Settings
from gpuwatchd.control.server import ControlServer
from gpuwatchd.crash import CrashInfo
from gpuwatchd.daemon import Daemon
from gpuwatchd.hpo.crashes import SupervisorActions
from gpuwatchd.hpo.ledger import CrashLedger
from gpuwatchd.hpo.study_recovery import StudyRecovery
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision, JobEvent
from gpuwatchd.supervisor import Supervisor, WorkerCrash

PY = sys.executable


def test_a_crash_event_dropped_from_the_queue_keeps_its_ledger_entry(tmp_path: Path) -> None:
    """The server's event queue is bounded: a crash event pushed out of it must not hand
    its ledger key to a later event (which would then delete the entry when journaled).
    Failed before the fix, when the daemon keyed its posted events by ``id(event)``."""
    state = tmp_path / "state"
    state.mkdir()
    daemon = Daemon(Settings(devices="none", state_dir=str(state)))
    daemon.open_samplers()
    server = ControlServer(str(tmp_path / "sock"), daemon.handle)  # never started: a queue
    daemon.server = server
    crash = _crash(3)
    key = CrashLedger.key(crash.job, crash.pid)
    daemon.crashes.ledger.add(crash)
    daemon.crashes.post(crash, key)
    for i in range(10_000):  # the queue's bound: the crash event is dropped
        server.post_event(JobEvent(1001.0, "other", "oom", pid=7, message=str(i)))
    for _ in range(100):  # new events, allocated after the crash event was freed
        server.post_event(JobEvent(1002.0, "other", "oom", pid=7))
    daemon.tick()
    assert key in daemon.crashes.ledger
    pending = CrashLedger(daemon.crashes.ledger.path, get_logger("t")).load()
    assert [(c.job, c.pid) for c in pending] == [("hpo", 4242)]


def test_a_crash_event_a_tick_took_leaves_the_ledger(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    daemon = Daemon(Settings(devices="none", state_dir=str(state)))
    daemon.open_samplers()
    daemon.server = ControlServer(str(tmp_path / "sock"), daemon.handle)
    crash = _crash(3)
    key = CrashLedger.key(crash.job, crash.pid)
    daemon.crashes.ledger.add(crash)
    daemon.crashes.post(crash, key)
    snapshot = daemon.tick()
    assert [(e.kind, e.pid) for e in snapshot.events] == [("crash", 4242)]
    assert key not in daemon.crashes.ledger
    assert CrashLedger(daemon.crashes.ledger.path, get_logger("t")).load() == []


# -- Optuna recovery on a real SQLite study ---------------------------------------------------


def _study(tmp_path: Path) -> tuple[OptunaConfig, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    return OptunaConfig(storage=url, study="s", max_retries=2), study


def _running_trial(study: Any) -> int:
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    return int(trial.number)


def _actions(tmp_path: Path, optuna: OptunaConfig) -> SupervisorActions:
    job = JobConfig(name="hpo", command=(PY, "-c", "pass"), optuna=optuna)
    supervisor = Supervisor([job], state_dir=tmp_path / "state", socket_path=tmp_path / "s")
    return SupervisorActions(supervisor, [job], StudyRecovery(get_logger("t")), get_logger("t"))


def _crash(trial: int | None, *, intentional: bool = False, pid: int = 4242) -> WorkerCrash:
    info = CrashInfo("cuda_assert", "CUDA device-side assert (killed by SIGABRT)", "SIGABRT")
    return WorkerCrash(
        job="hpo",
        worker=0,
        pid=pid,
        gpu_index=0,
        crash_info=info,
        trial_number=trial,
        stderr_tail="",
        timestamp_s=time.time(),
        returncode=-6,
        uptime_s=3.0,
        intentional=intentional,
    )


def _restart_study(trial: int, pid: int = 4242) -> Decision:
    params = {
        "job": "hpo",
        "pid": pid,
        "crash_kind": "cuda_assert",
        "gpu_index": 0,
        "trial_number": trial,
        "max_retries": 2,
        "backoff_s": 5.0,
    }
    return Decision("crashed-trials-restart", "restart_study", params, time.time(), (), job="hpo")


def test_a_crash_fails_its_trial_at_once_and_restart_study_requeues_it_once(
    tmp_path: Path,
) -> None:
    optuna_cfg, study = _study(tmp_path)
    number = _running_trial(study)
    actions = _actions(tmp_path, optuna_cfg)

    async def main() -> tuple[str, list[str]]:
        handled = await actions.handle_crash(_crash(number))
        # Two decisions about the same crash at once (a repeated event, a restart): the
        # storage lock makes the second one see the first one's retry.
        details = await asyncio.gather(
            actions.restart_study(_restart_study(number)),
            actions.restart_study(_restart_study(number)),
        )
        return handled, list(details)

    handled, details = asyncio.run(main())
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[number].state.name == "FAIL"
    assert trials[number].user_attrs["gpuwatchd:failed_reason"] == "cuda_assert"
    assert handled == f"trial {number} marked FAIL"
    retries = [t for t in trials.values() if t.user_attrs.get("gpuwatchd:parent") == number]
    assert len(retries) == 1 and retries[0].state.name == "WAITING"
    assert sorted(d.split(";")[0] for d in details) == [
        f"trial {number} already re-enqueued as trial {retries[0].number}",
        f"trial {number} re-enqueued as trial {retries[0].number} (retry 1/2)",
    ]
    # This (unstarted) supervisor has no such worker slot: said, not hidden.
    assert all(
        d.endswith("worker 0 was removed (parallelism lowered): nothing to relaunch")
        for d in details
    )


def test_a_worker_stopped_by_the_daemon_gets_its_trial_requeued_by_the_job_limit(
    tmp_path: Path,
) -> None:
    optuna_cfg, study = _study(tmp_path)
    number = _running_trial(study)
    actions = _actions(tmp_path, optuna_cfg)
    detail = asyncio.run(actions.handle_crash(_crash(number, intentional=True)))
    assert detail.startswith(f"trial {number} marked FAIL, re-enqueued as trial")
    (retry,) = [t for t in study.get_trials() if t.user_attrs.get("gpuwatchd:parent") == number]
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "stopped"
    assert retry.user_attrs["gpuwatchd:max_retries"] == 2


def test_an_unknown_trial_without_heartbeats_is_said_not_guessed(tmp_path: Path) -> None:
    optuna_cfg, study = _study(tmp_path)
    number = _running_trial(study)
    actions = _actions(tmp_path, optuna_cfg)
    detail = asyncio.run(actions.handle_crash(_crash(None)))
    assert detail == "trial unknown (the hook had not reported one)"
    assert study.get_trials()[number].state.name == "RUNNING"  # other workers' trials untouched
