"""A worker slot: its state, the one checked way that state changes, and the exit table.

:class:`Worker` holds one slot of a managed job (its process or unit, its launch's files
and evidence, its state); :meth:`Worker.to` is the only writer of its state, checked
against :data:`STATE_TRANSITIONS`. When the process ends, the supervisor
(:mod:`gpuwatchd.jobs.supervisor`) maps the slot to a :class:`Phase` and the end to an
:class:`Event`, looks up :func:`transition` (pure) and carries out the returned
:class:`Action` s in order. The tables and their reasons: docs/managed-jobs.md, "Worker
lifecycle", and docs/supervisor-internals.md, "Worker exit transitions".
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from gpuwatchd.crash import CrashInfo
from gpuwatchd.errors import SupervisorError
from gpuwatchd.jobs.output import OutputFiles, StderrTail
from gpuwatchd.jobs.procfs import OomCounter

if TYPE_CHECKING:
    import subprocess

__all__ = [
    "EXIT_LINE_NOTE",
    "LIVE",
    "STATE_TRANSITIONS",
    "TABLE",
    "WORKER_STATES",
    "Action",
    "Event",
    "Intent",
    "Phase",
    "Step",
    "Worker",
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
    stopped`` when intentional; ``LOG_CRASHED`` also writes the report into the daemon's
    crash ledger, before any ``PERSIST``). ``REMOVE_SLOT``: forget the slot
    (log ``worker left``).
    ``APPLY_RESTART_POLICY``: backoff, budget and crash loop decide the state
    (:mod:`gpuwatchd.restart`). ``PERSIST``: write ``workers.json`` (before the event: a
    daemon crash must not repeat it). ``EMIT_CRASH``: put the
    :class:`~gpuwatchd.jobs.records.WorkerCrash` event in the supervisor's outbox, for the
    daemon's tick to take (:meth:`Supervisor.take_crashes`). ``LAUNCH``:
    start the slot's process again now. ``MARK_STOPPED``: set the state to ``stopped``.
    ``SCHEDULE_BACKOFF``: start again after the delay the restart policy chose, if any.
    """

    LOG_EXITED = "log_exited"
    LOG_CRASHED = "log_crashed"
    REMOVE_SLOT = "remove_slot"
    APPLY_RESTART_POLICY = "apply_restart_policy"
    PERSIST = "persist"
    EMIT_CRASH = "emit_crash"
    LAUNCH = "launch"
    MARK_STOPPED = "mark_stopped"
    SCHEDULE_BACKOFF = "schedule_backoff"


class Step(NamedTuple):
    """The outcome of one transition.

    ``new_state``: the worker state (:data:`WORKER_STATES`) set
    before the actions run, ``None`` to leave it to the actions (``LAUNCH`` sets
    ``running``, ``APPLY_RESTART_POLICY`` sets ``backoff``/``stopped``/``failed``).
    ``actions``: in order. ``note``: the worker's new note (``None``: unchanged).
    """

    new_state: WorkerState | None
    actions: tuple[Action, ...]
    note: str | None


EXIT_LINE_NOTE: Final = (
    "exited with its hook's exit line (clean; launched without the launcher shim, its "
    "status could not be read)"
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
        (A.LOG_CRASHED, A.APPLY_RESTART_POLICY, A.PERSIST, A.EMIT_CRASH, A.SCHEDULE_BACKOFF),
        None,
    ),
    (P.RUNNING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.APPLY_RESTART_POLICY, A.PERSIST, A.EMIT_CRASH, A.SCHEDULE_BACKOFF),
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
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.DRAINING, E.CRASHED_SHUTDOWN): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH),
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
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH),
        "stopped by gpuwatchd",
    ),
    (P.STOPPING, E.CRASHED_SHUTDOWN): Step(
        "stopped",
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH),
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
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH, A.LAUNCH),
        None,
    ),
    (P.RESTARTING, E.CRASHED_SHUTDOWN): Step(
        "stopping",
        (A.LOG_CRASHED, A.PERSIST, A.EMIT_CRASH, A.MARK_STOPPED),
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
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
        None,
    ),
    (P.RUNNING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
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
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
        None,
    ),
    (P.DRAINING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
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
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
        None,
    ),
    (P.STOPPING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None,
        (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH),
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
        None, (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH), None
    ),
    (P.RESTARTING_LEAVING, E.CRASHED_SHUTDOWN): Step(
        None, (A.LOG_CRASHED, A.REMOVE_SLOT, A.PERSIST, A.EMIT_CRASH), None
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
    "failed": frozenset({"running", "backoff", "stopped", "failed"}),
    # the process runs: asked to drain or stop, or it ended (the exit table and the
    # restart policy say into what)
    "running": frozenset({"draining", "stopping", "stopped", "backoff", "failed"}),
    "draining": frozenset({"running", "stopping", "stopped"}),
    # a restart's relaunch that could not exec: the restart policy decides
    "stopping": frozenset({"running", "stopped", "stopping", "backoff", "failed"}),
}
"""Every worker state change the supervisor makes: state -> the states it may go to.
:meth:`gpuwatchd.jobs.worker.Worker.to` refuses any other (as supervisord's
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


#: Worker states as ``workers()`` and ``status()`` show them.
WORKER_STATES: Final[tuple[str, ...]] = (
    "running",  # the process is alive
    "backoff",  # crashed; waiting for its restart delay
    "draining",  # asked to finish its trial and exit (``drain`` over the socket)
    "stopping",  # SIGTERM sent, waiting up to restart.stop_timeout before SIGKILL
    "stopped",  # not running and not restarted: exited cleanly, budget spent, or stopped
    "failed",  # crash loop: died right after start restart.crash_loop times in a row
)


LIVE: Final = frozenset({"running", "draining", "stopping"})
"""States in which the slot's process runs."""


@dataclass(slots=True)
class Worker:
    """One worker slot as the supervisor holds it (mutable; the event loop's only).

    ``state`` is set when the slot is made and changed only by :meth:`to`, checked
    against :data:`~gpuwatchd.jobs.worker.STATE_TRANSITIONS`; assigning it raises
    :class:`AttributeError`.
    """

    number: int
    state: WorkerState = "stopped"
    pid: int | None = None
    start_ticks: int | None = None
    gpu: int | None = None
    placement_reason: str = ""
    started_at_s: float | None = None
    started_mono: float | None = None
    restarts: int = 0
    streak: int = 0
    stalled_streak: int = 0
    """Consecutive deaths of this slot's launches that made no progress (crash loop)."""
    last_crash: CrashInfo | None = None
    exit_code: int | None = None
    adopted: bool = False
    intent: Intent | None = None
    remove_after: bool = False
    exiting: bool = False
    pin_gpu: int | None = None
    next_start_at_s: float | None = None
    trial_number: int | None = None
    last_exception: str | None = None
    note: str = ""
    worker_id: str | None = None
    stderr_offset: int | None = None
    """Size of ``worker-<n>.err`` when this launch started: its output begins there."""
    host_oom_kills: int | None = None
    """``/proc/vmstat``'s ``oom_kill`` when this launch started (kept in workers.json)."""
    given_up: bool = False
    """The supervisor will not start this slot again by itself (crash loop, environment
    failure at start, restart budget spent) until an operator acts."""
    progressed: bool = False
    """Whether this launch made progress: its hook spoke to the daemon, or one of its
    trials finished (a death after progress does not count toward ``crash_loop``)."""
    held: str | None = None
    """Why the slot stays down across daemon restarts (``"finished"``: its process exited
    with status 0; ``"stopped by an operator"``), ``None``: it is started again."""
    oom: OomCounter | None = None
    unit: str | None = None
    """The transient unit running this slot's process (systemd launcher), else ``None``."""
    unit_result: str = ""
    """systemd's ``Result`` of the unit's last run (``oom-kill``, ``exit-code``, ...)."""
    shim: subprocess.Popen[bytes] | None = None
    """The launcher shim this daemon started for the process (subprocess launcher; its
    status is the worker's, :mod:`gpuwatchd.jobs.exit_shim`); ``pid`` is the worker's."""
    files: OutputFiles | None = None
    tail: StderrTail | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Future[None] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and _has_state(self):
            raise AttributeError("Worker.state changes only through Worker.to()")
        object.__setattr__(self, name, value)

    def to(self, new_state: WorkerState, note: str | None = None) -> None:
        """Move to ``new_state`` (and set ``note`` unless None).

        Raises :class:`~gpuwatchd.errors.SupervisorError` (``internal``) for a change
        :data:`~gpuwatchd.jobs.worker.STATE_TRANSITIONS` does not allow: a bug,
        never a user's input.
        """
        if new_state not in STATE_TRANSITIONS.get(self.state, frozenset()):
            raise SupervisorError(
                f"worker {self.number}: no transition {self.state} -> {new_state}",
                code="internal",
            )
        object.__setattr__(self, "state", new_state)
        if note is not None:
            self.note = note


def _has_state(slot: Worker) -> bool:
    try:
        object.__getattribute__(slot, "state")
    except AttributeError:
        return False  # being constructed
    return True
