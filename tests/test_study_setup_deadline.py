"""A study storage that never answers does not hold the daemon's start (issue 21).

``psycopg2.connect`` has no default ``connect_timeout``: a PostgreSQL server that
accepts the connection and stays silent held the study setup, and READY=1 with it, for
ever. Here the storage is a real ``postgresql+psycopg2://`` URL on a 127.0.0.1 listener
the test opens and never answers on; what an operator checks: the daemon becomes ready,
says ``study.setup_failed`` with the reason, the orphan sweep the start runs before the
workers start gives up after ``START_SWEEP_TIMEOUT_S`` (15 s, ``study.start_sweep_late``),
and the job's worker is started anyway; on
SIGTERM it exits by itself within its stop budget (the stopped worker's crash handling is
abandoned after ``STOP_HANDLING_TIMEOUT_S``, 15 s, well within the unit's
TimeoutStopSec=60s) and names the storage calls it abandoned. Waits both deadlines
(``STUDY_SETUP_TIMEOUT_S``, 45 s, then 15 s: READY=1 within systemd's default 90 s):
``make test-long``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import RunningDaemon
from hpo_env import managed_workers, write_config

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that accepts connections (the kernel's backlog) and never
    sends a byte."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield int(server.getsockname()[1])


def test_a_silent_study_storage_does_not_hold_ready(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path, silent_server: int
) -> None:
    storage = f"postgresql+psycopg2://hpo:secret@127.0.0.1:{silent_server}/hpo"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    job = {
        "command": sleeper,
        "workers": 1,
        "gpus": [0],
        # exclusive (a server storage's default is not): the start's orphan sweep reads it
        "optuna": {"storage": storage, "study": "hpo", "exclusive": True},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    daemon = run_daemon(args=["--config", str(config)], wait_ready=False)
    daemon.notify.wait_for("READY=1", timeout_s=90)
    (failed,) = [e for e in daemon.events() if e["event"] == "study.setup_failed"]
    assert failed["job"] == "hpo" and "did not answer within 45 s" in failed["error"], failed
    assert not [e for e in daemon.events() if e["event"] == "study.ready"]
    (late,) = [e for e in daemon.events() if e["event"] == "study.start_sweep_late"]
    assert late["timeout_s"] == 15, late
    (worker,) = daemon.wait_until(
        lambda: [w for w in managed_workers(daemon.status(), "hpo") if w["pid"]],
        what="the worker started",
    )
    assert worker["gpu"] == 0
    # The stop: the worker is stopped; its crash handling waits on the same silent server.
    daemon.process.send_signal(signal.SIGTERM)
    try:
        # The budget is 15 s of crash handling after the worker's stop; 90 s is far above.
        returncode = daemon.process.wait(timeout=90)
    except subprocess.TimeoutExpired as exc:
        daemon.process.kill()
        daemon.process.wait()
        raise AssertionError(f"no exit on SIGTERM:\n{daemon.log_tail()}") from exc
    assert returncode == 0, daemon.log_tail()
    abandoned = [e for e in daemon.events() if e["event"] == "study.call_abandoned"]
    assert abandoned and {e["study"] for e in abandoned} == {"hpo"}, daemon.log_tail()
    # the start's sweep, then the stopped worker's crash handling
    assert abandoned[0]["call"] == "running_trials", abandoned
    assert {"trials_of_worker", "fail_and_requeue"} & {e["call"] for e in abandoned}, abandoned
    assert not any("secret" in e["storage"] for e in abandoned), abandoned
    assert [e for e in daemon.events() if e["event"] == "crash.handling_abandoned"]
