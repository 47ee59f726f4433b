"""Optuna integration: the trial context and a study callback over one :class:`Watch`.

::

    import optuna
    from gpuwatchd.hook import attach
    from gpuwatchd.hook.optuna import StudyCallback, watch_objective

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        loader = watch.loader(make_loader)      # the trial's primary loader
        for epoch in range(10):
            for batch in loader: ...
        return accuracy

    with attach(job="hpo", knobs={"num_workers": 4}) as watch:
        study = optuna.create_study(storage=..., study_name="criteria", load_if_exists=True)
        study.optimize(watch_objective(watch, objective), n_trials=50,
                       callbacks=[StudyCallback(watch)])

Inside each trial the hook reports the trial's number and params; a daemon ``stop``
prunes the running trial (``optuna.TrialPruned`` at the next step) and stops the study;
a ``drain`` lets the running trial finish, then stops the study (``study.stop()``).
Each trial's final ``TrialState`` (COMPLETE, PRUNED, FAIL) goes to the daemon as a
``trial`` event, so its ``trials_succeeded_in_row`` detector can count them.

Optuna itself is not imported by this module (the objects are duck-typed); the user's
program imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gpuwatchd.hook._watch import Watch

__all__ = ["StudyCallback", "watch_objective"]

R = TypeVar("R")


def watch_objective(watch: Watch, objective: Callable[[Any], R]) -> Callable[[Any], R]:
    """Wrap an Optuna objective so that each call runs inside ``watch.trial(trial)``.

    The wrapper has the objective's name and docstring; it returns what the objective
    returns and raises what it raises (``TrialPruned`` included).
    """

    @functools.wraps(objective)
    def run(trial: Any) -> R:
        with watch.trial(trial):
            return objective(trial)

    return run


class StudyCallback:
    """A callback for ``study.optimize(..., callbacks=[StudyCallback(watch)])``.

    After each trial it sends a ``trial`` event with Optuna's final ``TrialState``
    (``frozen_trial.state.name``: the authoritative state, e.g. FAIL for an objective
    that returned NaN), and calls ``study.stop()`` once the daemon's ``stop`` or
    ``drain`` has been applied. Creating it makes :meth:`Watch.trial` leave the
    COMPLETE/PRUNED events to it (FAIL by an exception Optuna re-raises is still sent
    by the trial context: callbacks never see those trials).
    """

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        watch.leave_trial_states_to_callback()

    def __call__(self, study: Any, trial: Any) -> None:
        """Optuna's callback signature: ``(study, frozen_trial)``."""
        state = getattr(getattr(trial, "state", None), "name", None)
        number = getattr(trial, "number", None)
        self.watch.report_trial(number if isinstance(number, int) else None, state)
        if self.watch.should_stop or self.watch.drain_requested:
            study.stop()
