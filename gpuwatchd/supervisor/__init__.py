"""Managed jobs (HPO supervision): run each job's workers, place them on GPUs, restart them.

Design: design.md, "Managed jobs (HPO supervision)"; config: ``jobs:`` in
``gpuwatchd.yaml`` (:class:`gpuwatchd.config.JobConfig`). The daemon creates one
:class:`Supervisor`, ``await supervisor.start()`` on its event loop, and
``await supervisor.stop(mode)`` on shutdown.

Workers
    A job's ``command`` (an argv list, never a shell string) runs as ``workers``
    processes, each with ``cwd``, the daemon's environment (without systemd's
    ``NOTIFY_SOCKET``/``WATCHDOG_*``), the job's ``env``, and ``GPUWATCHD_JOB``,
    ``GPUWATCHD_SOCKET``, ``GPUWATCHD_WORKER`` (the slot number), ``GPUWATCHD_WORKER_ID``
    (unique to this launch; the Optuna hook writes it into each trial's user attrs),
    ``CUDA_VISIBLE_DEVICES`` (the NVML index chosen, or ``""``) and
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so CUDA's numbering is nvidia-smi's). ``user:``
    switches to that user (uid, primary group, supplementary groups, ``HOME``/``USER``/
    ``LOGNAME``): only when the daemon runs as root. stdout/stderr go to
    ``<state_dir>/jobs/<job>/worker-<n>.out`` / ``.err`` (copy-truncate rotation to
    ``.1`` above 64 MiB); the last 200 stderr lines are kept in memory.

Placement
    ``gpus: auto``: most free memory per worker; a list: fewest of our workers, round-
    robin (:mod:`gpuwatchd.supervisor._placement`). Every placement is logged as
    ``worker placed`` (``job``, ``worker``, ``gpu``, ``reason``) and shown by
    :meth:`Supervisor.workers`.

Restarts
    A worker that ends with a non-zero status or a signal is classified
    (:func:`gpuwatchd.crash.classify`), reported to ``on_crash`` and restarted after a
    doubling delay (``restart.backoff`` .. ``restart.max_backoff``), within
    ``restart.budget`` restarts per ``restart.budget_window``; a worker that dies within
    ``restart.min_uptime`` of its start ``restart.crash_loop`` times in a row is
    ``failed`` and left alone (:mod:`gpuwatchd.restart`). A clean exit
    (status 0: the study is done) is not restarted (systemd's ``Restart=on-failure``).
    A CUDA device-side assert always means a new process: CUDA documents the context as
    unusable until the process is terminated and relaunched (:mod:`gpuwatchd.crash`).

Daemon restarts
    ``<state_dir>/jobs/<job>/workers.json`` names every live worker by pid and start time
    (``/proc/<pid>/stat`` field 22) and keeps the job's current parallelism and recent
    restart times. A daemon started after a crash adopts the workers still running (same
    pid *and* start time) instead of starting duplicates, and reports the ones that ended
    meanwhile. An adopted worker is not our child: its exit status cannot be read (it is
    ``None``) and its end is noticed through a pidfd (``pidfd_open(2)``) or by polling
    ``/proc``; its crash is classified from its stderr file alone. Under systemd this
    needs ``KillMode=process`` (with ``control-group`` or ``mixed``, systemd kills the
    unit's remaining processes, the workers, when the daemon dies).
"""

from __future__ import annotations

from gpuwatchd.restart import RESTART_KEYS, RestartPolicy
from gpuwatchd.supervisor._output import DEFAULT_OUTPUT_MAX_BYTES, TAIL_LINES
from gpuwatchd.supervisor._placement import Placement, choose_gpu
from gpuwatchd.supervisor._supervisor import (
    STATE_FILE,
    WORKER_STATES,
    Supervisor,
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
    "WorkerCrash",
    "WorkerInfo",
    "WorkerState",
    "choose_gpu",
]
