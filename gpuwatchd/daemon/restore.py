"""The daemon's journal: open, restore the engine, write each tick ahead, close, prune.

At start the journal closes what a killed predecessor left open and restores the policy
engine's cooldowns, rate limits and ladders from the decisions within the restore
horizon; ``restart_study`` decisions left ``unknown`` are finished here too.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Final

from gpuwatchd.actuators import DecisionRecord
from gpuwatchd.config import Settings
from gpuwatchd.control.knobmemory import OPERATOR, KnobMemory, policy_source
from gpuwatchd.cordon import RESUME_WINDOW_S
from gpuwatchd.errors import JournalError
from gpuwatchd.jobs.actions import SupervisorActions
from gpuwatchd.journal import JOURNAL_FILENAME, Journal, Outcome
from gpuwatchd.metrics.account import MetricsAccount
from gpuwatchd.model import Decision, Finding
from gpuwatchd.policy import action_names
from gpuwatchd.policy.engine import LADDER_ACTIONS, PolicyEngine
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.schema import PolicySet

__all__ = ["PRUNE_EVERY_S", "JournalKeeper", "restore_horizon_s"]

PRUNE_EVERY_S: Final = 86400.0
"""The journal is pruned at start and then once a day."""


def restore_horizon_s(policies: PolicySet) -> float:
    """How far back (seconds) decisions matter to the engine's state: the longest window.

    The longest ``cooldown`` or rate-limit period (``limit: {max, per}``) of the
    ``policies``; ladder positions come from the latest ladder decision whatever its age
    (:meth:`Journal.decisions_since`).
    """
    horizon = 0.0
    for policy in policies.policies:
        horizon = max(horizon, policy.cooldown_s)
        if policy.limit is not None:
            horizon = max(horizon, policy.limit.per_s)
    return horizon


class JournalKeeper:
    """Owns the daemon's :class:`~gpuwatchd.journal.Journal` (``journal`` is None until open).

    ``decisions``: the recent decisions ``status`` shows (refilled at open); ``clock``:
    the daemon's clock (seconds); ``logger``: structlog-style; ``account``: the metrics'
    counts, given each decision once its outcome is known.
    """

    def __init__(
        self,
        settings: Settings,
        engine: PolicyEngine,
        decisions: deque[DecisionRecord],
        clock: Callable[[], float],
        logger: Any,
        *,
        account: MetricsAccount,
    ) -> None:
        self._settings = settings
        self._account = account
        self._engine = engine
        self._decisions = decisions
        self._clock = clock
        self._log = logger
        self.journal: Journal | None = None
        self.error: str | None = None
        self.failed_writes = 0
        self.restored = 0

    def open(self) -> Journal:
        """Open ``<state_dir>/journal.sqlite3`` and continue where the last daemon stopped.

        Moves a corrupt journal aside (logged as an error) and starts a new one; closes
        findings and pending decisions a killed daemon left open; prunes old rows;
        restores the engine from the decisions within :func:`restore_horizon_s`; refills
        the recent decisions. Raises :class:`JournalError` when the journal cannot be
        opened (the daemon refuses to start).
        """
        path = Path(self._settings.state_dir) / JOURNAL_FILENAME
        now = self._clock()
        try:
            journal = Journal.open(path, retention_s=self._settings.journal_retention_s, now_s=now)
        except JournalError as exc:
            self._log.error("cannot open the journal", path=str(path), error=str(exc))
            raise
        if journal.moved_aside is not None:
            self._log.error(
                "journal was corrupt; moved it aside and started a new one",
                path=str(path),
                moved_to=str(journal.moved_aside),
            )
        with contextlib.ExitStack() as on_error:
            on_error.callback(journal.close)
            recovery = journal.recover(now)
            pruned = journal.prune(now)
            horizon_s = restore_horizon_s(self._engine.policies)
            journaled = journal.journaled_since(now - horizon_s, latest_of=LADDER_ACTIONS)
            decisions = [entry.decision for entry in journaled]
            self._engine.restore(decisions)
            for entry in journaled:  # a refused ladder move did not move the ladder
                if entry.outcome == "refused":
                    self._engine.refused(entry.decision)
            recent = journal.recent_decisions(self._decisions.maxlen or 0)
            on_error.pop_all()  # restored: the journal stays open
        self.restored = len(decisions)
        for entry in recent:
            self._decisions.append(
                DecisionRecord(
                    entry.decision,
                    entry.outcome,
                    entry.detail,
                    entry.finished_s,
                    journal_id=entry.id,
                )
            )
        self.journal = journal
        self._log.info(
            "journal opened",
            path=str(path),
            restored_decisions=len(decisions),
            horizon_s=horizon_s,
            findings_closed=recovery.findings_closed,
            outcomes_unknown=recovery.decisions_unknown,
            pruned_events=pruned,
        )
        return journal

    def close(self) -> None:
        """Close the open findings and pending outcomes in the journal, then the journal.

        Idempotent. A failure is logged, not raised.
        """
        journal, self.journal = self.journal, None
        if journal is None:
            return
        try:
            journal.recover(self._clock())
        except JournalError as exc:
            self._log.error("journal: cannot close open findings at stop", error=str(exc))
        finally:
            journal.close()

    async def prune_job(self) -> None:
        """:meth:`prune` as a coroutine (APScheduler runs it on the loop's thread)."""
        self.prune()

    def prune(self) -> None:
        """Delete journal rows older than the retention (daily job; errors are logged)."""
        if self.journal is None:
            return
        try:
            pruned = self.journal.prune(self._clock())
        except JournalError as exc:
            self._log.error("journal prune failed", error=str(exc))
            return
        self._log.info("journal pruned", pruned_events=pruned)

    def record_tick(
        self, now_s: float, findings: Sequence[Finding], records: Sequence[DecisionRecord]
    ) -> bool:
        """Write-ahead: journal the tick; False (decisions marked failed) when that failed.

        True without a journal (nothing to write to: ``tick`` outside :meth:`run`).
        """
        try:
            return self._record_tick(now_s, findings, records)
        finally:
            for record in records:
                if record.outcome != "pending":
                    self._decided(record)

    def _decided(self, record: DecisionRecord) -> None:
        if record.outcome != "pending":
            decision = record.decision
            self._account.decided(decision.policy, decision.action, record.outcome)

    def _record_tick(
        self, now_s: float, findings: Sequence[Finding], records: Sequence[DecisionRecord]
    ) -> bool:
        if self.journal is None:
            return True
        outcomes = [
            None if r.outcome == "pending" else Outcome(r.outcome, r.detail, r.finished_at_s)
            for r in records
        ]
        try:
            ids = self.journal.record_tick(now_s, findings, [r.decision for r in records], outcomes)
        except JournalError as exc:
            self.failed_writes += 1
            self.error = str(exc)
            self._log.error(
                "journal write failed; this tick's decisions are not carried out",
                error=str(exc),
                decisions=[f"{r.decision.policy}/{r.decision.action}" for r in records],
            )
            for record in records:
                record.outcome = "failed"
                record.detail = f"not carried out: journal write failed: {exc}"
                record.finished_at_s = now_s
            return False
        self.error = None
        for record, decision_id in zip(records, ids, strict=True):
            record.journal_id = decision_id
        return True

    def record_decision(self, decision: Decision) -> DecisionRecord:
        """Journal a decision made outside a tick (an operator's knob request) as
        ``pending`` and show it in ``status``; returns its record (``journal_id`` set).
        A journal failure is logged and counted; the request goes on."""
        record = DecisionRecord(decision, "pending")
        self._decisions.append(record)
        if self.journal is None:
            return record
        try:
            record.journal_id = self.journal.record_decision(decision)
        except JournalError as exc:
            self.failed_writes += 1
            self.error = str(exc)
            self._log.error("journal write failed; decision not recorded", error=str(exc))
        return record

    def knob_memory(self) -> KnobMemory:
        """The knob values jobs applied, rebuilt from the journal's applied ``set_knob``
        decisions (source ``operator`` or ``policy <name>``); empty without a journal."""
        memory = KnobMemory()
        if self.journal is None:
            return memory
        try:
            rows = self.journal.applied_knobs()
        except JournalError as exc:
            self._log.error("journal read failed; knob values not restored", error=str(exc))
            return memory
        memory.restore(
            (job, knob, value, policy if policy == OPERATOR else policy_source(policy), at_s)
            for job, knob, value, policy, at_s in rows
        )
        return memory

    def restore_holds(self, holds: KnobHolds) -> None:
        """Put back the operator holds still in force: from the journal's applied
        ``set_knob`` decisions of policy ``operator`` (their ``hold_s`` and ``by_uid``,
        from the request's time on). Nothing without a journal; a read error is logged."""
        if self.journal is None:
            return
        try:
            rows = self.journal.operator_knobs()
        except JournalError as exc:
            self._log.error("journal.holds_read_failed", error=str(exc))
            return
        holds.restore(rows)

    def on_outcome(self, record: DecisionRecord) -> None:
        """The actuator's callback for a late outcome (a job acknowledging ``set_knob``);
        a refused ladder move leaves the engine's ladder where it was."""
        self._decided(record)
        if record.outcome == "refused":
            self._engine.refused(record.decision)
        if self.journal is None or record.journal_id is None:
            return
        try:
            self.journal.record_outcome(
                record.journal_id, record.outcome, record.detail, record.finished_at_s
            )
        except (JournalError, KeyError) as exc:
            self.failed_writes += 1
            self.error = str(exc)
            self._log.error(
                "journal write failed; outcome not recorded",
                decision_id=record.journal_id,
                outcome=record.outcome,
                error=str(exc),
            )

    def report(self) -> dict[str, Any]:
        """``status``'s ``journal`` object."""
        return {
            "path": str(self.journal.path) if self.journal is not None else None,
            "restored_decisions": self.restored,
            "failed_writes": self.failed_writes,
            "error": self.error,
            "retention_s": self._settings.journal_retention_s,
            "replaced": self._replaced(),
        }

    def _replaced(self) -> dict[str, Any] | None:
        """When this start found the journal corrupt: where the old one is, and the event
        id the new ids continue after; else None."""
        journal = self.journal
        if journal is None or journal.moved_aside is None:
            return None
        return {
            "reason": "corrupt",
            "moved_to": str(journal.moved_aside),
            "ids_continue_after": journal.ids_continue_after,
        }

    async def resume_interrupted(
        self, managed: SupervisorActions | None, job_names: Collection[str]
    ) -> int:
        """Finish the ``restart_study`` decisions a killed predecessor left ``unknown``.

        A decision is journaled (``pending``) before it is carried out; a daemon killed
        in between leaves it ``unknown`` (:meth:`Journal.recover`), and the crash it was
        about has left the crash ledger. Re-enqueueing a trial is idempotent, so the
        study part runs again (:meth:`SupervisorActions.resume_restart_study`) and the
        decision gets its real outcome, with ``resumed after a daemon restart`` in the
        detail; no decision is made twice. Returns how many were resumed.
        """
        journal = self.journal
        if journal is None or managed is None:
            return 0
        since = self._clock() - RESUME_WINDOW_S
        resumed = 0
        for entry in journal.journaled_since(since):
            decision = entry.decision
            if entry.outcome != "unknown" or decision.action != action_names.RESTART_STUDY:
                continue
            if decision.dry_run:
                continue
            if self._settings.dry_run:  # left unknown for a daemon that acts
                self._log.info("interrupted decision not resumed (dry run)", decision_id=entry.id)
                continue
            if decision.job not in job_names:
                detail, outcome = f"job {decision.job!r} is no longer configured", "refused"
            else:
                try:
                    detail = await managed.resume_restart_study(decision)
                    outcome = "applied"
                except Exception as exc:  # one bad decision must not stop the daemon's start
                    detail, outcome = f"{type(exc).__name__}: {exc}", "failed"
            detail = f"resumed after a daemon restart: {detail}"
            try:
                journal.record_outcome(entry.id, outcome, detail, self._clock())
            except Exception as exc:
                self._log.error(
                    "cannot record a resumed outcome", decision_id=entry.id, error=str(exc)
                )
            resumed += 1
            self._log.info(
                "interrupted decision resumed",
                decision_id=entry.id,
                action=decision.action,
                job=decision.job,
                outcome=outcome,
                detail=detail,
            )
        return resumed
