"""gpuwatchd's retries and Optuna's own (``RetryFailedTrialCallback``) on real SQLite studies.

The clients are written as Optuna's examples are: heartbeats with
``failed_trial_callback=RetryFailedTrialCallback(...)`` (optuna-examples'
``pytorch/pytorch_checkpoint.py``, in ``tests/optuna_checkpoint_worker.py`` with real PyTorch
on CPU), ``study.optimize(..., n_jobs=2)`` and ``n_trials`` per process
(``tests/optuna_worker.py``). Dead workers are SIGKILLed mid-trial. A worker's heartbeat
check is Optuna's own :func:`optuna.storages.fail_stale_trials` on a storage configured as
those clients configure theirs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
from optuna.storages import RetryFailedTrialCallback
from optuna.trial import FrozenTrial, TrialState

from gpuwatchd.jobs.study import (
    ATTR_PARENT,
    ATTR_RETRY,
    ATTR_RETRY_OF,
    SYSTEM_ATTR_FAILED_TRIAL,
    SYSTEM_ATTR_RETRY_HISTORY,
    fail_and_requeue,
    study_stats,
    trials_of_worker,
)
from gpuwatchd.jobs.study_recovery import describe_requeue
from study_workers import CHECKPOINT_WORKER, Workers

BIN = Path(sys.executable).parent

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.filterwarnings(
    "ignore::optuna.exceptions.ExperimentalWarning", "ignore::FutureWarning"
)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    yield pool
    pool.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def trials_by_number(url: str, name: str) -> dict[int, FrozenTrial]:
    return {t.number: t for t in optuna.load_study(study_name=name, storage=url).get_trials()}


def retries_of(url: str, name: str, number: int) -> list[FrozenTrial]:
    """The trials that retry trial ``number`` by Optuna's own reading of a retry."""
    return [
        t
        for t in trials_by_number(url, name).values()
        if RetryFailedTrialCallback.retry_history(t)[-1:] == [number]
    ]


def optuna_heartbeat_check(url: str, name: str) -> Callable[[], list[int]]:
    """What a worker of optuna-examples' checkpoint example runs at each trial start:
    :func:`optuna.storages.fail_stale_trials` on ``RDBStorage(url, heartbeat_interval=1,
    failed_trial_callback=RetryFailedTrialCallback())`` (grace period: Optuna's default,
    2 s). The returned function runs it once and returns the numbers of the trials it failed
    (those Optuna handed to the callback).
    """
    retry = RetryFailedTrialCallback()
    failed: list[int] = []

    def callback(study: optuna.Study, trial: FrozenTrial) -> None:
        failed.append(trial.number)
        retry(study, trial)

    storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, failed_trial_callback=callback)
    study = optuna.load_study(study_name=name, storage=storage)

    def check() -> list[int]:
        failed.clear()
        optuna.storages.fail_stale_trials(study)
        return sorted(failed)

    return check


def test_a_gpuwatchd_retry_resumes_from_the_checkpoint_as_optunas_example_does(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    """optuna-examples' checkpoint example finds the checkpoint of the killed trial through
    ``RetryFailedTrialCallback.retry_history`` of its retry: so must it when gpuwatchd
    retried the trial."""
    optuna.create_study(study_name="ckpt", storage=url, direction="maximize")
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    common = (str(artifacts), "--trials", "1")
    mark = tmp_path / "epoch2.mark"
    hang = ("--hang-at-epoch", "2", "--mark", str(mark))
    dead = workers.die_in_trial(
        workers.start(url, "ckpt", *common, *hang, script=CHECKPOINT_WORKER), mark
    )

    (result,) = fail_and_requeue(url, "ckpt", [dead], max_retries=3, reason="killed")

    assert (result.outcome, result.retried_by, result.retry) == ("requeued", "gpuwatchd", 1)
    retry = trials_by_number(url, "ckpt")[result.requeued_as or -1]
    assert retry.state == TrialState.WAITING
    assert RetryFailedTrialCallback.retried_trial_number(retry) == dead
    assert RetryFailedTrialCallback.retry_history(retry) == [dead]
    assert (retry.user_attrs[ATTR_RETRY_OF], retry.user_attrs[ATTR_PARENT]) == (dead, dead)

    output = workers.finish(workers.start(url, "ckpt", *common, script=CHECKPOINT_WORKER))

    assert f"Loading checkpoint from trial {dead}, epoch 2." in output
    assert "Saving a checkpoint in epoch 0." not in output
    assert "Saving a checkpoint in epoch 4." in output
    done = trials_by_number(url, "ckpt")
    assert done[retry.number].state == TrialState.COMPLETE
    assert sorted(done[retry.number].intermediate_values) == [3, 4]  # resumed after epoch 2
    assert done[retry.number].params == done[dead].params
    assert [t.number for t in retries_of(url, "ckpt", dead)] == [retry.number]


def test_a_retry_optuna_made_is_not_made_again_and_both_makers_share_one_chain(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    optuna.create_study(study_name="both", storage=url)
    worker = ("--trials", "3", "--hook", "--heartbeat", "1", "--retry-callback", "5")

    def die_in_a_trial(worker_id: str) -> int:
        mark = tmp_path / f"{worker_id}.mark"
        env = {
            "GPUWATCHD_WORKER_ID": worker_id,
            "GPUWATCHD_SOCKET": str(tmp_path / "no-daemon.sock"),
        }
        hang = ("--hang-at", "1", "--mark", str(mark))
        return workers.die_in_trial(workers.start(url, "both", *worker, *hang, env=env), mark)

    dead = die_in_a_trial("a")
    # A surviving worker's heartbeat check fails the dead trial once it is stale and its
    # RetryFailedTrialCallback makes a WAITING retry (copying the dead trial's user attrs).
    check = optuna_heartbeat_check(url, "both")
    deadline = time.monotonic() + 30
    while check() != [dead]:
        assert time.monotonic() < deadline, "the killed worker's trial never went stale"
        time.sleep(0.25)
    (optunas,) = retries_of(url, "both", dead)
    assert optunas.state == TrialState.WAITING

    # The daemon, told later that worker "a" died: the storage still names its trial ...
    found = trials_of_worker(url, "both", "a")
    assert found is not None and found.crashed == dead and found.running == ()
    # ... and Optuna's retry is recognised: no second retry of one failure.
    (result,) = fail_and_requeue(url, "both", [dead], max_retries=2, reason="cuda_assert")
    assert (result.outcome, result.requeued_as, result.retried_by, result.retry) == (
        "already_requeued",
        optunas.number,
        "optuna",
        1,
    )
    assert [t.number for t in retries_of(url, "both", dead)] == [optunas.number]
    assert describe_requeue(result, 2) == (  # the daemon's log line and outcome detail
        f"trial {dead} already re-enqueued as trial {optunas.number} "
        "by Optuna's RetryFailedTrialCallback"
    )

    # Optuna's retry runs and dies too: gpuwatchd's retry continues the one chain.
    second = die_in_a_trial("b")
    assert second == optunas.number
    (result,) = fail_and_requeue(url, "both", [second], max_retries=2, reason="cuda_assert")
    assert (result.outcome, result.retried_by, result.retry) == ("requeued", "gpuwatchd", 2)
    ours = trials_by_number(url, "both")[result.requeued_as or -1]
    assert ours.system_attrs[SYSTEM_ATTR_FAILED_TRIAL] == dead
    assert ours.system_attrs[SYSTEM_ATTR_RETRY_HISTORY] == [dead, second]
    assert (ours.user_attrs[ATTR_RETRY_OF], ours.user_attrs[ATTR_RETRY]) == (dead, 2)

    # And dies again: the chain has its max_retries = 2 retries, one of each maker.
    third = die_in_a_trial("c")
    assert third == ours.number
    (result,) = fail_and_requeue(url, "both", [third], max_retries=2, reason="cuda_assert")
    assert (result.outcome, result.failed_now) == ("retries_exhausted", True)

    (stats,) = study_stats(url, "both")["studies"]
    assert stats["retries"] == {
        "retry_trials": 2,
        "retried_trials": 1,
        "max_retry": 2,
        "by_state": {"RUNNING": 0, "WAITING": 0, "COMPLETE": 0, "PRUNED": 0, "FAIL": 2},
        "made_by": {"gpuwatchd": 1, "optuna": 1},
    }
    env = dict(os.environ, GPUWATCHD_SOCKET=str(tmp_path / "no-daemon.sock"), COLUMNS="160")
    argv = [str(BIN / "gpuwatchctl"), "study", "--storage", url, "--study", "both"]
    human = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert human.returncode == 0, human.stderr
    assert "retries: 2 for 1 trial(s) (gpuwatchd 1, Optuna 1), longest chain 2" in human.stdout
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    retries = json.loads(as_json.stdout)["studies"][0]["retries"]
    assert retries["made_by"] == {"gpuwatchd": 1, "optuna": 1}


def test_optunas_heartbeat_check_never_retries_a_trial_gpuwatchd_retried(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    """gpuwatchd fails a dead worker's trial before Optuna's grace period is over; Optuna's
    check then never sees it RUNNING. A second dead worker's trial, which gpuwatchd leaves
    alone, shows the check did run past the grace period of both."""
    optuna.create_study(study_name="first", storage=url)
    worker = ("--trials", "3", "--heartbeat", "1", "--retry-callback", "5", "--hang-at", "1")
    marks = tmp_path / "ours.mark", tmp_path / "left.mark"
    # Both run before either dies: a worker starting later would fail the first one's
    # trial in its own heartbeat check before gpuwatchd does.
    started = [workers.start(url, "first", *worker, "--mark", str(m)) for m in marks]
    ours, left = [workers.die_in_trial(proc, m) for proc, m in zip(started, marks, strict=True)]

    (result,) = fail_and_requeue(url, "first", [ours], max_retries=3, reason="killed")
    assert result.outcome == "requeued"

    check = optuna_heartbeat_check(url, "first")
    deadline = time.monotonic() + 30
    while check() != [left]:
        assert time.monotonic() < deadline, "the second killed worker's trial never went stale"
        time.sleep(0.25)
    assert check() == []
    assert [t.number for t in retries_of(url, "first", ours)] == [result.requeued_as]
    assert len(retries_of(url, "first", left)) == 1


def _threads_waiting_on_sqlite(pid: int, tids: set[int] | None = None) -> int:
    """How many threads of ``pid`` (of ``tids`` only, if given) sleep in the kernel's
    nanosleep: SQLite's busy handler waiting for a write lock (the threads of these tests
    sleep nowhere else)."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if tids is not None and int(tid) not in tids:
            continue
        try:
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
        except OSError:
            continue
        count += "nanosleep" in wchan
    return count


def _heartbeat_age_s(db: Path, number: int) -> float:
    """Seconds since trial ``number``'s last Optuna heartbeat, by the database's clock (as
    Optuna's staleness test reads it)."""
    with sqlite3.connect(str(db)) as connection:
        (age,) = connection.execute(
            "SELECT (julianday(CURRENT_TIMESTAMP) - julianday(h.heartbeat)) * 86400.0 "
            "FROM trial_heartbeats h JOIN trials t USING (trial_id) WHERE t.number = ?",
            (number,),
        ).fetchone()
    connection.close()
    return float(age)


def _hold_write_lock(db: Path) -> sqlite3.Connection:
    """Another process's write transaction on ``db``, as a worker committing its trial:
    readers go on, writers wait (SQLite's busy timeout, 5 s in Python's sqlite3)."""
    lock = sqlite3.connect(str(db), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    return lock


def _release_when(lock: sqlite3.Connection, waiting: Callable[[], bool]) -> None:
    """ROLLBACK once ``waiting()`` holds, or after 3 s (under the writers' 5 s timeout)."""
    deadline = time.monotonic() + 3.0
    while not waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    lock.execute("ROLLBACK")
    lock.close()


def test_an_n_jobs_worker_runs_each_gpuwatchd_retry_once(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    """Both threads of ``optimize(n_jobs=2)`` ask for a trial while another writer holds
    SQLite's lock: both read the same WAITING retry; only one may run it. Before the fix
    both ran it, a WAITING retry was left over, and when one thread finished first the
    other died on ``ValueError: Cannot tell a COMPLETE trial.``"""
    study = optuna.create_study(study_name="njobs", storage=url)
    dead = []
    for _ in range(4):  # a dead worker's four trials (n_jobs=4), as the storage holds them
        trial = study.ask()
        trial.suggest_float("x", -10.0, 10.0)
        trial.suggest_int("y", 0, 100)
        dead.append(trial.number)
    results = fail_and_requeue(url, "njobs", dead, max_retries=3, reason="cuda_assert")
    retries = sorted(r.requeued_as for r in results if r.requeued_as is not None)
    assert len(retries) == 4

    lock = _hold_write_lock(tmp_path / "optuna.db")
    worker = workers.start(url, "njobs", "--trials", "4", "--n-jobs", "2")
    _release_when(lock, lambda: _threads_waiting_on_sqlite(worker.pid) >= 2)
    output = workers.finish(worker)

    ran = sorted(int(line.split()[1]) for line in output.splitlines() if line.startswith("ran "))
    assert ran == retries, output  # each retry once, nothing else
    final = trials_by_number(url, "njobs")
    assert {n: final[n].state for n in retries} == dict.fromkeys(retries, TrialState.COMPLETE)
    assert not [t for t in final.values() if t.state == TrialState.WAITING]


def test_two_heartbeat_checks_on_sqlite_make_one_retry_of_a_stale_trial(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    """Two workers' heartbeat checks (Optuna's fail_stale_trials with
    RetryFailedTrialCallback) find the same stale trial at once, in a study gpuwatchd has
    recovered a crash of: one of them fails it and retries it, never both."""
    optuna.create_study(study_name="stale", storage=url)
    worker = ("--trials", "3", "--heartbeat", "1", "--hang-at", "1")
    marks = tmp_path / "a.mark", tmp_path / "b.mark"
    started = [workers.start(url, "stale", *worker, "--mark", str(m)) for m in marks]
    first, stale = [workers.die_in_trial(proc, m) for proc, m in zip(started, marks, strict=True)]
    (result,) = fail_and_requeue(url, "stale", [first], max_retries=3, reason="killed")
    assert result.outcome == "requeued"
    deadline = time.monotonic() + 30
    while _heartbeat_age_s(tmp_path / "optuna.db", stale) < 3:  # stale: over the 2 s grace
        assert time.monotonic() < deadline, "the killed worker's trial never went stale"
        time.sleep(0.25)

    checks = [optuna_heartbeat_check(url, "stale") for _ in range(2)]
    failed: list[list[int]] = [[], []]
    tids: set[int] = set()

    def run(i: int) -> None:
        tids.add(threading.get_native_id())
        failed[i] = checks[i]()

    lock = _hold_write_lock(tmp_path / "optuna.db")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    _release_when(lock, lambda: _threads_waiting_on_sqlite(os.getpid(), tids) >= 2)
    for thread in threads:
        thread.join(timeout=30)

    assert sorted(failed) == [[], [stale]]
    assert len(retries_of(url, "stale", stale)) == 1
