"""One Optuna study in a real PostgreSQL shared by workers on "two machines".

Each machine is a group of worker subprocesses with its own gpuwatchd-like view (its own
``GPUWATCHD_JOB`` and ``GPUWATCHD_SOCKET``); they share nothing but the study in the
RDB storage, as docs/design.md "Past one machine" says. A worker of machine A is
SIGKILLed mid-trial; machine A's side recovers exactly that trial while machine B keeps
running (and even holds a RUNNING trial of its own through the recovery).

The server is Debian's ``postgresql`` package, started by :mod:`pg` in a temp dir; a
missing package fails the test with the package name (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import pg
from gpuwatchd.cli import ctl
from gpuwatchd.jobs.study import (
    ATTR_FAILED_REASON,
    ATTR_PARENT,
    ATTR_RETRY,
    fail_and_requeue,
    study_stats,
)

WORKER = Path(__file__).resolve().parent / "optuna_worker.py"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg.PostgresCluster]:
    with pg.postgres_cluster() as running:
        yield running


def wait_mark(proc: subprocess.Popen[bytes], mark: Path, log: Path, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while not mark.exists():
        assert proc.poll() is None, f"worker exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {mark} after {timeout_s}s:\n{log.read_text()}"
        time.sleep(0.02)
    return int(mark.read_text())


def test_two_machines_share_a_study_and_recover_only_their_own_trial(
    cluster: pg.PostgresCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = cluster.createdb("hpo_shared")
    optuna.create_study(study_name="shared", storage=url)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(machine: str, index: int, *args: str) -> subprocess.Popen[bytes]:
        view = tmp_path / machine  # this machine's gpuwatchd state dir; no daemon runs here
        view.mkdir(exist_ok=True)
        env = dict(
            os.environ,
            GPUWATCHD_JOB=f"hpo@{machine}",
            GPUWATCHD_SOCKET=str(view / "control.sock"),
            CUDA_VISIBLE_DEVICES=str(index),
        )
        tag = f"{machine}{index}"
        with (tmp_path / f"{tag}.log").open("wb") as log:
            argv = [sys.executable, str(WORKER), url, "shared", "--tag", tag, *args]
            procs[tag] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return procs[tag]

    a_mark, b_mark, release = tmp_path / "a1.mark", tmp_path / "b1.mark", tmp_path / "release"
    try:
        start("A", 0, "--trials", "8", "--sleep", "0.05")
        a1 = start(
            "A", 1, "--trials", "8", "--sleep", "0.05", "--hang-at", "2", "--mark", str(a_mark)
        )
        start("B", 0, "--trials", "8", "--sleep", "0.05")
        b1 = start(
            "B", 1, "--trials", "4", "--sleep", "0.05",
            "--hold-at", "2", "--mark", str(b_mark), "--release", str(release),
        )  # fmt: skip
        dead = wait_mark(a1, a_mark, tmp_path / "A1.log")
        held = wait_mark(b1, b_mark, tmp_path / "B1.log")
        a1.kill()  # SIGKILL: a worker dead mid-trial, as after a device-side assert
        assert a1.wait(timeout=10) < 0

        # Machine A's gpuwatchd knows its dead worker's trial (from the hook) and recovers it.
        (result,) = fail_and_requeue(url, "shared", [dead], max_retries=2, reason="cuda_assert")

        assert (result.outcome, result.state_before, result.failed_now) == (
            "requeued", "RUNNING", True
        )  # fmt: skip
        study = optuna.load_study(study_name="shared", storage=url)
        now = {t.number: t for t in study.get_trials()}
        assert now[dead].state == TrialState.FAIL
        assert now[dead].user_attrs[ATTR_FAILED_REASON] == "cuda_assert"
        assert now[held].state == TrialState.RUNNING  # B's trial, mid-flight, untouched
        assert now[held].user_attrs["worker"] == "B1"
        assert [t.number for t in now.values() if t.state == TrialState.FAIL] == [dead]

        release.touch()
        for tag, proc in procs.items():
            if tag != "A1":
                assert proc.wait(timeout=60) == 0, (tmp_path / f"{tag}.log").read_text()
        retry = next(t for t in study.get_trials() if t.user_attrs.get(ATTR_PARENT) == dead)
        if retry.state == TrialState.WAITING:  # no worker came by since: machine A starts one
            assert start("A", 2, "--trials", "1").wait(timeout=60) == 0
    finally:
        release.touch()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    trials = {t.number: t for t in study.get_trials()}
    retry = trials[retry.number]
    assert retry.state == TrialState.COMPLETE
    assert retry.params == trials[dead].params and retry.user_attrs[ATTR_RETRY] == 1
    by_worker: dict[str, list[str]] = {}
    for trial in trials.values():
        by_worker.setdefault(trial.user_attrs["worker"], []).append(trial.state.name)
    # Every worker's trials, machine B's in particular, completed; only the killed one failed.
    assert sorted(by_worker.pop("A1")) == ["COMPLETE", "FAIL"]
    assert all(state == "COMPLETE" for states in by_worker.values() for state in states)
    assert trials[held].state == TrialState.COMPLETE
    # A0, B0 and B1 ran their n_trials (one of them may have run the retry); A2 the retry if not.
    assert sum(len(s) for s in by_worker.values()) == 8 + 8 + 4 + ("A2" in procs)
    assert {t.user_attrs["job"] for t in trials.values()} == {"hpo@A", "hpo@B"}

    (stats,) = study_stats(url, "shared")["studies"]
    assert stats["trials"] == len(trials)
    assert {s: v["count"] for s, v in stats["states"].items()} == {
        "RUNNING": 0, "WAITING": 0, "COMPLETE": len(trials) - 1, "PRUNED": 0, "FAIL": 1
    }  # fmt: skip
    assert stats["retries"]["retry_trials"] == 1
    assert ctl.main(["study", "--storage", url, "--study", "shared"]) == 0
    assert f"study shared (minimize): {len(trials)} trials" in capsys.readouterr().out


@pytest.mark.filterwarnings(
    "ignore::optuna.exceptions.ExperimentalWarning",
    "ignore::FutureWarning",  # failed_trial_callback, RetryFailedTrialCallback: as the example
    "ignore:Heartbeat of storage is supposed to be used with Study.optimize",
)
def test_optunas_own_retry_is_recognised_and_gpuwatchds_carries_optunas_attrs(
    cluster: pg.PostgresCluster, tmp_path: Path
) -> None:
    """A worker as optuna-examples' pytorch_checkpoint.py sets it up (heartbeats,
    RetryFailedTrialCallback) dies; another worker's heartbeat check retries its trial. The
    daemon, hearing of the death later, makes no second retry; when Optuna's retry dies
    too, gpuwatchd's retry continues Optuna's chain in Optuna's own system attrs."""
    url = cluster.createdb("hpo_retries")
    optuna.create_study(study_name="retries", storage=url)
    mark, log = tmp_path / "dead.mark", tmp_path / "dead.log"
    argv = [sys.executable, str(WORKER), url, "retries", "--trials", "2", "--heartbeat", "1"]
    argv += ["--retry-callback", "5", "--hang-at", "1", "--mark", str(mark)]
    with log.open("wb") as out:
        worker = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        dead = wait_mark(worker, mark, log)
    finally:
        worker.kill()
        worker.wait()

    retried: list[int] = []
    callback = optuna.storages.RetryFailedTrialCallback(max_retry=5)

    def heartbeat_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        retried.append(trial.number)
        callback(study, trial)

    storage = optuna.storages.RDBStorage(
        url, heartbeat_interval=1, failed_trial_callback=heartbeat_stale
    )
    study = optuna.load_study(study_name="retries", storage=storage)
    deadline = time.monotonic() + 30
    while not retried:  # what a surviving worker's optimize() runs at each trial start
        assert time.monotonic() < deadline, "the killed worker's trial never went stale"
        time.sleep(0.25)
        optuna.storages.fail_stale_trials(study)
    assert retried == [dead]
    (optunas,) = [t for t in study.get_trials() if t.system_attrs.get("retry_history")]

    (result,) = fail_and_requeue(url, "retries", [dead], max_retries=3, reason="cuda_assert")
    assert (result.outcome, result.requeued_as, result.retried_by) == (
        "already_requeued", optunas.number, "optuna"
    )  # fmt: skip

    running = study.ask()  # a worker pops Optuna's retry ... and dies in it
    assert running.number == optunas.number
    (result,) = fail_and_requeue(url, "retries", [running.number], max_retries=3, reason="oom")
    assert (result.outcome, result.retried_by, result.retry) == ("requeued", "gpuwatchd", 2)
    ours = next(t for t in study.get_trials() if t.number == result.requeued_as)
    rfc = optuna.storages.RetryFailedTrialCallback
    assert rfc.retried_trial_number(ours) == dead
    assert rfc.retry_history(ours) == [dead, optunas.number]
    assert ours.user_attrs[ATTR_PARENT] == optunas.number and ours.user_attrs[ATTR_RETRY] == 2
    (stats,) = study_stats(url, "retries")["studies"]
    assert stats["retries"]["made_by"] == {"gpuwatchd": 1, "optuna": 1}
    assert stats["retries"]["max_retry"] == 2


def test_missing_postgres_is_a_failure_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg, "find_bindir", lambda: None)
    with (
        pytest.raises(pytest.fail.Exception, match=r"apt-get install -y postgresql"),
        pg.postgres_cluster(),
    ):
        pass
