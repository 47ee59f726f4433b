"""The client of the kill-chaos tests (tests/test_chaos_kill.py; run as a script, never
imported by pytest), written the way Optuna's public examples are.

    python chaos_worker.py --storage URL --study NAME --target T --n-trials N --seed S
        --faults DIR [--crash-rate 0.15] [--pause-at K --mark PATH] [--attach slot]

The storage URL is on the command line (no heartbeats: a plain ``optuna.load_study``) and
each process runs ``study.optimize(objective, n_trials=N, callbacks=[MaxTrialsCallback(T,
states=(TrialState.COMPLETE,))])``, Optuna's documented use of the callback: the study
ends at ``T`` COMPLETE trials, so crashed trials and their retries do not use up the
target, and a trial left RUNNING is never counted as done.

Each trial suggests ``x`` and sleeps 0.2-0.5 s (drawn per trial number from
``random.Random(f"{seed}:{number}")``). A trial dies as PyTorch does on a GPU with
probability ``--crash-rate``, drawn from the same per-number generator, so the same trial
numbers die the same way in a replay; the kind is one of:

* ``assert``: the kernel's ``Assertion ... failed.`` lines and PyTorch's ``RuntimeError:
  CUDA error: device-side assert triggered`` (recorded texts of ``--faults``) on stderr,
  then ``os._exit(1)`` (nothing in the process marks the trial: it stays RUNNING);
* ``abort``: ``terminate called after throwing an instance of 'c10::CUDAError'`` on
  stderr, then ``os.abort()`` (SIGABRT);
* ``oom``: ``torch.cuda.OutOfMemoryError: CUDA out of memory ...`` on stderr, then
  ``os._exit(1)``.

The hook (``gpuwatchd.hook``) is attached in one of the two ways users write it
(``--attach``): ``process``, as docs/hook.md's Optuna section shows it (one ``attach()``
around ``study.optimize(watch_objective(watch, objective), callbacks=[StudyCallback(watch)])``),
or ``trial``, one ``attach(trial=trial)`` per trial, as a framework callback does that a new
Trainer per trial attaches (Optuna's PyTorch Lightning example): the hook detaches after
every trial. ``slot`` (default) picks ``trial`` for the even worker slots
(``$GPUWATCHD_WORKER``) and ``process`` for the odd ones, so one job has both.

``--pause-at K --mark PATH``: the first process whose trial number ``K`` starts (``PATH``
created with ``O_EXCL``) writes ``K`` into ``PATH`` and sleeps *before* the hook sees the
trial: Optuna has asked it (RUNNING in the storage) but no hook has reported or tagged it
(``gpuwatchd:worker_id``). The test kills everything while it sleeps.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

PAUSE_S = 300.0
"""How long the paused trial sleeps: until the test kills it (bounded, never forever)."""

DEATHS: dict[str, tuple[tuple[str, ...], Callable[[], None]]] = {
    "assert": (
        ("assert_kernel_lines_indexkernel.txt", "assert_runtimeerror_traceback.txt"),
        lambda: os._exit(1),
    ),
    "abort": (("abort_c10_cudaerror_assert.txt",), os.abort),
    "oom": (("oom_torch_cuda_outofmemoryerror.txt",), lambda: os._exit(1)),
}
"""Crash kind -> (recorded texts printed to stderr, how the process ends)."""


def die(kind: str, faults: Path) -> None:
    """Print ``kind``'s recorded PyTorch output to stderr and end as PyTorch does."""
    texts, end = DEATHS[kind]
    for name in texts:
        sys.stderr.write((faults / name).read_text(encoding="utf-8"))
    sys.stderr.flush()
    end()


def plan(seed: int, number: int, crash_rate: float) -> tuple[float, str | None, float]:
    """``(duration_s, crash kind or None, crash point as a fraction of the duration)`` of
    trial ``number``: the same for the same seed and number, whoever runs it."""
    rng = random.Random(f"{seed}:{number}")
    duration = rng.uniform(0.2, 0.5)
    kind = rng.choice(sorted(DEATHS)) if rng.random() < crash_rate else None
    return duration, kind, rng.uniform(0.2, 0.8)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study", required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--n-trials", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--faults", type=Path, required=True)
    parser.add_argument("--crash-rate", type=float, default=0.15)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--mark", default=None)
    parser.add_argument("--attach", choices=("slot", "trial", "process"), default="slot")
    args = parser.parse_args()
    style = args.attach
    if style == "slot":
        style = "trial" if int(os.environ.get("GPUWATCHD_WORKER", "0")) % 2 == 0 else "process"

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=args.study, storage=args.storage)

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", -10.0, 10.0)
        duration, kind, at = plan(args.seed, trial.number, args.crash_rate)
        print(f"trial {trial.number}: x={x:.3f} {kind or 'ok'}", flush=True)
        if kind is not None:
            time.sleep(duration * at)
            die(kind, args.faults)
        time.sleep(duration)
        return (x - 2.0) ** 2

    def pause(trial: optuna.Trial) -> None:
        """The window between Optuna's ask and the hook's first word about the trial."""
        if trial.number != args.pause_at or args.mark is None:
            return
        try:
            fd = os.open(args.mark + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return  # another process (or an earlier launch) has paused already
        os.close(fd)
        tmp = Path(args.mark + ".tmp")
        tmp.write_text(f"{trial.number} {os.getpid()}")
        tmp.replace(args.mark)  # atomic: the test never reads half a mark
        time.sleep(PAUSE_S)

    from gpuwatchd.hook import attach
    from gpuwatchd.hook.optuna import StudyCallback, watch_objective

    target = MaxTrialsCallback(args.target, states=(TrialState.COMPLETE,))
    if style == "trial":

        def per_trial(trial: optuna.Trial) -> float:
            pause(trial)
            with attach(trial=trial, study=args.study, report_interval_s=0.25):
                return objective(trial)

        study.optimize(per_trial, n_trials=args.n_trials, callbacks=[target])
    else:
        with attach(study=args.study, report_interval_s=0.25) as watch:
            run = watch_objective(watch, objective)

            def per_process(trial: optuna.Trial) -> Any:
                pause(trial)
                return run(trial)

            study.optimize(
                per_process, n_trials=args.n_trials, callbacks=[StudyCallback(watch), target]
            )
    print("worker done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
