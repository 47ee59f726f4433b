"""The worker exit-transition table: what the supervisor does when a worker process ends.

Pure: no processes, no I/O, no clock. The supervisor (:mod:`gpuwatchd.jobs.supervisor`)
maps a worker that ended to a :class:`Phase` and an :class:`Event`, looks up
:func:`transition` and carries out the returned :class:`Action` s in order. The table and
its reasons: docs/supervisor-internals.md, "Worker exit transitions".
"""

from __future__ import annotations

import enum
from typing import Final, Literal, NamedTuple

__all__ = [
    "EXIT_LINE_NOTE",
    "STATE_TRANSITIONS",
    "TABLE",
    "Action",
    "Event",
    "Intent",
    "Phase",
    "Step",
    "WorkerState",
    "event_of",
    "is_intentional",
    "phase_of",
    "transition",
]

WorkerState = Literal["running", "backoff", "draining", "stopping", "stopped", "failed"]
"""A worker slot's state (``gpuwatchctl jobs``); the changes: :data:`STATE_TRANSITIONS`."""

Intent = Literal["drain", "kill", "restart"]
"""What the supervisor asked of a running worker: finish its trial (``drain``), stop
(``kill``: SIGTERM, SIGKILL after ``restart.stop_timeout``) or stop and start again."""


class Phase(enum.Enum):
    """What the supervisor had asked of a worker when its process ended.

    The ``*_LEAVING`` phases are the same with the slot on its way out (parallelism
    lowered: the slot is removed after the exit instead of being kept).
    """

    RUNNING = "running"  # nothing asked: the process ended on its own
    DRAINING = "draining"  # asked to finish its trial and exit
    STOPPING = "stopping"  # SIGTERM sent (set_parallelism "now", stop)
    RESTARTING = "restarting"  # SIGTERM sent by restart_worker: start again after the exit
    RUNNING_LEAVING = "running_leaving"
    DRAINING_LEAVING = "draining_leaving"
    STOPPING_LEAVING = "stopping_leaving"
    RESTARTING_LEAVING = "restarting_leaving"


class Event(enum.Enum):
    """How the process ended, and whether the whole supervisor is shutting down.

    ``EXITED_CLEAN``: status 0. ``EXITED_CLEAN_BY_HOOK``: an adopted worker (no exit
    status to read) whose launch's stderr holds the hook's exit line, written from the
    process's exit path. ``CRASHED``: any other end (non-zero status, a signal, or an
    adopted worker's unknown status: nothing is presumed from absent evidence). ``*_SHUTDOWN``:
    the same while :meth:`Supervisor.stop` stops every job.
    """

    EXITED_CLEAN = "exited_clean"
    EXITED_CLEAN_BY_HOOK = "exited_clean_by_hook"
    CRASHED = "crashed"
    EXITED_CLEAN_SHUTDOWN = "exited_clean_shutdown"
    EXITED_CLEAN_BY_HOOK_SHUTDOWN = "exited_clean_by_hook_shutdown"
    CRASHED_SHUTDOWN = "crashed_shutdown"


class Action(enum.Enum):
    """One thing the supervisor does after an exit; a :class:`Step` lists them in order.

    ``LOG_EXITED``/``LOG_CRASHED``: log ``worker exited`` / ``worker crashed`` (``worker
    stopped`` when intentional; ``LOG_CRASHED`` also hands the report to ``record_crash``,
    the daemon's crash ledger, before any ``PERSIST``). ``REMOVE_SLOT``: forget the slot
    (log ``worker left``).
    ``APPLY_RESTART_POLICY``: backoff, budget and crash loop decide the state
    (:mod:`gpuwatchd.restart`). ``PERSIST``: write ``workers.json`` (before the callback: a
    daemon crash must not repeat it). ``NOTIFY_CRASH``: call ``on_crash``. ``LAUNCH``:
    start the slot's process again now. ``MARK_STOPPED``: set the state to ``stopped``.
    ``SCHEDULE_BACKOFF``: start again after the delay the restart policy chose, if any.
    """

    LOG_EXITED = "log_exited"
    LOG_CRASHED = "log_crashed"
    REMOVE_SLOT = "remove_slot"
    APPLY_RESTART_POLICY = "apply_restart_policy"
    PERSIST = "persist"
    NOTIFY_CRASH = "notify_crash"
    LAUNCH = "launch"
    MARK_STOPPED = "mark_stopped"
    SCHEDULE_BACKOFF = "schedule_backoff"


class Step(NamedTuple):
    """The outcome of one transition.

    ``new_state``: the worker state (:data:`~gpuwatchd.jobs.records.WORKER_STATES`) set
    before the actions run, ``None`` to leave it to the actions (``LAUNCH`` sets
    ``running``, ``APPLY_RESTART_POLICY`` sets ``backoff``/``stopped``/``failed``).
    ``actions``: in order. ``note``: the worker's new note (``None``: unchanged).
    """

    new_state: WorkerState | None
    actions: tuple[Action, ...]
    note: str | None


EXIT_LINE_NOTE: Final = (
    "exited with its hook's exit line (clean; the status of a process gpuwatchd did not "
    "start cannot be read)"
)

P, E, A = Phase, Event, Action
_EXIT_LINE_NOTE: Final = EXIT_LINE_NOTE

TABLE: Final[dict[tuple[Phase, Event], Step]] = {
    (P.RUNNING, E.EXITED_CLEAN): Step("stopped", (A.LOG_EXITED, A.PERSIST), "exited with status 0"),
    (P.RUNNING, E.EXITED_CLEAN_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "exited with status 0",
    ),
    (P.RUNNING, E.EXITED_CLEAN_BY_HOOK): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        _EXIT_LINE_NOTE,
    ),
    (P.RUNNING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        _EXIT_LINE_NOTE,
    ),
    (P.RUNNING, E.CRASHED): Step(
        None,
        (A.LOG_CRASHED, A.APPLY_RESTART_POLICY, A.PERSIST, A.NOTIFY_CRASH, A.SCHEDULE_BACKOFF),
        None,
    ),
    (P.RUNNING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.APPLY_RESTART_POLICY, A.PERSIST, A.NOTIFY_CRASH, A.SCHEDULE_BACKOFF),
        None,
    ),
    (P.DRAINING, E.EXITED_CLEAN): Step("stopped", (A.LOG_EXITED, A.PERSIST), "drained"),
    (P.DRAINING, E.EXITED_CLEAN_SHUTDOWN): Step("stopped", (A.LOG_EXITED, A.PERSIST), "drained"),
    (P.DRAINING, E.EXITED_CLEAN_BY_HOOK): Step("stopped", (A.LOG_EXITED, A.PERSIST), "drained"),
    (P.DRAINING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "drained",
    ),
    (P.DRAINING, E.CRASHED): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.DRAINING, E.CRASHED_SHUTDOWN): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.EXITED_CLEAN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.EXITED_CLEAN_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.EXITED_CLEAN_BY_HOOK): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.CRASHED): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.CRASHED_SHUTDOWN): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.RESTARTING, E.EXITED_CLEAN): Step(None, (A.LOG_EXITED, A.LAUNCH), None),
    (P.RESTARTING, E.EXITED_CLEAN_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.RESTARTING, E.EXITED_CLEAN_BY_HOOK): Step(None, (A.LOG_EXITED, A.LAUNCH), None),
    (P.RESTARTING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        "stopped",
        (A.LOG_EXITED, A.PERSIST),
        "stopped by gpuwatchd",
    ),
    (P.RESTARTING, E.CRASHED): Step(
        "stopping",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH, A.LAUNCH),
        None,
    ),
    (P.RESTARTING, E.CRASHED_SHUTDOWN): Step(
        "stopping",
        (A.LOG_CRASHED, A.PERSIST, A.NOTIFY_CRASH, A.MARK_STOPPED),
        None,
    ),
    (P.RUNNING_LEAVING, E.EXITED_CLEAN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RUNNING_LEAVING, E.EXITED_CLEAN_SHUTDOWN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RUNNING_LEAVING, E.EXITED_CLEAN_BY_HOOK): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RUNNING_LEAVING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        None,
        (A.REMOVE_SLOT, A.PERSIST),
        None,
    ),
    (P.RUNNING_LEAVING, E.CRASHED): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.RUNNING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.DRAINING_LEAVING, E.EXITED_CLEAN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.DRAINING_LEAVING, E.EXITED_CLEAN_SHUTDOWN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.DRAINING_LEAVING, E.EXITED_CLEAN_BY_HOOK): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.DRAINING_LEAVING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        None,
        (A.REMOVE_SLOT, A.PERSIST),
        None,
    ),
    (P.DRAINING_LEAVING, E.CRASHED): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.DRAINING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.STOPPING_LEAVING, E.EXITED_CLEAN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.STOPPING_LEAVING, E.EXITED_CLEAN_SHUTDOWN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.STOPPING_LEAVING, E.EXITED_CLEAN_BY_HOOK): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.STOPPING_LEAVING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        None,
        (A.REMOVE_SLOT, A.PERSIST),
        None,
    ),
    (P.STOPPING_LEAVING, E.CRASHED): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.STOPPING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH),
        None,
    ),
    (P.RESTARTING_LEAVING, E.EXITED_CLEAN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RESTARTING_LEAVING, E.EXITED_CLEAN_SHUTDOWN): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RESTARTING_LEAVING, E.EXITED_CLEAN_BY_HOOK): Step(None, (A.REMOVE_SLOT, A.PERSIST), None),
    (P.RESTARTING_LEAVING, E.EXITED_CLEAN_BY_HOOK_SHUTDOWN): Step(
        None,
        (A.REMOVE_SLOT, A.PERSIST),
        None,
    ),
    # A removed slot is not started again (before the table, _exited relaunched it).
    (P.RESTARTING_LEAVING, E.CRASHED): Step(
        None, (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH), None
    ),
    (P.RESTARTING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None, (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.NOTIFY_CRASH), None
    ),
}
"""Every (phase, event) pair: 8 phases x 6 events = 48 rows, no default."""

del P, E, A

_PHASES: Final[dict[tuple[Intent | None, bool], Phase]] = {
    (None, False): Phase.RUNNING,
    ("drain", False): Phase.DRAINING,
    ("kill", False): Phase.STOPPING,
    ("restart", False): Phase.RESTARTING,
    (None, True): Phase.RUNNING_LEAVING,
    ("drain", True): Phase.DRAINING_LEAVING,
    ("kill", True): Phase.STOPPING_LEAVING,
    ("restart", True): Phase.RESTARTING_LEAVING,
}


STATE_TRANSITIONS: Final[dict[WorkerState, frozenset[WorkerState]]] = {
    # launched (a crashed slot's restart, an operator's job start, a restart_worker)
    "stopped": frozenset({"running", "backoff", "failed", "stopped"}),
    "backoff": frozenset({"running", "backoff", "stopped", "failed"}),
    "failed": frozenset({"running", "backoff", "stopped"}),
    # the process runs: asked to drain or stop, or it ended (the exit table and the
    # restart policy say into what)
    "running": frozenset({"draining", "stopping", "stopped", "backoff", "failed"}),
    "draining": frozenset({"running", "stopping", "stopped"}),
    "stopping": frozenset({"running", "stopped", "stopping"}),
}
"""Every worker state change the supervisor makes: state -> the states it may go to.
:meth:`gpuwatchd.jobs.records.WorkerSlot.to` refuses any other (as supervisord's
``_assertInState``); the reasons are in docs/managed-jobs.md, "Worker lifecycle"."""


def phase_of(intent: Intent | None, remove_after: bool) -> Phase:
    """The :class:`Phase` of a worker with ``intent`` and ``remove_after`` when it ended."""
    return _PHASES[(intent, remove_after)]


def event_of(
    returncode: int | None,
    *,
    exit_line: bool,
    shutting_down: bool,
    oom_killed: bool = False,
) -> Event:
    """The :class:`Event` for an end with ``returncode`` (``None``: unknown, adopted).

    ``exit_line``: an adopted worker whose stderr holds the hook's exit line
    (:func:`gpuwatchd.control.protocol.exit_line_of`). ``shutting_down``: the supervisor
    is stopping every job. ``oom_killed``: its unit's ``Result=oom-kill`` (the kernel
    killed one of its processes): a crash even with status 0 (a main process that exits
    0 on the SIGTERM of ``OOMPolicy=stop``).
    """
    if oom_killed:
        event = Event.CRASHED
    elif exit_line and returncode is None:
        event = Event.EXITED_CLEAN_BY_HOOK
    elif returncode == 0:
        event = Event.EXITED_CLEAN
    else:
        event = Event.CRASHED
    if shutting_down:
        event = Event(f"{event.value}_shutdown")
    return event


def is_intentional(phase: Phase) -> bool:
    """Whether the supervisor itself stopped the process (``kill`` or ``restart``).

    Such an end is reported with ``intentional=True``: its trial was cut short, but it
    is not a crash for the ``job_crashed`` detector.
    """
    return phase in (
        Phase.STOPPING,
        Phase.RESTARTING,
        Phase.STOPPING_LEAVING,
        Phase.RESTARTING_LEAVING,
    )


def transition(phase: Phase, event: Event) -> Step:
    """The :class:`Step` for a worker in ``phase`` whose process ended with ``event``.

    Total: every pair has a row in :data:`TABLE` (tested exhaustively).
    """
    return TABLE[(phase, event)]
