"""Worker crashes: from the supervisor's report to the tick's ``crash`` event, and ledger replay.

:class:`CrashHandler` writes the ledger entry first, settles which trial the worker ran
(:mod:`gpuwatchd.hpo.attribution`), fails that trial (:class:`SupervisorActions`, the
actuator's managed-job backend), and posts the crash event for the next tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.errors import ActionRefused, StudyError
from gpuwatchd.hpo.attribution import TrialAttribution, killed_from_outside
from gpuwatchd.hpo.ledger import CrashLedger
from gpuwatchd.hpo.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.journal import Journal
from gpuwatchd.model import Decision, JobEvent
from gpuwatchd.supervisor import Supervisor, WorkerCrash, WorkerInfo
from gpuwatchd.xid import XidEvent

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.control.server import ControlServer

__all__ = [
    "CrashHandler",
    "SupervisorActions",
    "crash_decided",
    "effective_max_retries",
]

_CRASHES_KEPT: Final = 1024
"""Crash reports remembered for restart decisions (oldest forgotten first)."""
_LAST_WORDS_WAIT_S: Final = 1.0
"""How long a dead worker's hook connection may take to close (its last events)."""
_POSTED_KEPT: Final = 10_000
"""Crash events posted and not yet seen by a tick that are remembered (the control
server's event queue holds as many; older ones were dropped from it, and their ledger
entries wait for the next start)."""


def crash_decided(journal: Journal, crash: WorkerCrash) -> bool:
    """Whether the journal holds ``crash``: its ``job_crashed`` finding (a daemon killed
    after the tick that journaled it, before the ledger entry was dropped), a decision
    made about it (a restart action naming its pid), or a decision whose findings
    include its finding. Such a crash is not posted again: one death, one event."""
    marker = f"job {crash.job} worker pid {crash.pid} crashed"
    since_s = crash.timestamp_s - 1.0
    if any(m.startswith(marker) for m in journal.finding_messages_since("job_crashed", since_s)):
        return True
    for entry in journal.journaled_since(since_s):
        decision = entry.decision
        params = decision.params
        if decision.job == crash.job and params.get("pid") == crash.pid:
            return True
        if any(f.message.startswith(marker) for f in decision.findings):
            return True
    return False


class CrashHandler:
    """Takes every :class:`WorkerCrash` from the supervisor to the tick that journals it.

    ``server`` and ``journal`` return the control server and the journal once the daemon
    has opened them (None before); ``xid_evidence`` gives the Xid errors around a crash;
    ``clock``: the daemon's clock (seconds); ``logger``: structlog-style. Also filters the
    control server's job events for the tick (:meth:`take_events`).
    """

    def __init__(
        self,
        *,
        ledger: CrashLedger,
        attribution: TrialAttribution,
        managed: SupervisorActions | None,
        supervisor: Supervisor | None,
        job_names: Collection[str],
        server: Callable[[], ControlServer | None],
        journal: Callable[[], Journal | None],
        xid_evidence: Callable[[WorkerCrash], tuple[XidEvent, ...]],
        clock: Callable[[], float],
        logger: Any,
    ) -> None:
        self.ledger = ledger
        self._attribution = attribution
        self._managed = managed
        self._supervisor = supervisor
        self._job_names = frozenset(job_names)
        self._server = server
        self._journal = journal
        self._xid_evidence = xid_evidence
        self._clock = clock
        self._log = logger
        self._posted: OrderedDict[JobEvent, str] = OrderedDict()
        """Crash events this daemon posted -> their ledger key. Keyed by the (frozen,
        hashable) event itself, which the map keeps alive: an ``id()`` key could be taken
        over by a later event once the server's bounded queue dropped the posted one."""
        self._consumed: list[str] = []
        self._replayed: dict[str, WorkerCrash] = {}
        """Ledger key -> the crash :meth:`replay_ledger` finished: the supervisor may report
        the same death again (killed after the ledger write, before ``workers.json``)."""
        self._buffer: list[tuple[JobEvent, str | None]] = []

    # -- the tick's side ---------------------------------------------------------------

    def take_events(self) -> tuple[JobEvent, ...]:
        """The job events for this tick's snapshot (see :meth:`collect`).

        The ledger keys of this daemon's own crash events among them are kept until
        :meth:`journaled` (a tick whose journal write failed leaves them in the ledger).
        """
        self.collect()
        taken, self._buffer = self._buffer, []
        self._consumed = [key for _, key in taken if key is not None]
        return tuple(event for event, _ in taken)

    def journaled(self) -> None:
        """The tick that took the last events is journaled: drop their ledger entries."""
        if self._consumed:
            self.ledger.remove(self._consumed)  # a restart must not act again
            self._consumed = []

    def collect(self) -> None:
        """Move the control server's queued job events into the tick's buffer.

        On the way: the hook's ``crash`` event of a managed worker is dropped (the
        supervisor reports that death, classified, with its stderr; the hook's exception
        text goes to the classification), ``trial`` and ``detach`` events go to the
        :class:`TrialAttribution` (a ``detach`` is not passed on), and a ``trial`` event
        is the worker's progress for the supervisor's crash-loop count.
        """
        server = self._server()
        if server is None:
            return
        for event in server.drain_events():
            key = self._posted.pop(event, None)
            if key is None and event.pid is not None:
                if self._supervisor is not None and event.kind == "trial":
                    self._supervisor.note_progress(event.pid)  # a trial finished
                if self._attribution.note_event(event):
                    continue
                if event.kind == "crash" and self.is_managed(event):
                    self._log.info(
                        "hook crash report of a managed worker",
                        job=event.job,
                        pid=event.pid,
                        crash_kind=event.crash_kind,
                        message=event.message[:200],
                    )
                    continue
            self._buffer.append((event, key))

    def is_managed(self, event: JobEvent) -> bool:
        """Whether ``event`` comes from a managed worker (noting its exception text)."""
        if self._supervisor is None or self._managed is None or event.pid is None:
            return False
        text = event.message or event.crash_kind
        if self._supervisor.note_exception(event.pid, text):
            return True
        return self._managed.is_crashed_worker(event.pid)

    # -- the supervisor's side ---------------------------------------------------------

    async def on_crash(self, crash: WorkerCrash) -> None:
        """The supervisor's ``on_crash``: ledger, Optuna trial, then the tick's crash event.

        The trial the worker died in comes from the hook's last word (:meth:`settle`),
        then from the study itself (:meth:`TrialAttribution.from_study`). The ledger
        entry is written first (before any await), so a daemon killed at any later point
        finds the crash again at its next start. A worker the daemon stopped itself
        (``intentional``) has its trial failed and re-enqueued but makes no event.
        """
        key = CrashLedger.key(crash.job, crash.pid)
        replayed = self._replayed.get(key)
        if replayed is not None and not crash.intentional:
            # One death, one event: the ledger's entry was resumed at this start.
            if key in self._consumed or key in self._posted.values():
                self.ledger.add(replayed)  # its event is still on the way: keep the entry
            else:
                self.ledger.remove([key])  # journaled already: nothing pending
            self._log.info("crash.already_resumed", job=crash.job, pid=crash.pid)
            return
        self.ledger.add(crash)
        located = crash
        if not crash.intentional:
            located = await self.settle(located)
        located = await self._attribution.from_study(located)
        # After the waits above: an Xid drained meanwhile (e.g. 45, the driver's cleanup
        # of the dead process) still counts.
        located = dataclasses.replace(located, xid_events=self._xid_evidence(located))
        if located != crash:
            crash = located
            self.ledger.add(crash)
        await self._recover(crash)
        if crash.intentional:
            self.ledger.remove([key])
        else:
            self.post(crash, key)

    async def settle(self, crash: WorkerCrash) -> WorkerCrash:
        """Let the dead worker's last hook messages arrive; return ``crash`` with its trial.

        The hook flushes its trial and crash events before the process exits, but the
        exit may be noticed before the socket is read: wait (at most 1 s) until the
        worker's hook connection is gone, take the events, then read the trial.
        """
        server = self._server()
        if server is not None:
            self._attribution.observe(server.jobs())
        await self._take_last_words(crash.pid)
        trial = self._attribution.from_hook(crash)
        if trial != crash.trial_number:
            self._log.info(
                "crashed trial from the hook",
                job=crash.job,
                pid=crash.pid,
                trial=trial,
                supervisor_trial=crash.trial_number,
            )
            crash = dataclasses.replace(crash, trial_number=trial)
        return crash

    async def _take_last_words(self, pid: int) -> None:
        """Wait (at most 1 s) until ``pid``'s hook connection is gone, then take the events."""
        server = self._server()
        if server is None:
            return
        deadline = time.monotonic() + _LAST_WORDS_WAIT_S
        while time.monotonic() < deadline and any(j.pid == pid for j in server.jobs()):
            await asyncio.sleep(0.02)
        self.collect()

    async def _recover(self, crash: WorkerCrash) -> None:
        if self._managed is None:
            return
        detail = await self._managed.handle_crash(crash)
        self._log.info(
            "worker end handled",
            job=crash.job,
            worker=crash.worker,
            pid=crash.pid,
            kind=crash.crash_info.kind,
            intentional=crash.intentional,
            trial=crash.trial_number,
            study=detail,
        )

    def post(self, crash: WorkerCrash, key: str) -> None:
        """Queue ``crash``'s event for the next tick; ``key``: its ledger entry."""
        server = self._server()
        if server is None:
            return
        event = crash.to_event()
        self._posted[event] = key
        self._posted.move_to_end(event)
        while len(self._posted) > _POSTED_KEPT:
            self._posted.popitem(last=False)
        server.post_event(event)

    async def replay_ledger(self) -> int:
        """Finish the crashes a killed predecessor left in the ledger; return how many.

        Each one's Optuna recovery runs again (idempotent); its crash event is posted again
        unless the journal already holds a decision about it (then the entry is dropped:
        that decision was made, and is never made twice). Call it with the journal open
        and the control server started, before the first tick.
        """
        crashes = self.ledger.load()
        journal = self._journal()
        for crash in crashes:
            key = CrashLedger.key(crash.job, crash.pid)
            self._replayed[key] = crash
            if self._managed is not None:
                # A predecessor killed while it looked the trial up left the older number.
                crash = await self._attribution.from_study(crash)
                self._managed.remember(crash)
            await self._recover(crash)
            decided = journal is not None and crash_decided(journal, crash)
            if crash.intentional or decided or crash.job not in self._job_names:
                self.ledger.remove([key])
            else:
                self.post(crash, key)
            self._log.info(
                "pending crash resumed",
                job=crash.job,
                pid=crash.pid,
                kind=crash.crash_info.kind,
                already_decided=decided,
            )
        return len(crashes)


class SupervisorActions:
    """The :class:`ManagedJobs` backend over a :class:`~gpuwatchd.supervisor.Supervisor`.

    ``jobs``: the configured jobs (for their ``optuna:``); ``study``: the
    :class:`StudyRecovery`; ``logger``: structlog-style. The daemon passes every
    :class:`~gpuwatchd.supervisor.WorkerCrash` to :meth:`handle_crash` (its ``on_crash``),
    which remembers it (a restart decision names the crashed pid; the worker slot and
    trial come from here) and fails the dead trial at once.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        jobs: Sequence[JobConfig],
        study: StudyRecovery,
        logger: Any,
    ) -> None:
        self._supervisor = supervisor
        self._jobs = {job.name: job for job in jobs}
        self._study = study
        self._log = logger
        self._crashes: OrderedDict[tuple[str, int], WorkerCrash] = OrderedDict()
        self._busy: dict[str, int] = {}

    # -- crashes ------------------------------------------------------------------------

    def remember(self, crash: WorkerCrash) -> None:
        """Remember ``crash`` for the restart decisions that will name its pid."""
        key = (crash.job, crash.pid)
        self._crashes[key] = crash
        self._crashes.move_to_end(key)
        while len(self._crashes) > _CRASHES_KEPT:
            self._crashes.popitem(last=False)

    def crash_of(self, job: str, pid: int) -> WorkerCrash | None:
        """The remembered crash of ``job``'s worker ``pid``, if any."""
        return self._crashes.get((job, pid))

    def is_crashed_worker(self, pid: int) -> bool:
        """True when ``pid`` is a managed worker whose end the supervisor reported."""
        return any(key[1] == pid for key in self._crashes)

    async def handle_crash(self, crash: WorkerCrash) -> str:
        """Fail the Optuna trial a dead worker left behind; returns what was done (one line).

        A crash (``intentional=False``): the trial the worker ran is marked ``FAIL`` if it
        is still ``RUNNING`` (``max_retries=0``: the retry is the ``restart_study``
        policy's decision, capped by the job's ``optuna.max_retries``). A worker the
        daemon stopped itself (``intentional=True``: ``lower_parallelism`` with ``mode:
        now``, a daemon stop) or one killed from outside (:func:`killed_from_outside`):
        its trial is failed and re-enqueued up to the job's ``optuna.max_retries`` (the
        trial was not at fault; retry reason ``stopped`` or ``killed``). A trial already
        COMPLETE or PRUNED is never touched (:func:`gpuwatchd.study.fail_and_requeue`).
        When the trial number is unknown, or the trial it
        names had already ended COMPLETE or PRUNED (the worker had started a trial the
        hook had not reported yet), a stale-trial sweep is requested (needs
        ``optuna.grace_period``). Never raises: a storage error is logged and returned.
        """
        self.remember(crash)
        cfg = self._jobs.get(crash.job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured"
        optuna = cfg.optuna
        killed = killed_from_outside(crash)
        reason = "stopped" if crash.intentional else ("killed" if killed else crash.crash_info.kind)
        # Not the trial's fault (stopped by us, or killed from outside): retried up to the
        # job's optuna.max_retries now. A crash of its own: FAIL; its retry is a policy's.
        retries = optuna.max_retries if crash.intentional or killed else 0
        found_trial = False  # found the trial the worker died in
        detail = "trial unknown (the hook had not reported one)"
        if crash.trial_number is not None:
            try:
                (result,) = await self._study.fail_and_requeue(
                    optuna, [crash.trial_number], max_retries=retries, reason=reason
                )
            except (StudyError, ValueError) as exc:
                self._log.error(
                    "cannot fail the crashed worker's trial",
                    job=crash.job,
                    pid=crash.pid,
                    trial=crash.trial_number,
                    error=str(exc),
                )
                return f"study error: {exc}"
            # FAIL: Optuna failed it (the objective raised) or we did; COMPLETE, PRUNED or
            # WAITING: the worker had moved on to a trial the hook had not reported yet.
            found_trial = result.outcome not in ("not_running", "not_found")
            detail = describe_requeue(result, retries)
            outcome: str = result.outcome
            if retries == 0 and result.outcome == "retries_exhausted":
                # Nothing was tried: no "retries exhausted" after zero retries.
                outcome = "failed" if result.failed_now else "was_failed"
                detail = f"trial {result.trial_number}" + (
                    " marked FAIL" if result.failed_now else " is FAIL"
                )
            self._log.info(
                "crashed worker's trial recovered",
                job=crash.job,
                pid=crash.pid,
                worker=crash.worker,
                trial=crash.trial_number,
                outcome=outcome,
                requeued_as=result.requeued_as,
                detail=detail,
            )
        if not found_trial:
            if self._study.request_sweep(crash.job, optuna):
                detail += f"; stale-trial sweep in {optuna.grace_period_s} s"
            elif crash.trial_number is None:
                self._log.warning(
                    "crashed worker's trial unknown and no heartbeats configured; "
                    "a trial may stay RUNNING (set optuna.grace_period)",
                    job=crash.job,
                    pid=crash.pid,
                    worker=crash.worker,
                )
        return detail

    # -- ManagedJobs ----------------------------------------------------------------------

    def busy(self, job: str) -> bool:
        """Whether a parallelism change of ``job`` is in flight (e.g. waiting for a drain)."""
        return self._busy.get(job, 0) > 0

    async def set_parallelism(self, job: str, to: int, mode: str) -> str:
        """``supervisor.set_parallelism(job, to, mode)``; returns ``"parallelism A -> B"``.

        With ``mode="drain"`` it returns once the drained worker's hook has acknowledged
        (its trial finished); raises :class:`~gpuwatchd.errors.SupervisorError` for an
        unknown job or a bad value.
        """
        before = self._supervisor.parallelism(job)
        self._busy[job] = self._busy.get(job, 0) + 1
        try:
            await self._supervisor.set_parallelism(job, to, mode)
        finally:
            self._busy[job] -= 1
        return f"parallelism {before} -> {to} ({mode})"

    async def place_next(self, job: str, gpu_index: int) -> str:
        """``supervisor.place_next(job, gpu_index)``."""
        self._supervisor.place_next(job, gpu_index)
        return f"next worker start of {job} goes to GPU {gpu_index}"

    def _slot(self, decision: Decision) -> tuple[str, int, WorkerCrash | None]:
        params = decision.params
        job = str(params.get("job") or decision.job or "")
        pid = params.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise ActionRefused("the decision names no crashed pid")
        return job, pid, self.crash_of(job, pid)

    def _relaunch(self, job: str, pid: int, crash: WorkerCrash | None) -> str:
        """Where the crashed worker's relaunch stands; ActionRefused when there is none."""
        if crash is None:
            raise ActionRefused(f"no crash of {job} pid {pid} is known to this daemon")
        slot = next((w for w in self._supervisor.workers(job) if w.worker == crash.worker), None)
        return _relaunch_text(crash, slot)

    async def restart_worker(self, decision: Decision) -> str:
        """Report the relaunch of the crashed worker the decision names (class docstring)."""
        job, pid, crash = self._slot(decision)
        return self._relaunch(job, pid, crash)

    async def restart_study(self, decision: Decision) -> str:
        """Fail and re-enqueue the crashed worker's trial, then as :meth:`restart_worker`.

        The relaunch part never makes the outcome fail: a worker the supervisor will not
        relaunch is named in the detail (``applied`` because the study part was done).
        """
        job, pid, crash = self._slot(decision)
        parts = [await self._requeue(decision, job, crash)]
        try:
            parts.append(self._relaunch(job, pid, crash))
        except ActionRefused as exc:
            parts.append(f"worker not relaunched: {exc.message}")
        return "; ".join(parts)

    async def resume_restart_study(self, decision: Decision) -> str:
        """The study part of a ``restart_study`` a killed daemon left unfinished.

        Its journal outcome is ``unknown``: the trial may or may not have been
        re-enqueued. :func:`gpuwatchd.study.fail_and_requeue` is idempotent (a retry of
        the trial is looked up before one is enqueued), so running it again finishes the
        decision without repeating it. The worker was relaunched by the supervisor
        meanwhile. Raises StudyError, ValueError or ActionRefused as :meth:`restart_study`.
        """
        job, _pid, crash = self._slot(decision)
        return await self._requeue(decision, job, crash)

    async def _requeue(self, decision: Decision, job: str, crash: WorkerCrash | None) -> str:
        params = decision.params
        trial = params.get("trial_number")
        if not isinstance(trial, int) or isinstance(trial, bool):
            trial = crash.trial_number if crash is not None else None
        cfg = self._jobs.get(job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured for the job"
        max_retries = effective_max_retries(cfg.optuna.max_retries, params.get("max_retries"))
        if trial is None:
            swept = self._study.request_sweep(job, cfg.optuna)
            return (
                "trial unknown; stale-trial sweep requested"
                if swept
                else "trial unknown and no optuna.grace_period: nothing failed"
            )
        kind = str(params.get("crash_kind") or "other")
        (result,) = await self._study.fail_and_requeue(
            cfg.optuna, [trial], max_retries=max_retries, reason=kind
        )
        return describe_requeue(result, max_retries)


def effective_max_retries(job_max_retries: int, action_max_retries: object) -> int:
    """The retries a ``restart_study`` decision may make: the job's ``optuna.max_retries``
    caps them; the action's ``max_retries`` (when an integer >= 0) may only lower them
    (docs/managed-jobs.md, "Retries"; ``gpuwatchd check-config`` reports a difference)."""
    if (
        isinstance(action_max_retries, bool)
        or not isinstance(action_max_retries, int)
        or action_max_retries < 0
    ):
        return job_max_retries
    return min(job_max_retries, action_max_retries)


def _relaunch_text(crash: WorkerCrash, slot: WorkerInfo | None) -> str:
    where = f"worker {crash.worker}"
    if slot is None:
        return f"{where} was removed (parallelism lowered): nothing to relaunch"
    if slot.state == "backoff":
        delay = ""
        if slot.next_start_at_s is not None:
            delay = f" at {time.strftime('%H:%M:%S', time.localtime(slot.next_start_at_s))}"
        return f"{where} relaunch scheduled by the supervisor{delay} (restart: backoff)"
    if slot.pid is not None and slot.pid != crash.pid and slot.state in ("running", "draining"):
        gpu = "no GPU" if slot.gpu_index is None else f"GPU {slot.gpu_index}"
        return f"{where} relaunched as pid {slot.pid} on {gpu}"
    if slot.state in ("stopped", "failed"):
        raise ActionRefused(f"{where} is {slot.state}: {slot.note or 'not restarted'}")
    return f"{where} is {slot.state}"
