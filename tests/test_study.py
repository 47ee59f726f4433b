"""gpuwatchd.jobs.study and ``gpuwatchctl study`` on real Optuna studies in SQLite.

Crashed workers are real: ``tests/optuna_worker.py`` subprocesses killed with SIGKILL in
the middle of a trial, leaving it RUNNING in the storage as a dead CUDA process would.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from gpuwatchd.cli import ctl
from gpuwatchd.errors import StudyError
from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import watch_objective
from gpuwatchd.jobs.study import (
    ATTR_FAILED_REASON,
    ATTR_MAX_RETRIES,
    ATTR_PARENT,
    ATTR_RETRY,
    ATTR_RETRY_OF,
    ATTR_RETRY_REASON,
    fail_and_requeue,
    fail_stale_trials,
    redact_url,
    study_stats,
    trials_of_worker,
)
from study_workers import Workers

BIN = Path(sys.executable).parent

optuna.logging.set_verbosity(optuna.logging.WARNING)


def objective(trial: optuna.Trial) -> float:
    """The same search space as the worker script; never fails."""
    x = trial.suggest_float("x", -10.0, 10.0)
    y = trial.suggest_int("y", 0, 100)
    return (x - 2.0) ** 2 + y / 100.0


def mixed_objective(trial: optuna.Trial) -> float:
    """Trials 1 and 4 are pruned, trial 3 raises (FAIL); the rest complete."""
    value = objective(trial)
    if trial.number in (1, 4):
        trial.report(value, step=0)
        raise optuna.TrialPruned()
    if trial.number == 3:
        raise ValueError("objective failed")
    return value


def states(study: optuna.Study) -> dict[int, str]:
    return {t.number: t.state.name for t in study.get_trials(deepcopy=False)}


def by_number(study: optuna.Study, number: int) -> FrozenTrial:
    return next(t for t in study.get_trials() if t.number == number)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    yield pool
    pool.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def crashed_study(url: str, workers: Workers, tmp_path: Path) -> tuple[optuna.Study, int, int]:
    """Trials 0-5 COMPLETE/PRUNED/FAIL in-process; then two worker subprocesses each
    hang in a trial, and one of them is SIGKILLed. Returns (study, dead trial, live trial)."""
    study = optuna.create_study(
        study_name="crashy", storage=url, sampler=optuna.samplers.RandomSampler(seed=1)
    )
    study.optimize(mixed_objective, n_trials=6, catch=(ValueError,))
    marks = tmp_path / "dead.mark", tmp_path / "live.mark"
    dead = workers.start(url, "crashy", "--trials", "5", "--hang-at", "1", "--mark", str(marks[0]))
    live = workers.start(url, "crashy", "--trials", "5", "--hang-at", "1", "--mark", str(marks[1]))
    dead_trial = workers.wait_mark(dead, marks[0])
    live_trial = workers.wait_mark(live, marks[1])
    workers.kill(dead)
    return study, dead_trial, live_trial


def test_killed_worker_trial_is_failed_requeued_once_and_run_again(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    study, dead, live = crashed_study(url, workers, tmp_path)
    before = states(study)
    assert sorted(before.values()).count("RUNNING") == 2
    assert before[dead] == before[live] == "RUNNING"
    assert [before[n] for n in range(6)] == [
        "COMPLETE",
        "PRUNED",
        "COMPLETE",
        "FAIL",
        "PRUNED",
        "COMPLETE",
    ]
    dead_params = by_number(study, dead).params
    assert set(dead_params) == {"x", "y"}

    (result,) = fail_and_requeue(url, "crashy", [dead], max_retries=3, reason="cuda_assert")

    assert result.outcome == "requeued"
    assert result.state_before == "RUNNING" and result.failed_now
    assert result.retry == 1 and result.params == dead_params
    after = states(study)
    retry = result.requeued_as
    assert retry == max(before) + 1
    # Exactly the dead worker's trial changed; the live worker's RUNNING trial is untouched.
    assert after == {**before, dead: "FAIL", retry: "WAITING"}
    failed = by_number(study, dead)
    assert failed.user_attrs[ATTR_FAILED_REASON] == "cuda_assert"
    assert failed.datetime_complete is not None
    waiting = by_number(study, retry)
    assert waiting.user_attrs == {
        ATTR_RETRY_OF: dead,
        ATTR_PARENT: dead,
        ATTR_RETRY: 1,
        ATTR_RETRY_REASON: "cuda_assert",
        ATTR_MAX_RETRIES: 3,
    }

    # Idempotent: the same event handled again (a restarted daemon) enqueues nothing new.
    again = fail_and_requeue(url, "crashy", [dead, dead], max_retries=3, reason="cuda_assert")
    assert [r.outcome for r in again] == ["already_requeued", "already_requeued"]
    assert {r.requeued_as for r in again} == {retry} and not any(r.failed_now for r in again)
    assert states(study) == after

    # The next optimize picks the retry up first, with the dead trial's params.
    study.optimize(objective, n_trials=1)
    rerun = by_number(study, retry)
    assert rerun.state == TrialState.COMPLETE
    assert rerun.params == dead_params
    assert rerun.user_attrs[ATTR_RETRY_OF] == dead
    assert states(study)[live] == "RUNNING"


def test_stats_match_the_sql_people_run_by_hand(url: str, workers: Workers, tmp_path: Path) -> None:
    _study, dead, _live = crashed_study(url, workers, tmp_path)
    fail_and_requeue(url, "crashy", [dead], max_retries=3, reason="cuda_assert")

    (stats,) = study_stats(url, "crashy")["studies"]

    db = sqlite3.connect(str(tmp_path / "optuna.db"))
    by_state = dict(db.execute("SELECT state, count(*) FROM trials GROUP BY state").fetchall())
    mean_complete = db.execute(
        "SELECT avg((julianday(datetime_complete) - julianday(datetime_start)) * 86400.0) "
        "FROM trials WHERE state = 'COMPLETE'"
    ).fetchone()[0]
    best = db.execute(
        "SELECT t.number, v.value FROM trials t JOIN trial_values v USING (trial_id) "
        "WHERE t.state = 'COMPLETE' ORDER BY v.value LIMIT 1"
    ).fetchone()
    db.close()
    total = sum(by_state.values())
    assert stats["trials"] == total == 9
    assert {s: v["count"] for s, v in stats["states"].items() if v["count"]} == by_state
    assert by_state == {"COMPLETE": 3, "PRUNED": 2, "FAIL": 2, "RUNNING": 1, "WAITING": 1}
    assert stats["states"]["FAIL"]["pct"] == pytest.approx(100 * 2 / 9)
    assert stats["states"]["COMPLETE"]["mean_duration_s"] == pytest.approx(mean_complete, abs=1e-3)
    assert stats["pruned_pct"] == pytest.approx(40.0)
    assert (stats["best_trial"], stats["best_value"]) == (best[0], pytest.approx(best[1]))
    assert stats["retries"] == {
        "retry_trials": 1,
        "retried_trials": 1,
        "max_retry": 1,
        "by_state": {"RUNNING": 0, "WAITING": 1, "COMPLETE": 0, "PRUNED": 0, "FAIL": 0},
        "made_by": {"gpuwatchd": 1, "optuna": 0},
    }
    assert stats["trials_per_hour"]["last_hour"] == 7  # every finished trial is a few s old


def test_max_retries_bounds_a_chain_of_retries(url: str) -> None:
    study = optuna.create_study(study_name="chain", storage=url)
    first = study.ask()  # a real RUNNING trial, as a worker holds it
    params = {"x": first.suggest_float("x", -10.0, 10.0), "y": first.suggest_int("y", 0, 100)}
    numbers = [first.number]
    results = []
    for _ in range(3):
        (result,) = fail_and_requeue(url, "chain", [numbers[-1]], max_retries=2, reason="oom")
        results.append(result)
        if result.requeued_as is None:
            break
        trial = study.ask()  # pops the WAITING retry: the next worker runs it ...
        assert trial.number == result.requeued_as
        assert trial.suggest_float("x", -10.0, 10.0) == params["x"]
        assert trial.suggest_int("y", 0, 100) == params["y"]
        numbers.append(trial.number)  # ... and crashes again

    assert [(r.outcome, r.retry) for r in results] == [
        ("requeued", 1),
        ("requeued", 2),
        ("retries_exhausted", None),
    ]
    assert all(r.failed_now and r.params == params for r in results)
    assert states(study) == {0: "FAIL", 1: "FAIL", 2: "FAIL"}
    lineage = [
        (
            t.user_attrs.get(ATTR_RETRY_OF),
            t.user_attrs.get(ATTR_PARENT),
            t.user_attrs.get(ATTR_RETRY),
        )
        for t in study.get_trials()
    ]
    assert lineage == [(None, None, None), (0, 0, 1), (0, 1, 2)]
    # Exhausted stays exhausted on a repeat; max_retries=0 fails without re-enqueuing.
    (repeat,) = fail_and_requeue(url, "chain", [2], max_retries=2, reason="oom")
    assert repeat.outcome == "retries_exhausted" and not repeat.failed_now
    lone = study.ask()
    lone.suggest_float("x", -10.0, 10.0)
    (zero,) = fail_and_requeue(url, "chain", [lone.number], max_retries=0, reason="oom")
    assert (zero.outcome, zero.failed_now) == ("retries_exhausted", True)
    assert len(study.get_trials()) == 4
    assert study_stats(url, "chain")["studies"][0]["retries"]["max_retry"] == 2


def test_finished_waiting_and_unknown_trials_are_left_alone(url: str) -> None:
    study = optuna.create_study(study_name="calm", storage=url)
    study.optimize(mixed_objective, n_trials=3)  # 0 COMPLETE, 1 PRUNED, 2 COMPLETE
    study.enqueue_trial({"x": 1.0, "y": 1})  # 3 WAITING
    before = [(t.number, t.state, t.params, t.user_attrs) for t in study.get_trials()]

    results = fail_and_requeue(url, "calm", [0, 1, 3, 42], max_retries=3, reason="cuda_assert")

    assert [(r.trial_number, r.outcome, r.state_before) for r in results] == [
        (0, "not_running", "COMPLETE"),
        (1, "not_running", "PRUNED"),
        (3, "not_running", "WAITING"),
        (42, "not_found", None),
    ]
    assert [(t.number, t.state, t.params, t.user_attrs) for t in study.get_trials()] == before
    with pytest.raises(ValueError, match="max_retries"):
        fail_and_requeue(url, "calm", [0], max_retries=-1, reason="x")


def test_a_trial_the_objective_failed_before_the_crash_is_requeued(url: str) -> None:
    # Optuna marks the trial FAIL when the objective raises (a device-side assert surfaces as
    # an exception first); the process then dies. The retry is still owed.
    study = optuna.create_study(study_name="raised", storage=url)
    study.optimize(mixed_objective, n_trials=4, catch=(ValueError,))  # trial 3 FAIL
    (result,) = fail_and_requeue(url, "raised", [3], max_retries=1, reason="cuda_assert")
    assert (result.outcome, result.state_before, result.failed_now) == ("requeued", "FAIL", False)
    assert result.params == by_number(study, 3).params
    assert ATTR_FAILED_REASON not in by_number(study, 3).user_attrs  # Optuna failed it, not us


def test_fail_stale_trials_uses_optuna_heartbeats(
    url: str, workers: Workers, tmp_path: Path
) -> None:
    optuna.create_study(study_name="beats", storage=url)
    common = ("--trials", "3", "--heartbeat", "1", "--hang-at", "1")
    marks = tmp_path / "dead.mark", tmp_path / "live.mark"
    dead = workers.start(url, "beats", *common, "--mark", str(marks[0]))
    live = workers.start(url, "beats", *common, "--mark", str(marks[1]))
    dead_trial = workers.wait_mark(dead, marks[0])
    live_trial = workers.wait_mark(live, marks[1])
    workers.kill(dead)

    # SQLite's clock has 1 s steps: with a 2 s grace the dead trial is stale within ~3-4 s.
    deadline = time.monotonic() + 20
    results = fail_stale_trials(url, "beats", max_retries=2, grace_period_s=2)
    while not results:
        assert time.monotonic() < deadline, "the killed worker's trial never went stale"
        time.sleep(0.25)
        results = fail_stale_trials(url, "beats", max_retries=2, grace_period_s=2)

    # Only the dead worker's trial: the live one keeps beating.
    assert [(r.trial_number, r.outcome, r.state_before) for r in results] == [
        (dead_trial, "requeued", "RUNNING")
    ]
    study = optuna.load_study(study_name="beats", storage=url)
    assert states(study) == {
        dead_trial: "FAIL",
        live_trial: "RUNNING",
        results[0].requeued_as: "WAITING",
    }
    retry = by_number(study, results[0].requeued_as or -1)
    assert retry.user_attrs[ATTR_RETRY_REASON] == "heartbeat_stale"
    # A WAITING trial carries its params as the enqueued ("fixed") ones until it runs.
    assert retry.system_attrs["fixed_params"] == by_number(study, dead_trial).params
    assert fail_stale_trials(url, "beats", max_retries=2, grace_period_s=2) == []
    # The daemon hearing of the same trial from the hook afterwards changes nothing.
    (late,) = fail_and_requeue(url, "beats", [dead_trial], max_retries=2, reason="cuda_assert")
    assert late.outcome == "already_requeued"


def _frozen(
    number: int,
    state: TrialState,
    start: datetime | None,
    seconds: float | None,
    value: float | None = None,
    user_attrs: dict[str, Any] | None = None,
) -> FrozenTrial:
    return FrozenTrial(
        number=number,
        state=state,
        value=value,
        datetime_start=start,
        datetime_complete=None
        if seconds is None or start is None
        else start + timedelta(seconds=seconds),
        params={"x": 1.0, "y": 3},
        distributions={"x": FloatDistribution(-10, 10), "y": IntDistribution(0, 100)},
        user_attrs=user_attrs or {},
        system_attrs={},
        intermediate_values={},
        trial_id=number,
    )


def test_study_stats_against_hand_counts(url: str) -> None:
    now = datetime.now().replace(microsecond=0)
    ago = lambda hours: now - timedelta(hours=hours)  # noqa: E731
    study = optuna.create_study(study_name="hand", storage=url)
    C, P, F = TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL
    retry1 = {ATTR_RETRY_OF: 5, ATTR_PARENT: 5, ATTR_RETRY: 1}
    retry2 = {ATTR_RETRY_OF: 5, ATTR_PARENT: 8, ATTR_RETRY: 2}
    trials = [
        _frozen(0, C, ago(3), 10, value=3.0),  # first start: 3 h ago
        _frozen(1, C, ago(2), 20, value=1.0),  # best
        _frozen(2, C, ago(0.5), 30, value=2.0),
        _frozen(3, P, ago(2), 5),
        _frozen(4, P, ago(0.2), 15),
        _frozen(5, F, ago(1.5), 40),
        _frozen(6, TrialState.RUNNING, ago(0.1), None),
        _frozen(7, TrialState.WAITING, None, None, user_attrs=retry2),
        _frozen(8, F, ago(1), 60, user_attrs=retry1),
    ]
    for trial in trials:
        study.add_trial(trial)
    maxi = optuna.create_study(study_name="another", storage=url, direction="maximize")
    maxi.add_trial(_frozen(0, C, ago(1), 1, value=5.0))
    maxi.add_trial(_frozen(1, C, ago(1), 3, value=7.0))

    stats = study_stats(url, "hand", now_s=now.timestamp())

    assert stats["storage"] == url and stats["generated_at_s"] == now.timestamp()
    (hand,) = stats["studies"]
    assert hand["study"] == "hand" and hand["directions"] == ["minimize"] and hand["trials"] == 9
    got = {s: (v["count"], v["pct"], v["mean_duration_s"]) for s, v in hand["states"].items()}
    assert got == {
        "RUNNING": (1, pytest.approx(100 / 9), None),
        "WAITING": (1, pytest.approx(100 / 9), None),
        "COMPLETE": (3, pytest.approx(100 / 3), pytest.approx(20.0)),
        "PRUNED": (2, pytest.approx(200 / 9), pytest.approx(10.0)),
        "FAIL": (2, pytest.approx(200 / 9), pytest.approx(50.0)),
    }
    assert hand["pruned_pct"] == pytest.approx(40.0)  # 2 / (3 + 2)
    assert hand["retries"] == {
        "retry_trials": 2,
        "retried_trials": 1,
        "max_retry": 2,
        "by_state": {"RUNNING": 0, "WAITING": 1, "COMPLETE": 0, "PRUNED": 0, "FAIL": 1},
        "made_by": {"gpuwatchd": 2, "optuna": 0},
    }
    first = ago(3).timestamp()
    last = (ago(0.2) + timedelta(seconds=15)).timestamp()  # trial 4
    assert (hand["first_start_s"], hand["last_complete_s"]) == (first, last)
    # 7 finished trials (3 COMPLETE, 2 PRUNED, 2 FAIL) over the span; 3 of them (trials 2,
    # 4 and 8, completed 29, 11.75 and 59 minutes ago) in the last hour.
    assert hand["trials_per_hour"] == {
        "overall": pytest.approx(7 / ((last - first) / 3600)),
        "last_hour": 3,
    }
    assert (hand["best_value"], hand["best_trial"]) == (1.0, 1)

    every = study_stats(url)["studies"]
    assert [s["study"] for s in every] == ["another", "hand"]
    assert (every[0]["best_value"], every[0]["best_trial"]) == (7.0, 1)
    assert every[0]["pruned_pct"] == 0.0 and every[0]["retries"]["retry_trials"] == 0


def test_empty_study_and_empty_storage(url: str) -> None:
    optuna.create_study(study_name="empty", storage=url)
    (empty,) = study_stats(url)["studies"]
    assert empty["trials"] == 0 and empty["pruned_pct"] is None
    assert all(
        v == {"count": 0, "pct": 0.0, "mean_duration_s": None} for v in empty["states"].values()
    )
    assert empty["trials_per_hour"] == {"overall": None, "last_hour": 0}
    assert (empty["best_value"], empty["best_trial"], empty["first_start_s"]) == (None, None, None)


def test_bad_storages_are_clear_errors(tmp_path: Path, url: str) -> None:
    missing = tmp_path / "nope.db"
    with pytest.raises(StudyError, match=f"no such SQLite storage: {missing}"):
        study_stats(f"sqlite:///{missing}")
    assert not missing.exists()  # not created as an empty database
    other = tmp_path / "journal.sqlite3"  # some other SQLite database: refused, not converted
    with sqlite3.connect(str(other)) as db:
        db.execute("CREATE TABLE events (id INTEGER)")
    db.close()
    with pytest.raises(StudyError, match="is not an Optuna storage"):
        fail_and_requeue(f"sqlite:///{other}", "any", [0], max_retries=1, reason="x")
    with sqlite3.connect(str(other)) as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("events",)]
    db.close()
    optuna.create_study(study_name="here", storage=url)
    with pytest.raises(StudyError, match="no study 'gone'"):
        fail_and_requeue(url, "gone", [0], max_retries=1, reason="x")
    with pytest.raises(StudyError, match="not a storage URL"):
        study_stats("not a url")
    pg = "postgresql+psycopg2://gw:s3cret@/optuna?host=/nonexistent-dir"
    with pytest.raises(StudyError, match="cannot open") as caught:
        study_stats(pg)
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)
    assert redact_url(pg).startswith("postgresql+psycopg2://gw:***@/optuna")


def _hand_study(url: str) -> None:
    study = optuna.create_study(study_name="cli", storage=url)
    study.optimize(mixed_objective, n_trials=6, catch=(ValueError,))


def test_gpuwatchctl_study_needs_no_daemon(url: str, tmp_path: Path) -> None:
    _hand_study(url)
    env = dict(os.environ, GPUWATCHD_SOCKET=str(tmp_path / "no-daemon.sock"), COLUMNS="120")
    human = subprocess.run(
        [str(BIN / "gpuwatchctl"), "study", "--storage", url, "--study", "cli"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].startswith("study cli (minimize): 6 trials, best value ")
    rows = {line.split("│")[1].strip(): line for line in lines if line.count("│") == 5}
    assert set(rows) == {"RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL"}
    assert [c.strip() for c in rows["COMPLETE"].split("│")[2:4]] == ["3", "50.0"]
    assert [c.strip() for c in rows["PRUNED"].split("│")[2:4]] == ["2", "33.3"]
    assert [c.strip() for c in rows["FAIL"].split("│")[2:4]] == ["1", "16.7"]
    assert "pruned: 40.0 % of COMPLETE+PRUNED" in human.stdout
    assert "retries: 0" in human.stdout

    as_json = subprocess.run(
        [str(BIN / "gpuwatchctl"), "study", "--storage", url, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert as_json.returncode == 0, as_json.stderr
    stats = json.loads(as_json.stdout)
    expected = study_stats(url)
    stats.pop("generated_at_s"), expected.pop("generated_at_s")
    assert stats == expected
    assert stats["studies"][0]["states"]["COMPLETE"]["count"] == 3


def test_gpuwatchctl_study_as_csv_and_without_legend(url: str, tmp_path: Path) -> None:
    _hand_study(url)
    env = dict(os.environ, GPUWATCHD_SOCKET=str(tmp_path / "no-daemon.sock"), COLUMNS="120")

    def study(*flags: str) -> str:
        done = subprocess.run(
            [str(BIN / "gpuwatchctl"), "study", "--storage", url, *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    header, *rows = list(csv.reader(io.StringIO(study("--format", "csv"))))
    assert header == ["study", "state", "trials", "percent", "mean_duration_s"]
    by_state = {row[1]: row for row in rows}
    assert {row[0] for row in rows} == {"cli"}
    assert set(by_state) == {"RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL"}
    assert by_state["COMPLETE"][2:4] == ["3", "50.0"] and by_state["FAIL"][2:4] == ["1", "16.7"]
    assert float(by_state["COMPLETE"][4]) >= 0.0 and by_state["WAITING"][4] == "-"
    bare = study("--format", "csv", "--no-legend")
    assert list(csv.reader(io.StringIO(bare))) == rows
    table = study("--no-legend")  # a table for the eye: no title, header or summary line
    assert "study cli" not in table and "pruned:" not in table and "state" not in table
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines()]
    assert [c[:3] for c in cells if c and c[1] == "COMPLETE"] == [["cli", "COMPLETE", "3"]]
    assert len([c for c in cells if c]) == 5  # one row per TrialState, nothing else


def test_gpuwatchctl_study_json_flag_either_side_and_errors(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _hand_study(url)
    assert ctl.main(["--json", "study", "--storage", url, "--study", "cli"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert ctl.main(["study", "--storage", url, "--study", "cli", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert before["studies"] == after["studies"] and len(after["studies"]) == 1

    monkeypatch.setenv("OPTUNA_STORAGE", url)  # as Optuna's own CLI
    assert ctl.main(["study", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["studies"] == after["studies"]

    monkeypatch.delenv("OPTUNA_STORAGE")
    assert ctl.main(["study"]) == 2
    assert "--storage" in capsys.readouterr().err
    assert ctl.main(["study", "--storage", url, "--study", "nope"]) == 1
    assert "no study 'nope'" in capsys.readouterr().err
    assert ctl.main(["study", "--storage", f"sqlite:///{tmp_path / 'x.db'}"]) == 1
    assert "no such SQLite storage" in capsys.readouterr().err


def test_optuna_is_imported_lazily() -> None:
    code = (
        "import sys, gpuwatchd.jobs.study, gpuwatchd.daemon, gpuwatchd.cli.ctl as c; "
        "c.build_parser(); assert 'optuna' not in sys.modules, 'optuna imported'; "
        "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_trials_of_worker_names_the_trial_each_worker_died_in(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three worker launches write their ids through the real hook; the storage alone
    tells which trial each one was in when it died."""
    study = optuna.create_study(study_name="w", storage=url)
    no_daemon = str(tmp_path / "no-daemon.sock")

    def run(worker_id: str, objective: Any, n_trials: int, **kwargs: Any) -> None:
        monkeypatch.setenv("GPUWATCHD_WORKER_ID", worker_id)
        with attach(job="hpo", socket=no_daemon) as watch:
            study.optimize(watch_objective(watch, objective), n_trials=n_trials, **kwargs)

    # "a" survived a failing trial (catch=) and died between trials: nothing to recover.
    run("a", mixed_objective, 4, catch=(ValueError,))  # 0 C, 1 P, 2 C, 3 FAIL
    run("a", objective, 1)  # 4 COMPLETE
    # "b": a device-side assert surfaced as an exception: Optuna failed trial 6, the
    # process died.
    run("b", objective, 1)  # 5 COMPLETE

    def asserts(trial: optuna.Trial) -> float:
        objective(trial)
        raise RuntimeError("CUDA error: device-side assert triggered")

    with pytest.raises(RuntimeError):
        run("b", asserts, 1)  # 6 FAIL
    # "c": died inside a trial (SIGKILL): it stays RUNNING.
    monkeypatch.setenv("GPUWATCHD_WORKER_ID", "c")
    with attach(job="hpo", socket=no_daemon) as watch, watch.trial(study.ask()):
        pass  # 7 RUNNING

    a, b, c = (trials_of_worker(url, "w", wid) for wid in "abc")
    assert a is not None and (a.running, a.failed, a.crashed, a.finished) == ((), None, None, 4)
    assert b is not None and (b.running, b.failed, b.crashed, b.others) == ((), 6, 6, ())
    assert c is not None and (c.running, c.failed, c.crashed, c.others) == ((7,), None, 7, ())
    assert trials_of_worker(url, "w", "never-ran-a-trial") is None
    with pytest.raises(StudyError, match="no study"):
        trials_of_worker(url, "nope", "a")


def test_a_storage_error_while_in_use_is_a_study_error(url: str, tmp_path: Path) -> None:
    """SQLite locked by another writer (e.g. a worker mid-transaction) when the recovery
    writes: the daemon gets a StudyError naming the database's error, not Optuna's or
    SQLAlchemy's exception."""
    study = optuna.create_study(study_name="locked", storage=url)
    number = study.ask().number
    locker = sqlite3.connect(tmp_path / "optuna.db", isolation_level=None)
    try:
        locker.execute("BEGIN IMMEDIATE")  # readers go on; the recovery's write waits, fails
        with pytest.raises(StudyError, match="database is locked") as caught:
            fail_and_requeue(url, "locked", [number], max_retries=1, reason="cuda_assert")
        assert not str(caught.value).startswith("cannot open")  # it opened; the write failed
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    (result,) = fail_and_requeue(url, "locked", [number], max_retries=1, reason="cuda_assert")
    assert result.outcome == "requeued"
