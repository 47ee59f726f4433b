"""Optuna study recovery off the event loop: one storage operation at a time per storage URL.

Two recoveries of one dead trial therefore never race each other into two retries. The
storage calls run on daemon threads: one hung on a silent server cannot hold the exit.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from gpuwatchd.config import OptunaConfig
from gpuwatchd.errors import StudyError
from gpuwatchd.jobs.study import redact_url

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.jobs.study import RequeueResult, RunningTrial, WorkerTrials

__all__ = ["StudyRecovery", "call_in_daemon_thread", "describe_requeue"]

_T = TypeVar("_T")

_STALE_SWEEP_MARGIN_S: Final = 1.0
"""A stale-trial sweep runs this long after the grace period, so the dead worker's last
heartbeat is older than the grace period by then."""


def call_in_daemon_thread(
    function: Callable[..., _T], /, *args: Any, name: str, **kwargs: Any
) -> asyncio.Future[_T]:
    """``function(*args, **kwargs)`` on a new daemon thread ``name``; its result or exception
    into the returned future of the running loop.

    Unlike ``asyncio.to_thread`` (the default executor, whose threads ``asyncio.run`` joins
    at exit), a call that never returns (a storage server that accepts and stays silent:
    ``psycopg2.connect`` has no default ``connect_timeout``) cannot hold the daemon's exit.
    Cancelling the future abandons the call: the thread runs on and its answer is dropped.
    Must run on the event loop (RuntimeError otherwise).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(outcome: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile: the answer came too late
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)

    def run() -> None:
        outcome, error = None, None
        try:
            outcome = function(*args, **kwargs)
        except Exception as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, outcome, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            return

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class StudyRecovery:
    """Runs :mod:`gpuwatchd.jobs.study` recoveries in threads, one at a time per storage URL.

    :meth:`fail_and_requeue` for trials whose number is known; :meth:`request_sweep` for a
    crashed worker whose trial is unknown: when the job's ``optuna.grace_period`` is set
    (its workers record heartbeats), :func:`gpuwatchd.jobs.study.fail_stale_trials` runs once
    the dead worker's last heartbeat is older than the grace period (a grace period and a
    second after the request; requests meanwhile are folded into one later sweep).
    ``logger``: a structlog-style logger. :meth:`close` cancels pending sweeps.

    Each storage call runs on a daemon thread (:func:`call_in_daemon_thread`); a caller
    cancelled while it is under way (the crash handling's deadline, the daemon's stop
    budget) abandons it and logs ``study.call_abandoned`` naming it; what it would have
    done is left to the next start's recovery (crash ledger, interrupted decisions).
    """

    def __init__(self, logger: Any) -> None:
        self._log = logger
        self._locks: dict[str, asyncio.Lock] = {}
        self._sweep_due: dict[str, float] = {}
        self._sweeps: dict[str, asyncio.Task[None]] = {}

    async def _call(
        self, optuna: OptunaConfig, function: Callable[..., _T], *args: Any, **kwargs: Any
    ) -> _T:
        """``function(optuna.storage, optuna.study, *args, **kwargs)`` on a daemon thread,
        serialised per storage; its exceptions propagate."""
        async with self._lock(optuna.storage):
            call = call_in_daemon_thread(
                function, optuna.storage, optuna.study, *args, name="gpuwatchd-study", **kwargs
            )
            try:
                return await call
            except asyncio.CancelledError:
                self._log.warning(
                    "study.call_abandoned",
                    call=getattr(function, "__name__", repr(function)),
                    study=optuna.study,
                    storage=redact_url(optuna.storage),
                )
                raise

    def _lock(self, storage: str) -> asyncio.Lock:
        lock = self._locks.get(storage)
        if lock is None:
            lock = self._locks[storage] = asyncio.Lock()
        return lock

    async def fail_and_requeue(
        self, optuna: OptunaConfig, trials: Sequence[int], *, max_retries: int, reason: str
    ) -> list[RequeueResult]:
        """:func:`gpuwatchd.jobs.study.fail_and_requeue` on a daemon thread, serialised per storage.

        Raises :class:`~gpuwatchd.errors.StudyError` (storage or study unusable) and
        ValueError for a negative ``max_retries``.
        """
        from gpuwatchd.jobs.study import fail_and_requeue

        return await self._call(
            optuna, fail_and_requeue, list(trials), max_retries=max_retries, reason=reason
        )

    async def trials_of_worker(self, optuna: OptunaConfig, worker_id: str) -> WorkerTrials | None:
        """:func:`gpuwatchd.jobs.study.trials_of_worker` on a daemon thread; raises
        StudyError likewise."""
        from gpuwatchd.jobs.study import trials_of_worker

        return await self._call(optuna, trials_of_worker, worker_id)

    async def abandon_waiting_retries(self, optuna: OptunaConfig, reason: str) -> list[int]:
        """:func:`gpuwatchd.jobs.study.abandon_waiting_retries` on a daemon thread (StudyError)."""
        from gpuwatchd.jobs.study import abandon_waiting_retries

        return await self._call(optuna, abandon_waiting_retries, reason=reason)

    async def running_trials(
        self, optuna: OptunaConfig, tz: datetime.tzinfo | None = None
    ) -> list[RunningTrial]:
        """:func:`gpuwatchd.jobs.study.running_trials` on a daemon thread (``tz``: the workers'
        time zone, None for the daemon's); raises StudyError likewise."""
        from gpuwatchd.jobs.study import running_trials

        return await self._call(optuna, running_trials, tz)

    async def fail_stale(self, job: str, optuna: OptunaConfig) -> list[RequeueResult]:
        """:func:`gpuwatchd.jobs.study.fail_stale_trials` now (``optuna.grace_period`` must be set).

        Retries get ``optuna.max_retries``; raises StudyError like :meth:`fail_and_requeue`.
        """
        from gpuwatchd.jobs.study import fail_stale_trials

        if optuna.grace_period_s is None:
            raise StudyError(f"job {job!r}: optuna.grace_period is not set (no heartbeats)")
        return await self._call(
            optuna,
            fail_stale_trials,
            max_retries=optuna.max_retries,
            grace_period_s=optuna.grace_period_s,
        )

    def request_sweep(self, job: str, optuna: OptunaConfig) -> bool:
        """Schedule a stale-trial sweep for ``job`` (see the class docstring).

        Returns False (and does nothing) when the job has no ``optuna.grace_period``.
        Must run on the event loop.
        """
        grace = optuna.grace_period_s
        if grace is None:
            return False
        due = time.monotonic() + grace + _STALE_SWEEP_MARGIN_S
        self._sweep_due[job] = max(due, self._sweep_due.get(job, 0.0))
        task = self._sweeps.get(job)
        if task is None or task.done():
            self._sweeps[job] = asyncio.get_running_loop().create_task(
                self._sweep_loop(job, optuna), name=f"gpuwatchd-sweep-{job}"
            )
        return True

    async def _sweep_loop(self, job: str, optuna: OptunaConfig) -> None:
        while True:
            due = self._sweep_due.get(job, 0.0)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            started = time.monotonic()
            try:
                results = await self.fail_stale(job, optuna)
            except Exception as exc:
                self._log.error(
                    "stale trial sweep failed", job=job, error=f"{type(exc).__name__}: {exc}"
                )
            else:
                for result in results:
                    self._log.warning(
                        "stale trial failed",
                        job=job,
                        trial=result.trial_number,
                        outcome=result.outcome,
                        requeued_as=result.requeued_as,
                        retry=result.retry,
                    )
                if not results:
                    self._log.info("stale trial sweep: none stale", job=job)
            if self._sweep_due.get(job, 0.0) <= started:
                self._sweep_due.pop(job, None)
                return

    async def close(self) -> None:
        """Cancel the pending sweeps."""
        tasks = [t for t in self._sweeps.values() if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._sweeps.clear()


def describe_requeue(result: RequeueResult, max_retries: int) -> str:
    """One phrase for a :class:`~gpuwatchd.jobs.study.RequeueResult` (logs and outcome details)."""
    n = result.trial_number
    failed = " marked FAIL," if result.failed_now else ""
    if result.outcome == "requeued":
        return (
            f"trial {n}{failed} re-enqueued as trial {result.requeued_as} "
            f"(retry {result.retry}/{max_retries})"
        )
    if result.outcome == "already_requeued":
        by = " by Optuna's RetryFailedTrialCallback" if result.retried_by == "optuna" else ""
        return f"trial {n}{failed} already re-enqueued as trial {result.requeued_as}{by}"
    if result.outcome == "retries_exhausted" and max_retries == 0:
        return f"trial {n}{failed} not re-enqueued (max_retries: 0)"
    if result.outcome == "retries_exhausted":
        return f"trial {n}{failed} not re-enqueued: its chain has {max_retries} retries"
    if result.outcome == "not_running":
        return f"trial {n} was {result.state_before}: left alone"
    return f"trial {n}: no such trial in the study"
