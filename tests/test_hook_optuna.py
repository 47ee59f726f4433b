"""The Optuna integration with the real ``optuna``: trial context, study callback, and a
daemon's ``stop``/``drain`` during a study (daemon stand-in on a real Unix socket)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import optuna
import pytest

from gpuwatchd.hook import Watch, attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective
from test_hook import FakeDaemon, list_factory, wait_until

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    directory = tempfile.mkdtemp(prefix="gwopt-", dir="/tmp")
    fake = FakeDaemon(os.path.join(directory, "control.sock"))
    yield fake
    fake.stop()
    shutil.rmtree(directory, ignore_errors=True)


def trial_events(daemon: FakeDaemon) -> list[tuple[int, str]]:
    return [
        (m["event"]["trial_number"], m["event"]["trial_state"])
        for m in daemon.requests("event")
        if m["event"]["kind"] == "trial"
    ]


def train(watch: Watch, epochs: int = 2) -> float:
    """A stand-in training run through the trial's primary loader; returns a 'loss'."""
    loader = watch.loader(list_factory(batches=3))
    seen = 0
    for _epoch in range(epochs):
        for _batch in loader:
            seen += 1
    return 1.0 / (1 + seen)


def test_each_trial_is_reported_and_its_final_state_sent(daemon: FakeDaemon) -> None:
    def objective(trial: Any) -> float:
        x = trial.suggest_float("x", -1.0, 1.0)
        if trial.number == 1:
            raise optuna.TrialPruned()
        if trial.number == 2:
            return math.nan  # Optuna records FAIL for a NaN value
        return train(watch) + x * x

    with attach(job="hpo", socket=daemon.path, report_interval_s=0.25) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study(study_name="criteria")
        study.optimize(
            watch_objective(watch, objective), n_trials=4, callbacks=[StudyCallback(watch)]
        )
    assert daemon.wait_closed(0, 2.0)
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "PRUNED", "FAIL", "COMPLETE"]
    assert trial_events(daemon) == [(0, "COMPLETE"), (1, "PRUNED"), (2, "FAIL"), (3, "COMPLETE")]


def test_a_trial_that_raises_is_sent_as_fail_even_when_optuna_reraises(
    daemon: FakeDaemon,
) -> None:
    def objective(trial: Any) -> float:
        raise ValueError("diverged")

    with attach(job="hpo", socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study()
        with pytest.raises(ValueError, match="diverged"):
            study.optimize(
                watch_objective(watch, objective), n_trials=3, callbacks=[StudyCallback(watch)]
            )
    assert daemon.wait_closed(0, 2.0)
    assert trial_events(daemon) == [(0, "FAIL")]  # the callback never saw this trial


def test_reports_carry_the_running_trials_number_and_params(daemon: FakeDaemon) -> None:
    def objective(trial: Any) -> float:
        trial.suggest_int("layers", 1, 4)
        loader = watch.loader(list_factory(batches=60))
        for _batch in loader:
            import time

            time.sleep(0.01)  # 0.6 s per trial: reports happen inside the trial
        return 0.0

    with attach(job="hpo", socket=daemon.path, report_interval_s=0.25) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study()
        study.optimize(watch_objective(watch, objective), n_trials=2)
    assert daemon.wait_closed(0, 2.0)
    trials = [m["report"]["trial"] for m in daemon.requests("report") if "trial" in m["report"]]
    numbers = [t["number"] for t in trials if t is not None]
    assert numbers[0] == 0 and numbers[-1] == 1
    assert trials[0]["params"] == {"layers": study.trials[0].params["layers"]}
    assert trial_events(daemon) == [(0, "COMPLETE"), (1, "COMPLETE")]  # from the trial context


def test_stop_prunes_the_running_trial_and_stops_the_study(daemon: FakeDaemon) -> None:
    stopped_in: list[int] = []

    def objective(trial: Any) -> float:
        trial.suggest_float("x", 0.0, 1.0)
        loader = watch.loader(list_factory(batches=4))
        for epoch in range(3):
            for index, _batch in enumerate(loader):
                if (trial.number, epoch, index) == (1, 1, 1):
                    daemon.send({"id": "d-1", "op": "stop", "reason": "gpu lost"})
                    assert wait_until(lambda: watch.stop_requested)
        return 1.0

    with attach(
        job="hpo", socket=daemon.path, on_stop=lambda r: stopped_in.append(watch.epoch)
    ) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study()
        study.optimize(
            watch_objective(watch, objective), n_trials=10, callbacks=[StudyCallback(watch)]
        )
        reply = daemon.reply_to("d-1")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"]  # no third trial
    assert stopped_in == [1]
    assert reply["result"] == {
        "stopped": True,
        "at": "step",
        "reason": "gpu lost",
        "pruned_trial": 1,
    }
    assert daemon.wait_closed(0, 2.0)
    assert trial_events(daemon) == [(0, "COMPLETE"), (1, "PRUNED")]


def test_drain_finishes_the_running_trial_then_stops_the_study(daemon: FakeDaemon) -> None:
    def objective(trial: Any) -> float:
        loader = watch.loader(list_factory(batches=4))
        batches = 0
        for epoch in range(3):
            for index, _batch in enumerate(loader):
                batches += 1
                if (epoch, index) == (0, 1):
                    daemon.send({"id": "d-1", "op": "drain"})
                    assert wait_until(lambda: watch.drain_requested)
        return float(batches)

    with attach(job="hpo", socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study()
        study.optimize(
            watch_objective(watch, objective), n_trials=10, callbacks=[StudyCallback(watch)]
        )
        reply = daemon.reply_to("d-1")
    assert len(study.trials) == 1
    assert study.trials[0].value == 12.0  # the whole trial ran: 3 epochs x 4 batches
    assert reply["result"] == {"drained": True, "at": "trial_end", "epoch": 2, "trial": 0}


def test_hpo_digits_example_reports_its_trials(daemon: FakeDaemon) -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hpo_digits.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--trials",
            "2",
            "--epochs",
            "1",
            "--num-workers",
            "0",
            "--samples",
            "256",
            "--batch-size",
            "16",
            "--effective-batch",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, GPUWATCHD_SOCKET=daemon.path, PYTHONUNBUFFERED="1"),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("trial=")]
    assert len(lines) == 2 and all("state=COMPLETE" in line for line in lines), done.stdout
    assert "batch_size=16 accumulation_steps=2 connected=True" in lines[0]
    hello = daemon.wait_for(lambda m: m.get("op") == "hello")
    assert hello["study"] == "digits-hpo"
    assert hello["knobs"]["batch_size"] == {"value": 16, "min": 1, "max": 32}
    assert daemon.wait_closed(0, 2.0)
    assert trial_events(daemon) == [(0, "COMPLETE"), (1, "COMPLETE")]


def test_a_stop_at_the_very_end_of_a_trial_is_applied_when_the_trial_ends(
    daemon: FakeDaemon,
) -> None:
    def objective(trial: Any) -> float:
        daemon.send({"id": "d-1", "op": "stop", "reason": "maintenance"})
        assert wait_until(lambda: watch.stop_requested)
        return 0.5  # no step after the request: the trial completes

    with attach(job="hpo", socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        study = optuna.create_study()
        study.optimize(watch_objective(watch, objective), n_trials=5)
        reply = daemon.reply_to("d-1")
    assert [t.state.name for t in study.trials] == ["COMPLETE"]  # the study stopped
    assert reply["result"]["at"] == "trial_end"


def test_a_managed_worker_names_itself_in_each_trials_user_attrs(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker id the supervisor gives a launch lands in the storage with each trial,
    written when the trial starts (before the objective runs), daemon or no daemon."""
    seen: list[object] = []

    def objective(trial: Any) -> float:
        seen.append(trial.study.trials[-1].user_attrs.get("gpuwatchd:worker_id"))
        return trial.suggest_float("x", -1.0, 1.0)

    monkeypatch.setenv("GPUWATCHD_WORKER_ID", "hpo.0.abc123")
    with attach(job="hpo", socket=daemon.path) as watch:
        study = optuna.create_study()
        study.optimize(watch_objective(watch, objective), n_trials=2)
    assert seen == ["hpo.0.abc123", "hpo.0.abc123"]
    assert [t.user_attrs for t in study.trials] == [{"gpuwatchd:worker_id": "hpo.0.abc123"}] * 2

    trial = study.ask()  # one trial for the whole process: attach(trial=...)
    with attach(job="hpo", socket=daemon.path, trial=trial):
        pass
    assert study.trials[-1].user_attrs == {"gpuwatchd:worker_id": "hpo.0.abc123"}

    monkeypatch.delenv("GPUWATCHD_WORKER_ID")  # not launched by the daemon: nothing written
    with attach(job="hpo", socket=daemon.path) as watch:
        study = optuna.create_study()
        study.optimize(watch_objective(watch, objective), n_trials=1)
    assert study.trials[0].user_attrs == {}


def test_a_study_ending_on_optunas_own_error_sends_crash_kind_optuna_error(
    daemon: FakeDaemon,
) -> None:
    """Two threads of ``optimize(n_jobs=2)`` that ran the same trial: the second tell
    raises Optuna's ``ValueError: Cannot tell a COMPLETE trial.``, which ends the job."""

    def objective(trial: Any) -> float:
        x = trial.suggest_float("x", -1.0, 1.0)
        study.tell(trial.number, x * x)  # the other thread told it first
        return x * x

    with pytest.raises(ValueError, match="Cannot tell a COMPLETE trial"):  # noqa: SIM117
        with attach(job="hpo", socket=daemon.path) as watch:
            daemon.wait_for(lambda m: m.get("op") == "hello")
            study = optuna.create_study()
            study.optimize(watch_objective(watch, objective), n_trials=1)
    assert daemon.wait_closed(0, 2.0)
    crashes = [m["event"] for m in daemon.requests("event") if m["event"]["kind"] == "crash"]
    assert crashes == [
        {
            "kind": "crash",
            "crash_kind": "optuna_error",
            "message": "ValueError: Cannot tell a COMPLETE trial.",
        }
    ]
