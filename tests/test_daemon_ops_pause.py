"""The ``pause``/``resume`` op (gpuwatchd.daemon.ops.pause) against a fake daemon."""

from __future__ import annotations

from pathlib import Path

from fake_daemon import ADMIN, FakeDaemon, call, policy_file


def test_pause_and_resume_say_the_state_and_who_asked(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    assert call(daemon, "pause") == {"paused": True}
    assert call(daemon, "pause") == {"paused": True}  # idempotent
    assert call(daemon, "resume") == {"paused": False}
    assert daemon.paused_by == [(True, ADMIN.uid), (True, ADMIN.uid), (False, ADMIN.uid)]


def test_pause_ignores_params(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    assert call(daemon, "pause", {"for_s": 10}) == {"paused": True}
