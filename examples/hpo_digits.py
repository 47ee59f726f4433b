#!/usr/bin/env python3
"""An Optuna study on scikit-learn's digits, each trial a small PyTorch CPU training run
attached to gpuwatchd (trial context, study callback, gradient accumulation, OOM halving).

Each trial trains an MLP (hidden units and learning rate from Optuna) with the augmented
digits of ``train_digits.py``. The loader is built from the hook's knobs
(``num_workers``, ``batch_size``); ``watch.step`` accumulates micro-batches up to
``--effective-batch`` samples per optimizer step, so a daemon (or an out-of-memory
error) that changes ``batch_size`` does not change the optimisation. The daemon sees the
running trial's number and params, and a ``trial`` event with each trial's final state.

Usage::

    python examples/hpo_digits.py --job digits-hpo --trials 20
    python examples/hpo_digits.py --storage sqlite:///hpo.db --study digits --trials 50

One line per trial on stdout (``trial=… state=… value=… batch_size=…``). A daemon's
``stop`` prunes the running trial and ends the study; ``drain`` lets it finish first.
Exit status 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset
from train_digits import FEATURES, AugmentedDigits  # this script's directory is on sys.path

from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.environ.get("GPUWATCHD_JOB", "digits-hpo"))
    parser.add_argument("--socket", default=None, help="control socket (default: gpuwatchd's)")
    parser.add_argument("--storage", default=None, help="Optuna storage URL (default: memory)")
    parser.add_argument("--study", default="digits-hpo", help="Optuna study name")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per trial")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader num_workers")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch size")
    parser.add_argument("--effective-batch", type=int, default=64, help="samples per update")
    parser.add_argument("--views", type=int, default=1, help="augmented views per sample")
    parser.add_argument("--samples", type=int, default=1797, help="digits used (<= 1797)")
    args = parser.parse_args(argv)
    if args.effective_batch % args.batch_size:
        parser.error("--batch-size must divide --effective-batch")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the study; print one line per trial; return 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    dataset = AugmentedDigits(views=args.views, seed=0)
    train_set = Subset(dataset, range(min(args.samples, len(dataset))))
    knobs = {"num_workers": args.num_workers, "batch_size": args.batch_size}
    with attach(
        job=args.job,
        knobs=knobs,
        socket=args.socket,
        study=args.study,
        effective_batch_size=args.effective_batch,
        oom="halve",
    ) as watch:

        def make_loader(k: dict[str, Any]) -> DataLoader[Any]:
            return DataLoader(
                train_set,
                batch_size=int(k["batch_size"]),
                shuffle=True,
                num_workers=int(k["num_workers"]),
            )

        def objective(trial: optuna.Trial) -> float:
            hidden = trial.suggest_int("hidden", 16, 128, log=True)
            lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
            torch.manual_seed(trial.number)
            model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 10))
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            loader = watch.loader(make_loader)  # the trial's primary loader
            correct = seen = 0
            for epoch in range(args.epochs):
                correct = seen = 0
                for features, labels in loader:
                    with torch.no_grad():  # accuracy on the training stream
                        correct += int((model(features).argmax(dim=1) == labels).sum())
                    seen += len(labels)
                    watch.step(
                        lambda b: F.cross_entropy(model(b[0]), b[1]),
                        (features, labels),
                        optimizer,
                    )
                trial.report(correct / max(seen, 1), epoch)
                if trial.should_prune():
                    raise optuna.TrialPruned()
            return correct / max(seen, 1)

        study = optuna.create_study(
            storage=args.storage,
            study_name=args.study,
            direction="maximize",
            load_if_exists=True,
        )

        def print_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            print(
                f"trial={trial.number} state={trial.state.name} value={trial.value} "
                f"params={trial.params} batch_size={watch.batch_size} "
                f"accumulation_steps={watch.accumulation_steps} connected={watch.connected}",
                flush=True,
            )

        study.optimize(
            watch_objective(watch, objective),
            n_trials=args.trials,
            callbacks=[StudyCallback(watch), print_trial],
        )
    best = study.best_trial if any(t.value is not None for t in study.trials) else None
    print(f"done: {len(study.trials)} trials; best={best.value if best else None}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
