"""Attribution of jobs to Slurm: the hook's ``hello`` names the Slurm job from the task's
environment, the daemon checks it and shows it in ``status``/``jobs`` and its events; a
process without the hook is attributed from its environment and Slurm cgroup path."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunningDaemon
from gpuwatchd.control.messages import parse_slurm, slurm_identity
from gpuwatchd.errors import ProtocolError
from gpuwatchd.jobs.procfs import read_slurm_job, slurm_job_of_cgroup
from gpuwatchd.model import SlurmJob
from slurm import SlurmCluster, slurm  # noqa: F401  (the module's cluster)

TASK_ENV = {
    "SLURM_JOB_ID": "31",
    "SLURM_ARRAY_JOB_ID": "28",
    "SLURM_ARRAY_TASK_ID": "3",
    "SLURM_JOB_USER": "alice",
    "SLURM_JOB_PARTITION": "gpu",
}


def test_the_hello_field_from_a_task_environment_round_trips() -> None:
    field = slurm_identity(TASK_ENV)
    assert field == {
        "job_id": "31",
        "array_job_id": "28",
        "array_task_id": 3,
        "user": "alice",
        "partition": "gpu",
    }
    assert parse_slurm(field) == SlurmJob("31", "28", 3, "alice", "gpu")
    assert SlurmJob("31", "28", 3).label() == "28_3"
    assert SlurmJob("31").label() == "31"


def test_a_malformed_environment_leaves_out_what_is_bad_never_the_hello() -> None:
    assert slurm_identity({}) is None
    assert slurm_identity({"SLURM_JOB_ID": "1; rm"}) is None
    bad = dict(TASK_ENV, SLURM_ARRAY_TASK_ID="x", SLURM_JOB_USER="a b", SLURM_JOB_PARTITION="")
    assert slurm_identity(bad) == {"job_id": "31"}


@pytest.mark.parametrize(
    "field",
    [
        "31",
        {"job_id": 31},
        {"job_id": "0"},
        {"job_id": "1" * 11},
        {"job_id": "31", "array_job_id": "28"},
        {"job_id": "31", "array_job_id": "28", "array_task_id": -1},
        {"job_id": "31", "array_job_id": "28", "array_task_id": True},
        {"job_id": "31", "user": "x" * 65},
        {"job_id": "31", "partition": "a\nb"},
    ],
)
def test_the_daemon_refuses_a_bad_slurm_field(field: object) -> None:
    with pytest.raises(ProtocolError, match="slurm"):
        parse_slurm(field)


def test_the_slurm_cgroup_path_names_job_and_step() -> None:
    v1 = "12:pids:/slurm/uid_0/job_17/step_batch/task_0\n4:memory:/slurm/uid_0/job_17\n"
    v2 = "0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n"
    assert slurm_job_of_cgroup(v1) == SlurmJob("17", step="batch")
    assert slurm_job_of_cgroup(v2) == SlurmJob("9", step="0")
    assert slurm_job_of_cgroup("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert slurm_job_of_cgroup("0::/x/job_17x/step_0\n") is None


def test_a_process_without_the_hook_from_proc(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "environ").write_bytes(
        b"\0".join(f"{k}={v}".encode() for k, v in TASK_ENV.items()) + b"\0PATH=/bin\0"
    )
    (proc / "42" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_31/step_batch\n")
    assert read_slurm_job(42, proc) == SlurmJob("31", "28", 3, "alice", "gpu", step="batch")
    (proc / "42" / "environ").unlink()  # another user's process: only the cgroup
    assert read_slurm_job(42, proc) == SlurmJob("31", step="batch")
    assert read_slurm_job(43, proc) is None


HOOKED_TASK = """#!/bin/sh
exec {python} -c "
import time
from gpuwatchd.hook import attach
with attach(job='hpo'):
    time.sleep(300)
"
"""


def test_status_and_jobs_show_each_array_task(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    daemon = run_daemon()
    task = HOOKED_TASK.format(python=sys.executable)
    array = slurm.submit(tmp_path / "task.sh", task, "0-1", env=daemon.env)

    def attached() -> list[dict[str, object]] | None:
        jobs = daemon.status()["jobs"]
        return jobs if len(jobs) == 2 else None

    jobs = daemon.wait_until(attached, timeout_s=60, what="two attached tasks")
    tasks = sorted((j["slurm"]["array_job_id"], j["slurm"]["array_task_id"]) for j in jobs)
    assert tasks == [(array, 0), (array, 1)]
    assert all(j["slurm"]["user"] == "root" and j["slurm"]["partition"] == "debug" for j in jobs)
    table = daemon.ctl("jobs", "--format", "csv")
    assert table.returncode == 0, table.stderr
    assert {line.split(",")[-1] for line in table.stdout.splitlines()[1:]} == {
        f"{array}_0",
        f"{array}_1",
    }
    logged = [e for e in daemon.events() if e.get("event") == "control.job_attached"]
    assert sorted(e["slurm_job"] for e in logged) == [f"{array}_0", f"{array}_1"]
    listing = json.loads(daemon.ctl("--json", "jobs").stdout)
    assert {j["slurm"]["job_id"] for j in listing["jobs"]} == set(
        slurm.run(["squeue", "-h", "-j", array, "-o", "%A"]).split()
    )
    slurm.run(["scancel", array])
