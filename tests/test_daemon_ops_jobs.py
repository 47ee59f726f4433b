"""The ``jobs`` op (gpuwatchd.daemon.ops.jobs) against a fake daemon."""

from __future__ import annotations

from pathlib import Path

from fake_daemon import FakeDaemon, call, policy_file


def test_jobs_lists_attached_and_managed_jobs(tmp_path: Path) -> None:
    reply = call(FakeDaemon(policy_file(tmp_path)), "jobs")
    assert reply == {"jobs": [{"name": "digits", "pid": 4242}], "managed": []}
