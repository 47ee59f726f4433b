"""Managed jobs (HPO supervision): run each job's workers, place them on GPUs, restart them.

The daemon creates one :class:`Supervisor`, ``await supervisor.start()`` on its event loop
and ``await supervisor.stop(mode)`` on shutdown. Config: ``jobs:`` in ``gpuwatchd.yaml``
(:class:`gpuwatchd.config.JobConfig`). Behaviour in full: docs/supervisor-internals.md.
"""

from __future__ import annotations

from gpuwatchd.restart import RESTART_KEYS, RestartPolicy
from gpuwatchd.supervisor._output import DEFAULT_OUTPUT_MAX_BYTES, TAIL_LINES
from gpuwatchd.supervisor._placement import Placement, choose_gpu
from gpuwatchd.supervisor._supervisor import (
    STATE_FILE,
    WORKER_STATES,
    Supervisor,
    TrialHolder,
    WorkerCrash,
    WorkerInfo,
    WorkerState,
)

__all__ = [
    "DEFAULT_OUTPUT_MAX_BYTES",
    "RESTART_KEYS",
    "STATE_FILE",
    "TAIL_LINES",
    "WORKER_STATES",
    "Placement",
    "RestartPolicy",
    "Supervisor",
    "TrialHolder",
    "WorkerCrash",
    "WorkerInfo",
    "WorkerState",
    "choose_gpu",
]
