#!/usr/bin/env python3
"""One worker of a supervised Optuna study: short PyTorch CPU trials attached to gpuwatchd.

gpuwatchd runs this script as the ``workers`` processes of a managed job (see
``gpuwatchd.yaml`` next to it). Each process loads the study and runs trials one after
another, many per process, until the study has ``--target`` finished trials (COMPLETE,
PRUNED or FAIL) and nothing is left WAITING or RUNNING; then it exits with status 0 and
the supervisor does not restart it. A re-enqueued trial (a WAITING retry) is picked up
first, by whichever worker asks next.

With ``--n-trials N`` the process runs as Optuna's examples do:
``study.optimize(objective, n_trials=N)``, at most N trials, stopped early (a callback's
``study.stop()``) once the study has ``--target`` finished trials and no WAITING retry;
a trial still RUNNING elsewhere is its own worker's (a crash restarts that worker, which
then runs the retry).

Each trial trains a small MLP on a fixed synthetic classification task (``--steps``
SGD steps; ``--step-time`` seconds of sleep per step stand for the GPU's share of a
step). Its hyper-parameters are ``lr``, ``hidden`` and ``head`` (the classifier's output
size). ``head`` below the 10 classes is a *bug in the search space*, the classic cause of
a CUDA device-side assert: a label outside the classifier's range. On the CPU PyTorch
raises ``IndexError: Target 9 is out of bounds``; on a GPU (``--device cuda``, as the GPU
battery bench/gpu_check.py runs it) the ``nll_loss`` kernel asserts, which kills the CUDA
context. Every retry of such a trial fails again, so the
daemon's ``max_retries`` is what ends its chain.

The hook (:mod:`gpuwatchd.hook.optuna`) reports each trial's number and params while it
runs and its final ``TrialState``; a daemon ``drain`` (``lower_parallelism``) lets the
running trial finish and then ends this process with status 0.

Fault injection (how the chaos test makes CPU trials die as GPU trials do; off by
default). With ``--faults DIR`` (a directory of recorded PyTorch outputs, e.g.
``tests/data/crashes``) the worker dies *as PyTorch on a GPU would*:

* ``assert``: the kernel's assert lines on stderr, then ``torch.AcceleratorError`` with
  PyTorch's ``CUDA error: device-side assert triggered`` message, uncaught: Optuna marks
  the trial FAIL and re-raises, Python prints the traceback, exit status 1;
* ``abort``: the abort path (``terminate called after throwing an instance of
  'c10::CUDAError'`` from a tensor destructor, then ``abort()``): SIGABRT, and the trial
  stays RUNNING because nothing in the process could mark it;
* ``oom``: ``torch.OutOfMemoryError`` with the recorded ``CUDA out of memory`` message,
  uncaught: exit status 1.

``head`` < 10 then dies by ``assert`` (as on a GPU); ``--sampler random`` keeps such trials
at their prior share (TPE learns that ``head`` near 10 is best and samples 9 often).
Random faults are drawn per trial number from ``random.Random(f"{seed}:{number}")``
(``--seed``): ``--assert-rate``, ``--abort-rate`` and, for trial numbers below
``--oom-until``, ``--oom-rate`` (memory pressure early in the study, while large models
are tried), all of them only for trial numbers below ``--faults-until`` (a study that
calms down); the fault strikes at a seeded step in the second half of the trial, after
the hook has reported the trial.
``--fault-once PATH:KIND`` (repeatable) makes exactly one fault: the first process that
creates ``PATH`` (``O_EXCL``) dies of ``KIND`` in its first trial (a process takes at
most one).
``--fault-when PATH:KIND`` (repeatable) waits for a file: the first trial, of any
process, to start while ``PATH`` exists takes it (renames it to ``PATH.taken``) and dies
of ``KIND`` (a test creates ``PATH`` when the fault must strike, e.g. while the daemon
is down).

``--storage`` names the study's storage as gpuwatchd's config does: an RDB URL, or
``journal:///srv/hpo/optuna.log`` for Optuna's JournalStorage on a file (its docs'
storage for several processes without a database), or ``redis://host:6379/0`` for one
on Redis (see :func:`open_storage`).

Usage::

    python examples/hpo/worker.py --storage sqlite:////srv/hpo/optuna.db --study demo \\
        --target 200 [--heartbeat 1 --grace-period 5]
    python examples/hpo/worker.py --storage journal:///srv/hpo/optuna.log --study demo
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective

CLASSES = 10
FEATURES = 16
SAMPLES = 512
FINISHED = ("COMPLETE", "PRUNED", "FAIL")
FAULTS = ("assert", "abort", "oom")
REPORT_EVERY = 5
"""Steps between ``trial.report`` calls (intermediate values for the MedianPruner)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--storage", required=True, help="Optuna RDB URL, journal:///PATH or redis://HOST/DB"
    )
    parser.add_argument("--study", required=True, help="study name (created if missing)")
    parser.add_argument("--target", type=int, default=100, help="finished trials to reach")
    parser.add_argument(
        "--n-trials", type=int, default=None, help="study.optimize(n_trials=N) per process"
    )
    parser.add_argument("--steps", type=int, default=20, help="SGD steps per trial")
    parser.add_argument("--step-time", type=float, default=0.03, help="seconds per step")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--device", default="cpu", help="where trials train: cpu (default) or cuda[:N]"
    )
    parser.add_argument("--heartbeat", type=int, default=None, help="Optuna heartbeat (s)")
    parser.add_argument("--grace-period", type=int, default=None, help="heartbeat grace (s)")
    parser.add_argument("--faults", type=Path, default=None, help="recorded PyTorch outputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-min", type=int, default=9, help="smallest output layer (9: a poisoned corner)"
    )
    parser.add_argument(
        "--sampler", choices=("tpe", "random"), default="tpe", help="Optuna sampler"
    )
    parser.add_argument("--assert-rate", type=float, default=0.0)
    parser.add_argument("--abort-rate", type=float, default=0.0)
    parser.add_argument("--oom-rate", type=float, default=0.0)
    parser.add_argument("--oom-until", type=int, default=1 << 30)
    parser.add_argument("--faults-until", type=int, default=1 << 30)
    parser.add_argument("--fault-once", action="append", default=[], metavar="PATH:KIND")
    parser.add_argument("--fault-when", action="append", default=[], metavar="PATH:KIND")
    return parser.parse_args(argv)


def _recorded(faults: Path, name: str) -> str:
    return (faults / name).read_text(encoding="utf-8")


def _message_after(text: str, prefix: str) -> str:
    """The exception message of a recorded traceback: the text after ``prefix``."""
    start = text.index(prefix) + len(prefix)
    return text[start:].rstrip("\n")


def die(kind: str, faults: Path) -> None:
    """Die of ``kind`` as PyTorch on a GPU does (module docstring); never returns."""
    if kind == "abort":
        sys.stderr.write(_recorded(faults, "abort_c10_cudaerror_assert.txt"))
        sys.stderr.flush()
        os.abort()
    if kind == "assert":
        sys.stderr.write(_recorded(faults, "assert_kernel_lines_indexkernel.txt"))
        sys.stderr.flush()
        text = _recorded(faults, "assert_acceleratorerror_script_generated.txt")
        raise torch.AcceleratorError(_message_after(text, "torch.AcceleratorError: "))
    if kind == "oom":
        text = _recorded(faults, "oom_torch_cuda_outofmemoryerror.txt")
        raise torch.OutOfMemoryError(_message_after(text, "torch.cuda.OutOfMemoryError: "))
    raise ValueError(f"unknown fault {kind!r}")


class Faults:
    """Which trial dies of what, and at which step (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir: Path | None = args.faults
        self.once = _specs("--fault-once", args.fault_once)
        self.when = _specs("--fault-when", args.fault_when)

    def plan(self, number: int) -> tuple[str, int] | None:
        """``(kind, step)`` for trial ``number``, or None for a healthy trial."""
        if self.dir is None:
            return None
        args = self.args
        rng = random.Random(f"{args.seed}:{number}")
        step = rng.randint(args.steps // 2, max(args.steps // 2, args.steps - 1))
        for path, kind in self.when:
            try:
                os.rename(path, path + ".taken")  # atomic: one trial takes it
            except FileNotFoundError:
                continue
            return kind, step
        if self.once:
            once, self.once = self.once, []  # only this process's first trial may take one
            for path, kind in once:
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                except FileExistsError:
                    continue
                return kind, step
            return None
        if number >= args.faults_until:
            return None
        u = rng.random()
        for kind, rate in (("assert", args.assert_rate), ("abort", args.abort_rate)):
            if u < rate:
                return kind, step
            u -= rate
        if number < args.oom_until and u < args.oom_rate:
            return "oom", step
        return None


def _specs(option: str, values: Sequence[str]) -> list[tuple[str, str]]:
    """``PATH:KIND`` values of ``option`` as ``(path, kind)``; SystemExit for a bad one."""
    specs = []
    for spec in values:
        path, _, kind = spec.rpartition(":")
        if kind not in FAULTS or not path:
            raise SystemExit(f"{option}: expected PATH:KIND (KIND one of {FAULTS})")
        specs.append((path, kind))
    return specs


def open_storage(
    url: str, heartbeat: int | None = None, grace_period: int | None = None
) -> str | optuna.storages.BaseStorage:
    """The storage ``url`` names, opened as Optuna's docs open it: ``journal://PATH`` is a
    JournalStorage on the file PATH, ``redis://...`` one on Redis, anything else an RDB
    URL (an ``RDBStorage`` recording heartbeats with ``heartbeat``: only RDB storages can)."""
    if url.startswith("journal://"):
        path = url.removeprefix("journal://")
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    if url.startswith(("redis://", "rediss://")):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalRedisBackend(url))
    if heartbeat is not None:
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=heartbeat, grace_period=grace_period
        )
    return url


def _counts(study: optuna.Study) -> dict[str, int]:
    counts = dict.fromkeys(("RUNNING", "WAITING", *FINISHED), 0)
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Run trials until the study is done or the daemon drains this worker; return 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(SAMPLES, CLASSES, generator=generator)).argmax(1)
    dataset = TensorDataset(x, y)
    faults = Faults(args)

    storage = open_storage(args.storage, args.heartbeat, args.grace_period)
    sampler: optuna.samplers.BaseSampler | None = None
    if args.sampler == "random":  # independent trials; seeded per process
        sampler = optuna.samplers.RandomSampler(seed=args.seed * 1_000_003 + os.getpid())
    study = optuna.create_study(
        storage=storage,
        study_name=args.study,
        direction="minimize",
        load_if_exists=True,
        sampler=sampler,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=args.steps // 2),
    )

    with attach(knobs={"num_workers": 0}, study=args.study, report_interval_s=0.25) as watch:

        def make_loader(k: dict[str, Any]) -> DataLoader[Any]:
            return DataLoader(
                dataset, batch_size=args.batch_size, shuffle=True, num_workers=k["num_workers"]
            )

        def objective(trial: optuna.Trial) -> float:
            lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
            hidden = trial.suggest_int("hidden", 8, 64)
            # head 9 < 10 classes: labels out of range, a real device-side assert (the
            # poisoned corner of the search space), unless --head-min 10 keeps out of it
            head = trial.suggest_int("head", args.head_min, 40)
            fault = faults.plan(trial.number)
            torch.manual_seed(trial.number)
            model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, head))
            model = model.to(args.device)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            loader = watch.loader(make_loader)  # the trial's primary loader
            loss_value = float("inf")
            step = 0
            while step < args.steps:
                for features, labels in loader:
                    if fault is not None and step == fault[1] and faults.dir is not None:
                        die(fault[0], faults.dir)
                    features, labels = features.to(args.device), labels.to(args.device)
                    try:
                        loss = F.cross_entropy(model(features), labels)
                    except IndexError:
                        if faults.dir is not None:  # what the CUDA nll_loss kernel does
                            die("assert", faults.dir)
                        raise
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    loss_value = loss.item()
                    time.sleep(args.step_time)
                    step += 1
                    if step % REPORT_EVERY == 0:  # each report is a storage write
                        trial.report(loss_value, step)
                        if trial.should_prune():
                            raise optuna.TrialPruned()
                    if step >= args.steps:
                        break
            return loss_value

        run = watch_objective(watch, objective)
        callbacks = [StudyCallback(watch)]
        if args.n_trials is not None:

            def stop_when_done(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                counts = _counts(study)
                if sum(counts[s] for s in FINISHED) >= args.target and not counts["WAITING"]:
                    study.stop()

            study.optimize(run, n_trials=args.n_trials, callbacks=[*callbacks, stop_when_done])
        while args.n_trials is None and not (watch.should_stop or watch.drain_requested):
            counts = _counts(study)
            finished = sum(counts[s] for s in FINISHED)
            if not counts["WAITING"]:
                if finished >= args.target and not counts["RUNNING"]:
                    break  # done: nothing left to run or to come back as a retry
                if finished + counts["RUNNING"] >= args.target:
                    time.sleep(0.2)  # running trials may still fail and be re-enqueued
                    continue
            study.optimize(run, n_trials=1, callbacks=callbacks)
    print(f"worker done: {_counts(study)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
