"""A real Optuna worker process for the study tests (run as a script, never imported by pytest).

    python tests/optuna_worker.py STORAGE_URL STUDY --trials N [--sleep S] [--tag TAG]
        [--heartbeat S] [--hang-at K --mark PATH] [--hold-at K --mark PATH --release PATH]
        [--hook] [--n-jobs N] [--retry-callback MAX]

Each trial suggests ``x`` (float) and ``y`` (int), records ``worker`` (``--tag``) and the
``GPUWATCHD_JOB`` it ran under in its user attrs, sleeps ``--sleep`` seconds and
returns ``(x - 2)**2 + y / 100``. ``--hang-at K``: the worker's K-th trial (1-based) writes
its trial number to ``--mark`` and sleeps until killed, as a worker stuck in a CUDA
kernel or crashed mid-trial. ``--hold-at K``: the K-th trial writes ``--mark``, waits
until ``--release`` exists, then completes normally. ``--heartbeat S``: the worker's
storage records Optuna heartbeats every S seconds (``RDBStorage(heartbeat_interval=S)``).
``--hook``: the study runs inside ``gpuwatchd.hook.attach`` with the hook's Optuna
integration (``watch_objective``, ``StudyCallback``), as the hook's docstring shows it.
``--n-jobs N``: ``study.optimize(..., n_jobs=N)`` (N threads in the one process).
``--retry-callback MAX``: with ``--heartbeat``, the storage retries the trials its heartbeat
check fails, as optuna-examples' ``pytorch/pytorch_checkpoint.py`` sets it up:
``RDBStorage(url, heartbeat_interval=S, failed_trial_callback=RetryFailedTrialCallback(
max_retry=MAX))``. Each trial prints ``ran <trial number>`` when its objective starts.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def _mark(path: str, number: int) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(str(number))
    tmp.replace(path)  # atomic: the test never reads a half-written number


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("study")
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--tag", default="worker")
    parser.add_argument("--heartbeat", type=int, default=None)
    parser.add_argument("--hang-at", type=int, default=None)
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--mark", default=None)
    parser.add_argument("--release", default=None)
    parser.add_argument("--hook", action="store_true")
    parser.add_argument("--n-jobs", type=int, default=1)
    parser.add_argument("--retry-callback", type=int, default=None)
    args = parser.parse_args()

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage: str | optuna.storages.RDBStorage = args.storage
    if args.heartbeat is not None and args.retry_callback is not None:
        from optuna.storages import RetryFailedTrialCallback

        storage = optuna.storages.RDBStorage(
            args.storage,
            heartbeat_interval=args.heartbeat,
            failed_trial_callback=RetryFailedTrialCallback(max_retry=args.retry_callback),
        )
    elif args.heartbeat is not None:
        storage = optuna.storages.RDBStorage(args.storage, heartbeat_interval=args.heartbeat)
    study = optuna.load_study(study_name=args.study, storage=storage)
    done = 0

    def objective(trial: optuna.Trial) -> float:
        nonlocal done
        done += 1
        print(f"ran {trial.number}", flush=True)
        x = trial.suggest_float("x", -10.0, 10.0)
        y = trial.suggest_int("y", 0, 100)
        trial.set_user_attr("worker", args.tag)
        trial.set_user_attr("job", os.environ.get("GPUWATCHD_JOB", ""))
        if done == args.hang_at:
            _mark(args.mark, trial.number)
            while True:
                time.sleep(60)
        if done == args.hold_at:
            _mark(args.mark, trial.number)
            while not os.path.exists(args.release):
                time.sleep(0.02)
        time.sleep(args.sleep)
        return (x - 2.0) ** 2 + y / 100.0

    if not args.hook:
        study.optimize(objective, n_trials=args.trials, n_jobs=args.n_jobs)
        return

    from gpuwatchd.hook import attach
    from gpuwatchd.hook.optuna import StudyCallback, watch_objective

    with attach(study=args.study) as watch:
        study.optimize(
            watch_objective(watch, objective),
            n_trials=args.trials,
            n_jobs=args.n_jobs,
            callbacks=[StudyCallback(watch)],
        )


if __name__ == "__main__":
    main()
