"""Worker crashes: from the supervisor's crash event to the tick's ``crash`` job event, and
ledger replay.

The daemon's tick takes the supervisor's :class:`~gpuwatchd.jobs.records.WorkerCrash`
events and hands each to :meth:`CrashHandler.handle`, which settles which trials the
worker held (:mod:`gpuwatchd.jobs.attribution`), fails them (:mod:`gpuwatchd.jobs.actions`,
the actuator's managed-job backend), and posts the crash event for the next tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpuwatchd.jobs.actions import SupervisorActions
from gpuwatchd.jobs.attribution import TrialAttribution
from gpuwatchd.jobs.ledger import CrashLedger
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.journal import Journal
from gpuwatchd.model import JobEvent
from gpuwatchd.xid import XidEvent

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.control.server import ControlServer

__all__ = [
    "HANDLE_TIMEOUT_S",
    "STOP_HANDLING_TIMEOUT_S",
    "CrashHandler",
    "JournalHolder",
    "XidEvidence",
    "crash_decided",
]

_LAST_WORDS_WAIT_S: Final = 1.0
"""How long a dead worker's hook connection may take to close (its last events)."""
HANDLE_TIMEOUT_S: Final = 60.0
"""How long the handling of one crash (:meth:`CrashHandler.on_crash`) may take."""
STOP_HANDLING_TIMEOUT_S: Final = 15.0
"""At the daemon's stop, how long it waits in all for the crash handling in progress
(:meth:`CrashHandler.finish`) before abandoning it. systemd/gpuwatchd.service's
TimeoutStopSec=60s leaves 30 s for the workers' stop (a 20-s drain, then the 10-s
``restart.stop_timeout`` by default) before this; the rest for closing the storages,
the journal and the socket."""


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


class JournalHolder(Protocol):
    """What holds the daemon's journal (:class:`gpuwatchd.daemon.restore.JournalKeeper`):
    ``journal`` is None until the daemon opened it."""

    @property
    def journal(self) -> Journal | None: ...


class XidEvidence(Protocol):
    """What gives a crash's Xid errors (:class:`gpuwatchd.daemon.xids.XidWatch`)."""

    def evidence(self, crash: WorkerCrash) -> tuple[XidEvent, ...]: ...


class CrashHandler:
    """Takes every :class:`WorkerCrash` from the supervisor to the tick that journals it.

    ``server``: the control server (its job events, its attached hooks); ``journals``:
    what holds the daemon's journal (its ``journal`` is None until opened); ``xids``:
    gives the Xid errors around a crash;
    ``clock``: the daemon's clock (seconds); ``logger``: structlog-style. Also filters the
    control server's job events for the tick (:meth:`take_events`). What is known about
    each crash (pending, posted, consumed, replayed) is the ``ledger``'s, asked here.
    """

    def __init__(
        self,
        *,
        ledger: CrashLedger,
        attribution: TrialAttribution,
        managed: SupervisorActions | None,
        supervisor: Supervisor | None,
        job_names: Collection[str],
        server: ControlServer,
        journals: JournalHolder,
        xids: XidEvidence,
        clock: Callable[[], float],
        logger: Any,
    ) -> None:
        self.ledger = ledger
        self._attribution = attribution
        self._managed = managed
        self._supervisor = supervisor
        self._job_names = frozenset(job_names)
        self._server = server
        self._journals = journals
        self._xids = xids
        self._clock = clock
        self._log = logger
        self._buffer: list[tuple[JobEvent, str | None]] = []
        self._handling: set[asyncio.Task[None]] = set()

    # -- the tick's side ---------------------------------------------------------------

    def take_events(self) -> tuple[JobEvent, ...]:
        """The job events for this tick's snapshot (see :meth:`collect`).

        The ledger keys of this daemon's own crash events among them are kept until
        :meth:`journaled` (a tick whose journal write failed leaves them in the ledger).
        """
        self.collect()
        taken, self._buffer = self._buffer, []
        self.ledger.consume([key for _, key in taken if key is not None])
        return tuple(event for event, _ in taken)

    def journaled(self) -> None:
        """The tick that took the last events is journaled: drop their ledger entries."""
        self.ledger.journaled()

    def collect(self) -> None:
        """Move the control server's queued job events into the tick's buffer.

        On the way: the hook's ``crash`` event of a managed worker is dropped (the
        supervisor reports that death, classified, with its stderr; the hook's exception
        text goes to the classification), ``trial`` and ``detach`` events go to the
        :class:`TrialAttribution` (a ``detach`` is not passed on), and a ``trial`` event
        is the worker's progress for the supervisor's crash-loop count.
        """
        for event in self._server.drain_events():
            key = self.ledger.claim_posted(event)
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
        return self.ledger.is_crashed_worker(event.pid)

    # -- the supervisor's crash events ---------------------------------------------------

    def handle(self, crash: WorkerCrash) -> None:
        """Start handling one of the supervisor's crash events (:meth:`on_crash`, at most
        :data:`HANDLE_TIMEOUT_S`) on the running loop; the daemon's tick calls it for each
        event it takes. Its failure is logged (``crash.handling_failed``); the crash stays
        in the ledger for the next start. Without a running loop (a tick outside one) the
        crash is left to the ledger as well."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._log.error("crash.not_handled", job=crash.job, pid=crash.pid)
            self.ledger.handled(CrashLedger.key(crash.job, crash.pid))
            return
        task = loop.create_task(self._handle(crash), name=f"gpuwatchd-crash-{crash.pid}")
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def finish(self, timeout_s: float | None = None) -> None:
        """Wait for the crash handling in progress: the daemon's start, before its first
        tick, and its stop, before the study storages close (the trials of the workers
        it stopped are failed and re-enqueued). ``timeout_s`` (the stop:
        :data:`STOP_HANDLING_TIMEOUT_S`): seconds to wait in all, None for as long as it
        takes; then the handling still in progress is cancelled and logged
        ``crash.handling_abandoned`` (its storage call ``study.call_abandoned``); its
        crashes stay in the ledger for the next start's recovery."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while pending := [task for task in self._handling if not task.done()]:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait(pending, timeout=left)
            if deadline is not None and loop.time() >= deadline:
                break
        for task in pending:
            if not task.done():
                task.cancel()
                self._log.warning(
                    "crash.handling_abandoned", task=task.get_name(), timeout_s=timeout_s
                )
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _handle(self, crash: WorkerCrash) -> None:
        try:
            await asyncio.wait_for(self.on_crash(crash), HANDLE_TIMEOUT_S)
        except Exception as exc:  # one crash's trouble must not stop the next
            self._log.error(
                "crash.handling_failed",
                job=crash.job,
                worker=crash.worker,
                pid=crash.pid,
                error=f"{type(exc).__name__}: {exc}",
            )
        finally:
            self.ledger.handled(CrashLedger.key(crash.job, crash.pid))

    async def on_crash(self, crash: WorkerCrash) -> None:
        """Handle one crash event: ledger, Optuna trial, then the tick's crash event.

        The trial the worker died in comes from the hook's last word (:meth:`settle`),
        then from the study itself (:meth:`TrialAttribution.from_study`). The ledger
        entry is written first (before any await), so a daemon killed at any later point
        finds the crash again at its next start. A worker the daemon stopped itself
        (``intentional``) has its trial failed and re-enqueued but makes no event.
        """
        key = CrashLedger.key(crash.job, crash.pid)
        replayed = self.ledger.replayed(key)
        if replayed is not None and not crash.intentional:
            # One death, one event: the ledger's entry was resumed at this start.
            if self.ledger.in_flight(key):
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
        located = dataclasses.replace(located, xid_events=self._xids.evidence(located))
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
        self._attribution.observe(self._server.jobs())
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
        server = self._server
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
        event = crash.to_event()
        self.ledger.note_posted(event, key)
        self._server.post_event(event)

    async def replay_ledger(self) -> int:
        """Finish the crashes a killed predecessor left in the ledger; return how many.

        Each one's Optuna recovery runs again (idempotent); its crash event is posted again
        unless the journal already holds a decision about it (then the entry is dropped:
        that decision was made, and is never made twice). Call it with the journal open
        and the control server started, before the first tick.
        """
        crashes = self.ledger.load()
        journal = self._journals.journal
        for crash in crashes:
            key = CrashLedger.key(crash.job, crash.pid)
            self.ledger.note_replayed(crash)
            if self._managed is not None:
                # A predecessor killed while it looked the trial up left the older number.
                crash = await self._attribution.from_study(crash)
                self.ledger.remember(crash)
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
