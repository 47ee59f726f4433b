"""A real Optuna worker process for the study tests (run as a script, never imported by pytest).

    python tests/optuna_worker.py STORAGE STUDY --trials N [--sleep S] [--tag TAG]
        [--heartbeat S] [--hang-at K --mark PATH] [--hold-at K --mark PATH --release PATH]
        [--hook] [--pause-before-tag K --mark PATH] [--n-jobs N] [--retry-callback MAX]
        [--exit N]

Each trial suggests ``x`` (float) and ``y`` (int), records ``worker`` (``--tag``) and the
``GPUWATCHD_JOB`` it ran under in its user attrs, sleeps ``--sleep`` seconds and
returns ``(x - 2)**2 + y / 100``. ``--hang-at K``: the worker's K-th trial (1-based) writes
its trial number to ``--mark`` and sleeps until killed, as a worker stuck in a CUDA
kernel or crashed mid-trial. ``--hold-at K``: the K-th trial writes ``--mark``, waits
until ``--release`` exists, then completes normally. ``--heartbeat S``: the worker's
storage records Optuna heartbeats every S seconds (``RDBStorage(heartbeat_interval=S)``).
``STORAGE`` is an RDB URL or ``journal://PATH``, Optuna's JournalStorage on the file PATH.
``--hook``: the study runs inside ``gpuwatchd.hook.attach`` with the hook's Optuna
integration (``watch_objective``, ``StudyCallback``), as the hook's docstring shows it.
``--pause-before-tag K`` (with ``--hook``): the process's K-th trial, once Optuna has
asked it (RUNNING in the storage) and before the hook's objective wrapper tags it, writes
its number to ``--mark`` and sleeps until killed, unless ``--mark`` exists already (a
relaunch goes on): the window between Optuna's ``ask`` and the hook's first word.
``--n-jobs N``: ``study.optimize(..., n_jobs=N)`` (N threads in the one process).
``--retry-callback MAX``: with ``--heartbeat``, the storage retries the trials its heartbeat
check fails, as optuna-examples' ``pytorch/pytorch_checkpoint.py`` sets it up:
``RDBStorage(url, heartbeat_interval=S, failed_trial_callback=RetryFailedTrialCallback(
max_retry=MAX))``. Each trial prints ``ran <trial number>`` when its objective starts.
``--exit N``: after the study, ``raise SystemExit(N)`` at the top level, outside any
``attach`` block (the hook's exit line cannot tell it from a clean end).
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


def main() -> int:
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
    parser.add_argument("--pause-before-tag", type=int, default=None)
    parser.add_argument("--n-jobs", type=int, default=1)
    parser.add_argument("--retry-callback", type=int, default=None)
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage: str | optuna.storages.BaseStorage = args.storage
    if args.storage.startswith("journal://"):  # as Optuna's docs open a JournalStorage
        path = args.storage.removeprefix("journal://")
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    elif args.heartbeat is not None and args.retry_callback is not None:
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
        return int(args.exit)

    from gpuwatchd.hook import attach
    from gpuwatchd.hook.optuna import StudyCallback, watch_objective

    asked = 0
    pause = args.pause_before_tag is not None and not os.path.exists(args.mark)

    with attach(study=args.study) as watch:
        hooked = watch_objective(watch, objective)

        def before_the_tag(trial: optuna.Trial) -> float:
            nonlocal asked
            asked += 1
            if pause and asked == args.pause_before_tag:
                _mark(args.mark, trial.number)
                while True:
                    time.sleep(60)
            return hooked(trial)

        study.optimize(
            before_the_tag,
            n_trials=args.trials,
            n_jobs=args.n_jobs,
            callbacks=[StudyCallback(watch)],
        )
    return int(args.exit)


if __name__ == "__main__":
    raise SystemExit(main())
