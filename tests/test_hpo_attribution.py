"""Which trial a worker was running (gpuwatchd.jobs.attribution), from the hook's word and
from a real SQLite Optuna study's ``gpuwatchd:worker_id`` user attrs."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuwatchd.config import JobConfig, OptunaConfig
from gpuwatchd.crash import CrashInfo, classify
from gpuwatchd.jobs.attribution import TrialAttribution, killed_from_outside
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.jobs.study_recovery import StudyRecovery
from gpuwatchd.logs import get_logger
from gpuwatchd.model import JobEvent, JobInfo


def _crash(trial: int | None, worker_id: str | None = None) -> WorkerCrash:
    return WorkerCrash(
        job="hpo",
        worker=0,
        pid=4242,
        gpu_index=0,
        crash_info=CrashInfo("other", "exited with status 1", None, 1),
        trial_number=trial,
        stderr_tail="",
        timestamp_s=time.time(),
        returncode=1,
        uptime_s=3.0,
        worker_id=worker_id,
    )


def _attribution(optuna: OptunaConfig | None = None) -> TrialAttribution:
    job = JobConfig(name="hpo", command=(sys.executable, "-c", "pass"), optuna=optuna)
    return TrialAttribution([job], StudyRecovery(get_logger("t")), get_logger("t"))


def _trial_event(number: int, state: str) -> JobEvent:
    return JobEvent(1.0, "hpo", "trial", pid=4242, trial_number=number, trial_state=state)


def test_without_a_word_from_the_hook_the_supervisors_record_stands() -> None:
    assert _attribution().from_hook(_crash(7)) == 7


def test_the_trial_the_hook_reports_running_is_the_crashed_one() -> None:
    attribution = _attribution()
    attribution.observe([JobInfo(name="hpo", pid=4242, connected_at_s=0.0, trial_number=9)])
    assert attribution.from_hook(_crash(7)) == 9


def test_a_trial_ended_fail_is_the_crashed_one_complete_means_unknown() -> None:
    attribution = _attribution()
    attribution.note_event(_trial_event(9, "FAIL"))
    assert attribution.from_hook(_crash(7)) == 9
    attribution.note_event(_trial_event(10, "COMPLETE"))
    assert attribution.from_hook(_crash(7)) is None  # it had started one not reported yet


def test_a_detach_is_consumed_and_says_nothing_about_the_process() -> None:
    """A ``detach`` ends an ``attach`` block (per trial with Optuna), not the process."""
    attribution = _attribution()
    assert attribution.note_event(JobEvent(5.0, "hpo", "detach", pid=4242)) is True
    assert attribution.note_event(_trial_event(9, "COMPLETE")) is False
    assert not hasattr(attribution, "take_detach")


def _two_trials_of_one_worker(tmp_path: Path) -> tuple[Any, Any, Any, OptunaConfig]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    older, newer = study.ask(), study.ask()  # n_jobs=2: two trials open in one worker
    for trial in (older, newer):
        trial.suggest_float("x", 0, 1)
        trial.set_user_attr("gpuwatchd:worker_id", "w-1")
    return study, older, newer, OptunaConfig(storage=url, study="s", max_retries=2)


def test_an_abort_with_two_trials_fails_the_crashed_one_and_retries_its_sibling(
    tmp_path: Path,
) -> None:
    """``n_jobs=2`` and an abort: both trials RUNNING. The one the hook named is the
    crashed one (its retry is the policy's); the sibling died with the process through no
    fault of its own: FAIL and re-enqueued at once with the job's ``max_retries``
    (issue 20: it was FAIL with ``max_retries: 0`` and lost)."""
    study, older, newer, cfg = _two_trials_of_one_worker(tmp_path)
    attribution = _attribution(cfg)
    located = asyncio.run(attribution.from_study(_crash(older.number, worker_id="w-1")))
    assert located.trial_number == older.number
    trials = {t.number: t for t in study.get_trials()}
    assert trials[older.number].state.name == "RUNNING"  # the crash handler's, not ours
    assert trials[newer.number].state.name == "FAIL"
    (retry,) = [t for t in trials.values() if t.state.name == "WAITING"]
    assert retry.user_attrs["gpuwatchd:parent"] == newer.number
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "killed_with_worker"
    unknown = asyncio.run(attribution.from_study(_crash(3, worker_id="w-other")))
    assert unknown.trial_number == 3  # no trial names that worker: the record stands


def test_an_older_trial_that_raised_is_the_crash_though_its_newer_sibling_completed(
    tmp_path: Path,
) -> None:
    """``n_jobs=2``: the older trial's objective raised (Optuna failed it) and the newer
    completed while ``optimize`` waited for it; the worker then died of the exception.
    The FAIL trial is the one it died of, not "died between trials" (issue 20)."""
    from optuna.trial import TrialState

    study, older, newer, cfg = _two_trials_of_one_worker(tmp_path)
    study.tell(older, state=TrialState.FAIL)
    study.tell(newer, 1.0)
    attribution = _attribution(cfg)
    located = asyncio.run(attribution.from_study(_crash(newer.number, worker_id="w-1")))
    assert located.trial_number == older.number


def _death(returncode: int | None, stderr: str = "", *, intentional: bool = False) -> WorkerCrash:
    """A worker death as the supervisor reports it (``classify`` of its status and stderr)."""
    return replace(
        _crash(7),
        crash_info=classify(returncode, stderr, oom_kills=0),  # the cgroup counted no OOM kill
        returncode=returncode,
        stderr_tail=stderr,
        intentional=intentional,
    )


def test_killed_from_outside_is_a_signal_or_a_vanished_adopted_worker_with_nothing_said() -> None:
    """``kill -9`` / a scheduler's SIGTERM, or an adopted worker gone while no daemon
    watched with nothing printed (no status to read): killed from outside. A worker that
    printed its error, exited with a status, or that gpuwatchd stopped itself: not."""
    assert killed_from_outside(_death(-9))
    assert killed_from_outside(_death(-15))
    assert killed_from_outside(_death(None))  # adopted, gone while gpuwatchd was down
    assert not killed_from_outside(_death(-9, intentional=True))
    assert not killed_from_outside(_death(1, "Traceback ...\nValueError: bad lr\n"))
    assert not killed_from_outside(
        _death(-6, "RuntimeError: CUDA error: device-side assert triggered\n")
    )
    assert not killed_from_outside(_death(None, "ModuleNotFoundError: No module named 'optuna'\n"))
