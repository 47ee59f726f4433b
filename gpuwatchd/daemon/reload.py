"""Loading policy files for a reload off the event loop: on a worker thread, one load at a
time, within a time limit, so the tick, the watchdog pings and ``status`` go on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.policyfiles import load_policies

__all__ = ["POLICY_LOAD_TIMEOUT_S", "PolicyLoader"]

POLICY_LOAD_TIMEOUT_S: Final = 10.0
"""A policy load that has not parsed by then is refused (the files are size-capped, so
the thread ends soon after); well under systemd's 30 s watchdog."""


class PolicyLoader:
    """Loads policy files (:func:`~gpuwatchd.policyfiles.load_policies`) on the default
    executor, one load at a time, within ``timeout_s`` seconds; also runs fire-and-forget
    reloads (SIGHUP) and keeps their tasks alive."""

    def __init__(self, timeout_s: float = POLICY_LOAD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    async def load(self, paths: Sequence[str]) -> PolicySet:
        """The policies of ``paths``. Raises :class:`~gpuwatchd.errors.PolicyError` for
        a broken file (file and line) or when the load takes longer than ``timeout_s``."""
        async with self._lock:
            loading = asyncio.get_running_loop().run_in_executor(None, load_policies, paths)
            try:
                return await asyncio.wait_for(loading, self.timeout_s)
            except asyncio.TimeoutError:
                message = f"reading the policies took more than {self.timeout_s:g} s"
                raise PolicyError(message, path=", ".join(paths)) from None

    def spawn(self, reload: Callable[[], Awaitable[object]]) -> None:
        """Run ``reload()`` in the background; its PolicyError is dropped (it logs it)."""

        async def quietly() -> None:
            with contextlib.suppress(PolicyError):
                await reload()

        task = asyncio.ensure_future(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
