"""A crashed task of a Slurm array: its hook reports PyTorch's device-side assert, the
daemon's ``restart_study`` fails its trial and re-enqueues it once in the array's study
(``slurm.arrays.<job>.optuna``), a later task runs it, and the study ends with no trial
RUNNING. Against the real single-node Slurm (tests/slurm.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState

from conftest import RunningDaemon
from slurm import SlurmCluster, daemon_args, one_gpu, slurm  # noqa: F401  (the module's cluster)

POLICY = """
policies:
  - name: crashed-trials-restart
    when:
      job_crashed: {kind: [cuda_assert, cuda_oom]}
    do:
      - restart_study: {max_retries: 3}
"""

# Task 0's trial dies of a device-side assert (the text PyTorch raises); the others run
# one trial each, the first of them after the crash running the re-enqueued one.
TASK = """#!/bin/sh
exec {python} -c "
import os, sys, time
import optuna
from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective
study = optuna.load_study(study_name='hpo-study', storage='sqlite:///{db}')
def objective(trial):
    x = trial.suggest_float('x', 0, 1)
    if os.environ['SLURM_ARRAY_TASK_ID'] == '0':
        raise RuntimeError('CUDA error: device-side assert triggered')
    return x
with attach(study='hpo-study') as watch:
    study.optimize(watch_objective(watch, objective), n_trials=1,
                   callbacks=[StudyCallback(watch)])
"
"""


def test_a_device_side_assert_fails_and_requeues_the_trial_once(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    optuna.create_study(study_name="hpo-study", storage=storage)
    array = {
        "max_workers": 2,
        "optuna": {"storage": storage, "study": "hpo-study", "max_retries": 1},
    }
    args = daemon_args(tmp_path, slurm, {"arrays": {"hpo": array}}, POLICY)
    daemon = run_daemon(script=one_gpu(20), args=args)
    task = TASK.format(python=sys.executable, db=db)
    env = dict(daemon.env, GPUWATCHD_JOB="hpo")
    # task 0 alone first, so that its re-enqueued trial is there for the later tasks
    first = slurm.submit(tmp_path / "crash.sh", task, "0", env=env)

    def restarts() -> list[dict[str, object]]:
        return [
            d
            for d in daemon.status()["decisions"]
            if d["action"] == "restart_study" and d["outcome"] != "pending"
        ]

    [restart] = daemon.wait_until(restarts, timeout_s=60, what="a restart_study outcome")
    assert restart["outcome"] == "applied", restart
    assert restart["params"]["crash_kind"] == "cuda_assert"
    assert restart["detail"] == "trial 0 re-enqueued as trial 1 (retry 1/1)"
    slurm.wait("task 0 gone", lambda: not slurm.run(["squeue", "-h", "-j", first]).strip())
    rest = slurm.submit(tmp_path / "rest.sh", task.replace("== '0'", "== 'never'"), "1-2", env=env)
    slurm.wait("the array done", lambda: not slurm.run(["squeue", "-h", "-j", rest]).strip())

    study = optuna.load_study(study_name="hpo-study", storage=storage)
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TrialState.FAIL, 1: TrialState.COMPLETE, 2: TrialState.COMPLETE}
    assert study.trials[1].params == study.trials[0].params  # the re-enqueued one
    assert TrialState.RUNNING not in states.values()
