"""Sending a ``notify`` decision through apprise, off the tick's path.

:func:`send_notification` runs apprise's blocking ``notify`` in a worker thread with a
deadline; the actuator awaits it in its own task, so a slow or failing service never
delays a tick. apprise is imported here only, when a notification is sent.
Specification: docs/policies.md#notify.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

__all__ = ["DETAIL_CHARS", "send_notification"]

DETAIL_CHARS: Final = 500
"""Characters of apprise's error messages kept in a failed outcome's detail at most."""


def _with_timeouts(url: str, timeout_s: float) -> str:
    """``url`` with apprise's connect (``cto``) and read (``rto``) timeouts, seconds."""
    if "cto=" in url or "rto=" in url:
        return url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}cto={min(timeout_s, 4.0):g}&rto={timeout_s:g}"


def _send(urls: Sequence[str], title: str, body: str, timeout_s: float) -> tuple[bool, str]:
    import apprise

    notifier = apprise.Apprise()
    unknown = [u.split("://", 1)[0] for u in urls if not notifier.add(_with_timeouts(u, timeout_s))]
    if unknown:
        return False, "apprise cannot use these URLs: " + ", ".join(f"{s}://…" for s in unknown)
    with apprise.LogCapture(level=logging.WARNING) as captured:  # type: ignore[no-untyped-call]
        sent = notifier.notify(title=title, body=body)
        errors = captured.getvalue().strip()
    if sent:
        return True, f"sent to {len(urls)} service(s)"
    return False, (errors or "apprise reported a failure")[-DETAIL_CHARS:]


async def send_notification(
    urls: Sequence[str], title: str, body: str, timeout_s: float
) -> tuple[bool, str]:
    """Send ``title``/``body`` to every apprise URL of ``urls``; at most ``timeout_s``
    seconds (apprise's ``cto``/``rto`` are set to it too, so the thread ends as well).

    Returns ``(sent, detail)``: sent is False when a URL is not one apprise knows, a
    service failed (detail: apprise's warnings, the last :data:`DETAIL_CHARS`
    characters) or the deadline passed. Never raises for a service's failure.
    """
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(_send, list(urls), title, body, timeout_s), timeout_s + 1.0
        )
    except asyncio.TimeoutError:
        return False, f"timed out after {timeout_s:g} s"
