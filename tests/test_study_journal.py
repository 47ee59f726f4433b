"""Optuna's JournalStorage wherever gpuwatchd uses a storage: ``gpuwatchd.jobs.study``,
``gpuwatchctl study``, study setup, and a managed job under ``gpuwatchd run``.

The storage is named as in the config: ``journal:///ABS/PATH`` for Optuna's
``JournalStorage(JournalFileBackend(PATH))`` (the storage Optuna's docs recommend for
several processes without a database) and ``redis://HOST:PORT/DB`` for
``JournalRedisBackend`` on a private ``redis-server`` (tests/redis_server.py). Crashed
workers are real ``tests/optuna_worker.py`` processes killed mid-trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from conftest import BIN, RunningDaemon
from gpuwatchd.config import OptunaConfig
from gpuwatchd.errors import StudyError
from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import watch_objective
from gpuwatchd.jobs.study import (
    ATTR_PARENT,
    ATTR_RETRY,
    ATTR_RETRY_REASON,
    fail_and_requeue,
    fail_stale_trials,
    redact_url,
    study_stats,
    trials_of_worker,
)
from gpuwatchd.jobs.study_setup import ensure_study
from hpo_env import (
    TWO_EQUAL_GPUS,
    decisions,
    one_assert_job,
    optuna_storage,
    restart_study_policy,
    states,
    trials,
    wait_until_stopped,
)
from redis_server import redis_server
from test_study import Workers, mixed_objective, objective

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def journal(tmp_path: Path) -> str:
    return f"journal://{tmp_path / 'optuna.log'}"


def _ctl_study(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUWATCHD_SOCKET="/nonexistent/no-daemon.sock", COLUMNS="120")
    return subprocess.run(
        [str(BIN / "gpuwatchctl"), "study", *args],
        capture_output=True, text=True, env=env, timeout=60, cwd=cwd,
    )  # fmt: skip


def test_a_killed_workers_trial_in_a_journal_is_failed_requeued_once_and_run_again(
    journal: str, tmp_path: Path
) -> None:
    """Two real workers on one JournalStorage file hang in a trial; one is SIGKILLed.
    Exactly its trial is failed and re-enqueued (before: ``not a storage URL``)."""
    study = optuna.create_study(study_name="crashy", storage=optuna_storage(journal))
    study.optimize(mixed_objective, n_trials=6, catch=(ValueError,))
    marks = tmp_path / "dead.mark", tmp_path / "live.mark"
    hang = ("--trials", "5", "--hang-at", "1", "--mark")
    with contextlib.closing(Workers(tmp_path)) as workers:
        dead = workers.start(journal, "crashy", *hang, str(marks[0]))
        live = workers.start(journal, "crashy", *hang, str(marks[1]))
        dead_trial = workers.wait_mark(dead, marks[0])
        live_trial = workers.wait_mark(live, marks[1])
        workers.kill(dead)
        (result,) = fail_and_requeue(
            journal, "crashy", [dead_trial], max_retries=2, reason="killed"
        )
        assert (result.outcome, result.state_before) == ("requeued", "RUNNING")
        assert result.failed_now
        by_number = {t.number: t for t in trials(journal, "crashy")}
        assert by_number[dead_trial].state.name == "FAIL"
        assert by_number[live_trial].state.name == "RUNNING"  # the live worker's: untouched
    retry = by_number[result.requeued_as or -1]
    assert retry.state.name == "WAITING" and retry.user_attrs[ATTR_PARENT] == dead_trial
    assert retry.user_attrs[ATTR_RETRY] == 1 and retry.user_attrs[ATTR_RETRY_REASON] == "killed"
    again = fail_and_requeue(journal, "crashy", [dead_trial], max_retries=2, reason="killed")
    assert [(r.outcome, r.requeued_as) for r in again] == [("already_requeued", retry.number)]

    # The retry runs next, with the dead trial's params, in a fresh Optuna process.
    study = optuna.load_study(study_name="crashy", storage=optuna_storage(journal))
    study.optimize(objective, n_trials=1)
    rerun = {t.number: t for t in trials(journal, "crashy")}[retry.number]
    assert rerun.state.name == "COMPLETE" and rerun.params == by_number[dead_trial].params


def test_trials_of_worker_and_study_stats_read_a_journal(
    journal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = optuna.create_study(study_name="w", storage=optuna_storage(journal))
    monkeypatch.setenv("GPUWATCHD_WORKER_ID", "hpo.0.abc")
    with attach(job="hpo", socket=str(tmp_path / "no-daemon.sock")) as watch:
        study.optimize(watch_objective(watch, objective), n_trials=2)
        with watch.trial(study.ask()):
            pass  # trial 2 left RUNNING: the worker died in it
    found = trials_of_worker(journal, "w", "hpo.0.abc")
    assert found is not None and (found.running, found.crashed, found.finished) == ((2,), 2, 2)
    assert trials_of_worker(journal, "w", "another") is None

    stats = study_stats(journal)
    assert stats["storage"] == journal  # a path, shown as it is
    (one,) = stats["studies"]
    assert (one["study"], one["trials"]) == ("w", 3)
    assert {s: v["count"] for s, v in one["states"].items()} == {
        "RUNNING": 1, "WAITING": 0, "COMPLETE": 2, "PRUNED": 0, "FAIL": 0,
    }  # fmt: skip


def test_gpuwatchctl_study_prints_a_journals_counts(journal: str, tmp_path: Path) -> None:
    study = optuna.create_study(study_name="cli", storage=optuna_storage(journal))
    study.optimize(mixed_objective, n_trials=6, catch=(ValueError,))
    human = _ctl_study("--storage", journal, "--study", "cli")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].startswith("study cli (minimize): 6 trials, best value ")
    rows = {line.split("│")[1].strip(): line for line in lines if line.count("│") == 5}
    assert [c.strip() for c in rows["COMPLETE"].split("│")[2:4]] == ["3", "50.0"]
    assert [c.strip() for c in rows["PRUNED"].split("│")[2:4]] == ["2", "33.3"]
    assert [c.strip() for c in rows["FAIL"].split("│")[2:4]] == ["1", "16.7"]

    # $OPTUNA_STORAGE and a relative path, resolved in the working directory, as Optuna's
    # own examples name their journal file ("./optuna_journal_storage.log").
    env_run = subprocess.run(
        [str(BIN / "gpuwatchctl"), "study", "--json"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=dict(os.environ, OPTUNA_STORAGE="journal://optuna.log"),
    )  # fmt: skip
    assert env_run.returncode == 0, env_run.stderr
    stats = json.loads(env_run.stdout)
    assert stats["storage"] == "journal://optuna.log"
    assert stats["studies"][0]["states"]["COMPLETE"]["count"] == 3


def test_a_bad_journal_is_a_clear_error_with_its_path_in_clear(
    journal: str, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.log"
    result = _ctl_study("--storage", f"journal://{missing}")
    assert (result.returncode, result.stderr) == (
        1,
        f"gpuwatchctl study: no such journal file: {missing}\n",
    )
    assert not missing.exists()  # never created empty
    bare = _ctl_study("--storage", str(missing))
    assert bare.returncode == 1
    assert bare.stderr == (
        f"gpuwatchctl study: not a storage URL: '{missing}'; for Optuna's JournalStorage on "
        f"a file write journal://{missing}, for an SQLite database sqlite:///{missing}\n"
    )
    db = tmp_path / "other.sqlite3"  # an SQLite database named as a journal
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (a TEXT)")
        conn.executemany("INSERT INTO t VALUES (?)", [("x\n" * 50,)] * 50)
    conn.close()
    with pytest.raises(StudyError, match=f"^journal://{db} is not an Optuna journal file"):
        study_stats(f"journal://{db}")
    with pytest.raises(StudyError, match=r"bad journal storage 'journal:/x\.log'"):
        study_stats("journal:/x.log")
    optuna.create_study(study_name="here", storage=optuna_storage(journal))
    with pytest.raises(StudyError, match=f"^no study 'gone' in {journal}$"):
        fail_and_requeue(journal, "gone", [0], max_retries=1, reason="x")
    assert redact_url(journal) == journal


def test_fail_stale_trials_says_a_journal_has_no_heartbeats(journal: str) -> None:
    optuna.create_study(study_name="s", storage=optuna_storage(journal))
    with pytest.raises(StudyError, match="JournalStorage records no trial heartbeats"):
        fail_stale_trials(journal, "s", max_retries=1, grace_period_s=5)


def test_study_setup_creates_a_journal_and_refuses_a_missing_directory(tmp_path: Path) -> None:
    path = tmp_path / "optuna.log"
    cfg = OptunaConfig(storage=f"journal://{path}", study="s", directions=("maximize",))
    assert ensure_study(cfg) == "created" and path.is_file()
    assert ensure_study(cfg) == "loaded"
    loaded = optuna.load_study(study_name="s", storage=optuna_storage(cfg.storage))
    assert loaded.direction == optuna.study.StudyDirection.MAXIMIZE
    gone = OptunaConfig(storage=f"journal://{tmp_path}/no-such-dir/o.log", study="s")
    with pytest.raises(StudyError, match=f"the journal storage's directory {tmp_path}/no-such"):
        ensure_study(gone)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_journal_on_redis(tmp_path: Path) -> None:
    """``redis://`` is Optuna's JournalRedisBackend, on a private redis-server."""
    with redis_server(password="s3cret") as url:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalRedisBackend(url))
        study = optuna.create_study(study_name="r", storage=storage)
        study.optimize(objective, n_trials=2)
        dead = study.ask()  # a worker that died in this trial
        dead.suggest_float("x", -10.0, 10.0)
        (result,) = fail_and_requeue(url, "r", [dead.number], max_retries=1, reason="cuda_assert")
        assert result.outcome == "requeued" and result.failed_now
        stats = study_stats(url, "r")
        assert stats["storage"] == url.replace("s3cret", "***")
        counts = {s: v["count"] for s, v in stats["studies"][0]["states"].items()}
        assert counts == {"RUNNING": 0, "WAITING": 1, "COMPLETE": 2, "PRUNED": 0, "FAIL": 1}
        shown = _ctl_study("--storage", url, "--study", "r")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("study r (minimize): 4 trials, best value ")
        port = url.rsplit(":", 1)[1].split("/")[0]
    gone = f"redis://:s3cret@127.0.0.1:{port}/0"  # the server has stopped
    with pytest.raises(StudyError, match=r"^cannot open redis://:\*\*\*@127\.0\.0\.1") as caught:
        study_stats(gone)
    assert "s3cret" not in str(caught.value)


def test_a_redis_journal_without_the_redis_package_says_what_to_install(tmp_path: Path) -> None:
    """``gpuwatchctl study`` where ``import redis`` fails (a ``redis`` module that raises
    ImportError first on the path stands for the package not being installed)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "redis.py").write_text("raise ImportError('No module named redis')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker), GPUWATCHD_SOCKET="/nonexistent/no.sock")
    result = subprocess.run(
        [str(BIN / "gpuwatchctl"), "study", "--storage", "redis://h:6379/0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr == (
        "gpuwatchctl study: cannot open redis://h:6379/0: Optuna's JournalRedisBackend needs "
        "the redis package, which is not installed (pip install redis)\n"
    )


@pytest.mark.slow
def test_a_managed_job_on_a_journal_gets_its_crashed_trial_failed_and_requeued(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """``gpuwatchd run`` with a managed job whose ``optuna.storage`` is a JournalStorage
    file: its worker dies of the CUDA assert text, the trial is failed and re-enqueued
    (before: ``restart_study failed: not a storage URL: '<storage URL>'``), the study
    finishes, and ``gpuwatchctl study`` counts it."""
    url, config = one_assert_job(tmp_path, storage="journal")
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy())
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    wait_until_stopped(daemon, "hpo")
    (ready,) = [e for e in daemon.events() if e["event"] == "study.ready"]
    assert (ready["storage"], ready["outcome"]) == (url, "loaded")
    (crashed,) = [e for e in daemon.events() if e["event"] == "worker crashed"]
    assert crashed["kind"] == "cuda_assert"
    (made,) = [d for d in decisions(daemon.workdir / "state") if d["action"] == "restart_study"]
    assert made["outcome"] == "applied", made
    dead = made["params"]["trial_number"]
    by_number = {t.number: t for t in trials(url, "hpo")}
    assert by_number[dead].state.name == "FAIL"
    (retry,) = [t for t in by_number.values() if t.user_attrs.get(ATTR_PARENT) == dead]
    assert retry.user_attrs[ATTR_RETRY_REASON] == "cuda_assert"
    assert retry.state.name in ("COMPLETE", "PRUNED")
    assert f"trial {dead} re-enqueued as trial {retry.number}" in made["detail"]
    counted = states(url, "hpo")
    assert set(counted) <= {"COMPLETE", "PRUNED", "FAIL"} and counted["FAIL"] == 1, counted

    shown = _ctl_study("--storage", url, "--json")
    assert shown.returncode == 0, shown.stderr
    (study,) = json.loads(shown.stdout)["studies"]
    assert {s: v["count"] for s, v in study["states"].items() if v["count"]} == counted
    assert study["retries"]["retry_trials"] == 1
    assert daemon.stop() == 0
