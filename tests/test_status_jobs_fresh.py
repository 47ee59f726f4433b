"""``status`` shows each attached job as it is now, however often it is asked for.

The daemon reuses a job's converted part of the ``status`` reply while the job is
unchanged (gpuwatchd/daemon/report.py JobDicts: converting 64 jobs on every request was
most of a ``status``); here real jobs talk to a real daemon over its socket, as the
hook does, and every change a job makes shows in the very next ``status``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

from conftest import RunningDaemon
from gpuwatchd.control.client import ControlClient


class Job:
    """A job's connection as the hook opens it (hello with knobs, then reports)."""

    def __init__(self, path: str, name: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.file = self.sock.makefile("rwb")
        self.next_id = 0
        hello = {
            "op": "hello",
            "role": "job",
            "job": name,
            "pid": 4242,
            "knobs": {"num_workers": {"value": 4, "min": 0, "max": 16}},
        }
        assert self.send(hello)["ok"]

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        self.file.write(json.dumps({"id": self.next_id, **message}).encode() + b"\n")
        self.file.flush()
        reply: dict[str, Any] = json.loads(self.file.readline())
        return reply

    def report(self, steps: int, num_workers: int) -> None:
        body = {
            "steps": steps,
            "epoch": 0,
            "step_time_s": 0.1,
            "data_wait_s": 0.01,
            "data_wait_fraction": 0.1,
            "samples_per_s": 320.0,
            "knobs": {"num_workers": num_workers},
        }
        reply = self.send({"op": "report", "report": body})
        assert reply["ok"], reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def test_every_change_of_a_job_shows_in_the_next_status(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon()
    jobs = [Job(str(daemon.socket), f"train-{i}") for i in range(3)]
    try:
        with ControlClient(daemon.socket) as ctl:
            for steps in range(1, 30):
                changed = jobs[steps % 3]
                workers = 1 + steps % 4
                changed.report(steps, workers)
                for _ in range(3):  # asked again and again: the same, fresh answer
                    status = ctl.call("status")
                    entry = next(j for j in status["jobs"] if j["name"] == f"train-{steps % 3}")
                    assert entry["last_report"]["steps"] == steps
                    assert entry["knobs"]["num_workers"]["value"] == workers
            jobs.pop().close()
            names = set()
            for _ in range(50):
                names = {j["name"] for j in ctl.call("status")["jobs"]}
                if "train-2" not in names:
                    break
            assert names == {"train-0", "train-1"}  # a job gone is gone from status
    finally:
        for job in jobs:
            job.close()
