"""The ``job.start``/``job.stop``/``job.restart`` ops (gpuwatchd.daemon.ops.job) against a
fake daemon; the real supervisor behind them: test_supervisor_held.py, test_daemon_hpo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_daemon import ADMIN, FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import ADMIN_OPS, CLIENT_OPS
from gpuwatchd.errors import ProtocolError


def test_job_ops_name_the_job_and_say_what_they_did(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    assert call(daemon, "job.stop", {"job": "hpo"}) == {"job": "hpo", "stopped": 2, "started": 0}
    assert call(daemon, "job.start", {"job": "hpo"}) == {"job": "hpo", "stopped": 0, "started": 2}
    assert call(daemon, "job.restart", {"job": "hpo"}) == {
        "job": "hpo",
        "stopped": 2,
        "started": 2,
    }
    assert daemon.job_controls == [
        ("hpo", "stop", ADMIN.uid),
        ("hpo", "start", ADMIN.uid),
        ("hpo", "restart", ADMIN.uid),
    ]


@pytest.mark.parametrize("params", [{}, {"job": 3}, {"job": ""}, {"job": "x" * 201}])
def test_job_ops_refuse_bad_params(tmp_path: Path, params: dict[str, object]) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    with pytest.raises(ProtocolError) as caught:
        call(daemon, "job.stop", params)
    assert caught.value.code == "bad_request"
    assert daemon.job_controls == []


def test_an_unknown_job_is_not_found(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    with pytest.raises(ProtocolError) as caught:
        call(daemon, "job.start", {"job": "nope"})
    assert caught.value.code == "not_found" and "nope" in caught.value.message


def test_job_ops_are_admin_only() -> None:
    ops = {"job.start", "job.stop", "job.restart"}
    assert ops <= ADMIN_OPS and not ops & CLIENT_OPS
