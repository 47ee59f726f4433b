"""A managed Optuna worker for the systemd tests, written like Optuna's examples.

Storage and study on the command line; each process runs trials one at a time until the
study has ``--target`` COMPLETE trials and nothing WAITING or RUNNING (a crashed trial
comes back as a WAITING retry from gpuwatchd). Each trial trains a tiny PyTorch model on
the CPU and saves its checkpoint into the working directory (``checkpoint-<n>.pt``).

``--crash-once FILE``: the first trial that creates FILE dies as PyTorch does on a GPU
after a device-side assert: the kernel's ``Assertion ... failed.`` lines on stderr, then
``RuntimeError: CUDA error: device-side assert triggered`` uncaught (text as recorded in
tests/data/crashes/assert_runtimeerror_loss_kernel.txt).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import optuna
import torch
from torch import nn

from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective

KERNEL_LINES = "".join(
    "/opt/conda/conda-bld/pytorch_1724789143830/work/aten/src/ATen/native/cuda/Loss.cu:95: "
    f"operator(): block: [0,0,0], thread: [{t},0,0] Assertion `target_val >= zero && "
    "target_val < n_classes` failed.\n"
    for t in range(4)
)
MESSAGE = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study", required=True)
    parser.add_argument("--target", type=int, default=20)
    parser.add_argument("--crash-once", default=None)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per trial")
    args = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=args.storage, study_name=args.study, load_if_exists=True)

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", -10, 10)
        model = nn.Linear(1, 1)
        with torch.no_grad():
            model.bias.fill_(x)
        torch.save(model.state_dict(), f"checkpoint-{trial.number}.pt")
        print(f"trial {trial.number}: x={x:.3f}", flush=True)
        if args.crash_once is not None:
            try:
                os.close(os.open(args.crash_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                sys.stderr.write(KERNEL_LINES)
                sys.stderr.flush()
                raise RuntimeError(MESSAGE)
        time.sleep(args.sleep)
        return (x - 2) ** 2

    with attach(study=args.study, report_interval_s=0.25) as watch:
        run = watch_objective(watch, objective)
        while not (watch.should_stop or watch.drain_requested):
            states = [t.state for t in study.get_trials(deepcopy=False)]
            complete = states.count(optuna.trial.TrialState.COMPLETE)
            busy = states.count(optuna.trial.TrialState.RUNNING)
            waiting = states.count(optuna.trial.TrialState.WAITING)
            if not waiting and complete + busy >= args.target:
                if complete >= args.target and not busy:
                    break
                time.sleep(0.2)  # a running trial may still fail and come back
                continue
            study.optimize(run, n_trials=1, callbacks=[StudyCallback(watch)])
    print("worker done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
