"""The ``notify`` action (gpuwatchd/policy/actions/notify.py): one notification per firing,
its URLs never shown; sent through the sender it is given (apprise: tests/test_notify.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from action_fakes import firing, gpu_group
from gpuwatchd.policy.actions import notify, public_params
from gpuwatchd.policy.actions.spec import Effects


def test_notify_decides_once_per_firing_and_hides_its_urls() -> None:
    fired, params = firing('notify: {urls: ["slack://T/B/secret"], timeout: 3s}')
    (decision,) = notify.decide(fired, params, [gpu_group(0), gpu_group(1)])
    assert decision.params["title"] == "gpuwatchd: p"
    assert decision.params["timeout_s"] == 3.0
    assert decision.params["subjects"] == ["gpu:GPU-0000", "gpu:GPU-0001"]
    assert public_params("notify", decision.params)["urls"] == ["slack://…"]

    sent: list[tuple[list[str], str, str, float]] = []

    async def send(
        urls: Sequence[str], title: str, body: str, timeout_s: float
    ) -> tuple[bool, str]:
        sent.append((list(urls), title, body, timeout_s))
        return len(sent) == 1, "sent" if len(sent) == 1 else "slack: 500"

    effects = Effects(send_notification=send)
    assert asyncio.run(notify.carry_out(decision, effects)) == ("applied", "sent")
    assert sent[0] == (["slack://T/B/secret"], "gpuwatchd: p", "GPU idle; GPU idle", 3.0)
    assert asyncio.run(notify.carry_out(decision, effects)) == ("failed", "slack: 500")
