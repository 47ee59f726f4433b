"""No trial left RUNNING (issue 20, item 4): the orphan rule (gpuwatchd.jobs.orphans) on
its own, and a real ``gpuwatchd run`` killed together with its worker inside the window
between Optuna's ``ask`` and the hook's tag (``tests/optuna_worker.py --hook
--pause-before-tag``: the trial is RUNNING and names no worker), then started again on
the same state: the trial is failed, re-enqueued and run, the study ends with no trial
RUNNING or WAITING."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import subprocess
import sys
import time
import zoneinfo
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog import get_logger

from conftest import REPO, RunningDaemon, restart_on_same_state
from gpuwatchd.config import JobConfig, OptunaConfig
from gpuwatchd.jobs.orphans import (
    RECHECK_S,
    SWEEP_INTERVAL_S,
    OrphanSweeper,
    WorkersTimeZone,
    find_orphans,
)
from gpuwatchd.jobs.records import TrialHolder
from gpuwatchd.jobs.study import RunningTrial
from hpo_env import (
    LOG_CRASHES,
    TWO_EQUAL_GPUS,
    make_study,
    managed_workers,
    python_on_path,
    states,
    trials,
    write_config,
)

WORKER = REPO / "tests" / "optuna_worker.py"


def test_a_tagged_trial_is_held_only_by_its_launch() -> None:
    running = [RunningTrial(1, "job.0.a", 100.0), RunningTrial(2, "job.1.b", 100.0)]
    holders = [TrialHolder("job.0.a", 50.0)]
    assert find_orphans(running, holders) == [2]
    assert find_orphans(running, []) == [1, 2]


def test_an_untagged_trial_is_an_orphan_only_when_every_live_worker_is_younger() -> None:
    """Between ``ask`` and the hook's tag a trial names no worker: any launch that
    started before the trial may hold it; one started after it cannot."""
    untagged = [RunningTrial(7, None, 100.0)]
    assert find_orphans(untagged, []) == [7]  # nobody alive
    assert find_orphans(untagged, [TrialHolder("a", 101.0), TrialHolder("b", 150.0)]) == [7]
    assert find_orphans(untagged, [TrialHolder("a", 99.0), TrialHolder("b", 150.0)]) == []
    assert find_orphans(untagged, [TrialHolder("a", None)]) == []  # start unknown: may hold
    assert find_orphans([RunningTrial(8, None, None)], []) == []  # start unknown: left alone


class _WorkerBeingStarted:
    """A supervisor whose one job's worker is being started: who holds trials is not
    known yet (``trial_holders`` None), and the job has not finished."""

    job_names = ("hpo",)

    def job_states(self) -> tuple[()]:
        return ()

    def trial_holders(self, jobs: object) -> None:
        return None


class _OneUntaggedTrial:
    """A study whose trial 1 is RUNNING, untagged, started at 100 s."""

    def __init__(self) -> None:
        self.failed: list[int] = []

    async def abandon_waiting_retries(self, optuna: OptunaConfig, reason: str) -> list[int]:
        return []

    async def running_trials(self, optuna: OptunaConfig, tz: object = None) -> list[RunningTrial]:
        return [RunningTrial(1, None, 100.0)]

    async def fail_and_requeue(self, *args: object, **kwargs: object) -> list[object]:
        self.failed.append(1)
        return []


def test_a_sweep_put_off_while_a_worker_is_being_started_looks_again_soon() -> None:
    """Seen under load: the daemon restarted, its first sweep came while the job's worker
    was being started and was put off for the whole 10-s interval; meanwhile the lone
    worker (``n_trials`` 3) asked all its trials, so the orphan's retry was enqueued too
    late to run and was failed as "job finished before the retry ran". A put-off sweep
    looks again in RECHECK_S."""
    optuna = OptunaConfig(storage="sqlite:///unused.db", study="s", max_retries=2)
    job = JobConfig(name="hpo", command=(sys.executable, "-c", "pass"), optuna=optuna)
    study = _OneUntaggedTrial()
    now_s = [1000.0]
    sweeper = OrphanSweeper(
        _WorkerBeingStarted(),  # type: ignore[arg-type]
        [job],
        study,  # type: ignore[arg-type]
        get_logger("t"),
        clock=lambda: now_s[0],
    )
    assert sweeper.due()
    assert asyncio.run(sweeper.sweep()) == []
    assert not sweeper.due(1000.0 + RECHECK_S - 0.01)
    assert sweeper.due(1000.0 + RECHECK_S)
    assert RECHECK_S < SWEEP_INTERVAL_S
    assert study.failed == []  # nothing judged while holders are unknown


@pytest.mark.slow
def test_a_trial_asked_but_untagged_when_daemon_and_worker_die_together_is_retried(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "ask")
    mark = tmp_path / "asked"
    command = [
        "python", str(WORKER), url, "ask", "--trials", "3", "--hook", "--sleep", "0.3",
        "--pause-before-tag", "2", "--mark", str(mark),
    ]  # fmt: skip
    job = {
        "command": command,
        "env": python_on_path(),
        "cwd": str(tmp_path),
        "workers": 1,
        "optuna": {"storage": url, "study": "ask", "max_retries": 2},
        "restart": {"backoff": "0.2s"},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(LOG_CRASHES)
    args = ["--config", str(config), "--policies", str(policies)]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="first")
    first.wait_until(mark.exists, timeout_s=120, what="the worker paused after ask")
    asked = int(mark.read_text())
    (worker,) = managed_workers(first.status(), "hpo")
    orphan = trials(url, "ask")[asked]
    assert orphan.state.name == "RUNNING" and "gpuwatchd:worker_id" not in orphan.user_attrs

    # As systemd kills a unit's control group: freeze both, then kill both.
    pids = [first.process.pid, worker["pid"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    first.process.wait(timeout=10)

    # The relaunched worker (3 trials of 0.3 s) starts only once the orphan is failed and
    # its retry enqueued: it asks the retry first, never finishing without it.
    second = restart_on_same_state(run_daemon, first, args, script=TWO_EQUAL_GPUS)
    second.wait_until(
        lambda: (
            states(url, "ask").get("COMPLETE", 0) >= 3
            and not {"RUNNING", "WAITING"} & set(states(url, "ask"))
        ),
        timeout_s=120,
        what="the study to finish with no trial RUNNING or WAITING",
    )
    by_number = {t.number: t for t in trials(url, "ask")}
    failed = by_number[asked]
    assert failed.state.name == "FAIL"
    assert failed.user_attrs["gpuwatchd:failed_reason"] == "orphaned"
    (retry,) = [t for t in by_number.values() if t.user_attrs.get("gpuwatchd:parent") == asked]
    assert retry.state.name == "COMPLETE", (retry.user_attrs, second.log_path.read_text()[-6000:])
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "orphaned"
    assert retry.number == asked + 1  # enqueued before the relaunch asked any trial
    orphaned = [e for e in second.events() if e["event"] == "study.trial_orphaned"]
    assert [e["trial"] for e in orphaned] == [asked]
    assert second.stop() == 0


@pytest.mark.slow
def test_a_retry_left_waiting_when_every_worker_finished_is_failed_not_left_open(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A study's stop rule ends every worker (exit 0) while a retry is being enqueued
    (seen in the systemd chaos variant: the policy's retry came a tick after the last
    worker had stopped): no worker will pop it, so the sweep fails it with its reason
    instead of leaving it WAITING. A trial the user enqueued is left alone."""
    import optuna

    from gpuwatchd.jobs.study import fail_and_requeue

    url = make_study(tmp_path, "done")
    command = ["python", str(WORKER), url, "done", "--trials", "1", "--hook"]
    job = {
        "command": command,
        "env": python_on_path(),
        "cwd": str(tmp_path),
        "workers": 1,
        "optuna": {"storage": url, "study": "done", "max_retries": 2},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(LOG_CRASHES)
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    daemon.wait_until(
        lambda: [w["held"] for w in managed_workers(daemon.status(), "hpo")] == ["finished"],
        timeout_s=60,
        what="the only worker to finish",
    )
    study = optuna.load_study(study_name="done", storage=url)
    failed = study.ask({"x": optuna.distributions.FloatDistribution(-10, 10)})
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    (result,) = fail_and_requeue(url, "done", [failed.number], max_retries=2, reason="cuda_assert")
    assert result.outcome == "requeued" and result.requeued_as is not None
    study.enqueue_trial({"x": 1.0})  # the user's own: not a retry

    def state_of(number: int) -> str:
        return str(trials(url, "done")[number].state.name)

    daemon.wait_until(
        lambda: state_of(result.requeued_as) == "FAIL", timeout_s=40, what="the retry failed"
    )
    abandoned = trials(url, "done")[result.requeued_as]
    assert abandoned.user_attrs["gpuwatchd:failed_reason"] == "job finished before the retry ran"
    assert [t.state.name for t in trials(url, "done")][-1] == "WAITING"  # the user's
    logged = [e for e in daemon.events() if e["event"] == "study.retry_abandoned"]
    assert [e["trial"] for e in logged] == [result.requeued_as]
    assert daemon.stop() == 0


def test_a_tag_optunas_retry_copied_from_its_dead_parent_is_no_tag(tmp_path: Path) -> None:
    """Optuna's RetryFailedTrialCallback copies the failed trial's user attrs, the dead
    launch's gpuwatchd:worker_id with them, into its retry; a live worker without the
    hook's trial scope runs the retry under that copied tag. The sweep must not read it as
    the dead launch's trial (it would fail a live worker's trial on every sweep)."""
    import optuna

    from gpuwatchd.jobs.study import running_trials

    url = make_study(tmp_path, "copied")
    study = optuna.load_study(study_name="copied", storage=url)
    dead = study.ask()
    dead.set_user_attr("gpuwatchd:worker_id", "hpo.0.dead")
    study.tell(dead, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial(
        {}, user_attrs={"gpuwatchd:worker_id": "hpo.0.dead"}
    )  # as the callback does, then:
    storage = study._storage
    (waiting,) = [t for t in study.get_trials() if t.state.name == "WAITING"]
    storage.set_trial_system_attr(waiting._trial_id, "failed_trial", dead.number)
    storage.set_trial_system_attr(waiting._trial_id, "retry_history", [dead.number])
    live = study.ask()  # a live worker pops the retry
    assert live.number == waiting.number
    (found,) = running_trials(url, "copied")
    assert (found.number, found.worker_id) == (live.number, None)


def _zone_not_ours() -> str:
    """An IANA zone whose offset now differs from this process's local one by hours."""
    local = time.localtime().tm_gmtoff
    for name in ("Asia/Tokyo", "America/Los_Angeles"):
        offset = datetime.datetime.now(zoneinfo.ZoneInfo(name)).utcoffset()
        assert offset is not None
        if abs(offset.total_seconds() - local) >= 3 * 3600:
            return name
    raise AssertionError("no zone far from the local one")  # Tokyo and LA are 16-17 h apart


def test_a_worker_in_another_time_zone_is_no_orphan_maker(tmp_path: Path) -> None:
    """A worker whose job sets ``env: TZ`` to another zone than the daemon's asks a trial
    (untagged, as in the window before the hook's tag), then keeps running: the sweep
    must read that start as the moment it was. Hours off, the worker that started just
    before the ask looked younger (west of the daemon: the live worker's trial failed as
    an orphan) or an orphan looked held forever (east). Optuna 4 stores the worker's
    naive local time (read in the job's zone); Optuna 5 stores UTC and hands back the
    reader's local time (the zone must then not be applied again: 9 h off, as a first
    version of this fix did)."""
    from gpuwatchd.config import JobConfig
    from gpuwatchd.jobs.orphans import workers_time_zone
    from gpuwatchd.jobs.study import running_trials

    url = make_study(tmp_path, "tz")
    zone = _zone_not_ours()
    env = dict(os.environ, TZ=zone)
    worker_started_s = time.time()
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import optuna, sys; optuna.logging.set_verbosity(optuna.logging.ERROR); "
            "optuna.load_study(study_name='tz', storage=sys.argv[1]).ask()",
            url,
        ],
        env=env,
        check=True,
        timeout=120,
    )
    assert asked.returncode == 0
    job = JobConfig(name="hpo", command=("true",), env={"TZ": zone})
    found = workers_time_zone([job])
    assert found.known and found.tz == zoneinfo.ZoneInfo(zone)
    (trial,) = running_trials(url, "tz", found.tz)
    assert trial.started_s is not None and trial.started_s >= worker_started_s - 1.0
    # the worker started before its ask holds the untagged trial; one started after not
    worker = TrialHolder(None, worker_started_s - 1.0)
    assert find_orphans([trial], [worker]) == []
    assert find_orphans([trial], [TrialHolder(None, time.time() + 1.0)]) == [trial.number]
    # a TZ that no IANA name reads (a POSIX rule) is not guessed: only tagged trials judged
    posix = JobConfig(name="hpo", command=("true",), env={"TZ": "XXX-5"})
    assert workers_time_zone([posix]) == workers_time_zone([job, posix]) == WorkersTimeZone(False)
