"""Requests to drain a worker: the supervisor asks, the job runner answers through the
control server (the hook's ``drain`` op; docs/managed-jobs.md, "How a crash travels").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["DrainRequest", "DrainRequests"]


@dataclass(eq=False, slots=True)
class DrainRequest:
    """One request: the hook of ``pid`` (a worker of managed job ``job``) should finish its
    trial and exit; ``answer`` is set to whether the hook acknowledged."""

    job: str
    pid: int
    answer: asyncio.Future[bool] = field(repr=False)


class DrainRequests:
    """The queue between the :class:`~gpuwatchd.jobs.supervisor.Supervisor`, which asks
    (:meth:`ask`), and whoever answers (:meth:`serve`: the daemon's
    :class:`~gpuwatchd.jobs.runner.JobRunner` while it runs).

    Nobody serving means nobody can ask a hook: :meth:`ask` answers False at once and the
    supervisor falls back to SIGTERM. Requests still open when the server stops are
    answered False.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[DrainRequest] = asyncio.Queue()
        self._serving = False

    @property
    def served(self) -> bool:
        """Whether a :meth:`serve` loop answers requests now."""
        return self._serving

    async def ask(self, job: str, pid: int) -> bool:
        """Ask for ``pid``'s drain; True once its hook acknowledged (it may wait for as long
        as the server's answer takes: hours, while a trial finishes)."""
        if not self._serving:
            return False
        request = DrainRequest(job, pid, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(request)
        return await request.answer

    async def serve(self, answer: Callable[[str, int], Awaitable[bool]]) -> None:
        """Answer each request with ``answer(job, pid)`` (each in its own task: one slow
        hook never holds up another's drain) until cancelled; an exception is a False
        answer. On the way out every open request is answered False."""
        self._serving = True
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                request = await self._queue.get()
                task = asyncio.ensure_future(self._answer(request, answer))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            self._serving = False
            for task in tasks:
                task.cancel()
            while not self._queue.empty():
                _settle(self._queue.get_nowait().answer, False)

    @staticmethod
    async def _answer(
        request: DrainRequest, answer: Callable[[str, int], Awaitable[bool]]
    ) -> None:
        accepted = False
        try:
            accepted = bool(await answer(request.job, request.pid))
        except asyncio.CancelledError:
            raise
        except Exception:  # the asker logs the refusal; a failure is a "no"
            accepted = False
        finally:
            _settle(request.answer, accepted)


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    with contextlib.suppress(asyncio.InvalidStateError):
        if not future.done():
            future.set_result(value)
