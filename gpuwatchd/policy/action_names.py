"""The name of each policy action (its ``do:`` key, a decision's ``action``), written here
once: its module in gpuwatchd/policy/actions/ names its ``SPEC`` with it, and code that only
names an action (the ``events`` and replay lines, the journal's queries, the config check)
imports it without the actions' registry. Pure: imports nothing."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CORDON_GPU",
    "DRAIN_NODE",
    "EXEC",
    "LOG",
    "LOWER_PARALLELISM",
    "NOTIFY",
    "PLACE_ON_IDLE_GPU",
    "RAISE_PARALLELISM",
    "REQUEUE_TASK",
    "RESTART_STUDY",
    "RESTART_WORKER",
    "SET_KNOB",
    "TUNE_LOADER",
    "UNCORDON_GPU",
]

LOG: Final = "log"
SET_KNOB: Final = "set_knob"
TUNE_LOADER: Final = "tune_loader"
LOWER_PARALLELISM: Final = "lower_parallelism"
RAISE_PARALLELISM: Final = "raise_parallelism"
PLACE_ON_IDLE_GPU: Final = "place_on_idle_gpu"
CORDON_GPU: Final = "cordon_gpu"
UNCORDON_GPU: Final = "uncordon_gpu"
DRAIN_NODE: Final = "drain_node"
RESTART_WORKER: Final = "restart_worker"
RESTART_STUDY: Final = "restart_study"
REQUEUE_TASK: Final = "requeue_task"
NOTIFY: Final = "notify"
EXEC: Final = "exec"
