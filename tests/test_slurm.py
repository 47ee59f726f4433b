"""gpuwatchd.slurm against a real single-node Slurm (tests/slurm.py): the throttle of an
array, node drain and resume, the drain count, requeue, and the typed errors."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from gpuwatchd.slurm import (
    OUTPUT_MAX_BYTES,
    STDERR_MAX_BYTES,
    ArrayThrottle,
    Slurm,
    SlurmCommandFailed,
    SlurmOutputError,
    SlurmUnavailable,
    parse_job_record,
)
from slurm import SlurmCluster, slurm  # noqa: F401  (the module's cluster)


def _submit(cluster: SlurmCluster, tmp_path: Path, array: str) -> str:
    return cluster.submit(tmp_path / "task.sh", "#!/bin/sh\nexec sleep 300\n", array)


def _client(cluster: SlurmCluster) -> Slurm:
    return Slurm(str(cluster.conf))


def test_array_throttle_read_set_and_read_back(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    array = _submit(slurm, tmp_path, "0-9%3")
    client = _client(slurm)
    slurm.wait("3 running tasks", lambda: len(slurm.running(array)) == 3)
    assert asyncio.run(client.array_throttle(array)) == ArrayThrottle(
        array, 3, 3, 7, user_id=os.getuid(), hosts=(slurm.node,)
    )
    asyncio.run(client.set_array_throttle(array, 1))
    assert asyncio.run(client.array_throttle(array)).throttle == 1
    # running tasks go on; none starts while 3 > 1 run: end one, the count falls to 2
    slurm.run(["scancel", f"{array}_0"])
    slurm.wait("task 0 gone", lambda: f"{array}_0" not in slurm.running(array))
    assert len(slurm.running(array)) == 2
    # with a task ended, scontrol exits 1 ("Job has already finished" for it) yet updates
    # the rest: that is a success, read back
    asyncio.run(client.set_array_throttle(array, 2))
    assert asyncio.run(client.array_throttle(array)).throttle == 2
    slurm.run(["scancel", array])


def test_requeue_a_task(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    array = _submit(slurm, tmp_path, "0-1")
    slurm.wait("2 running tasks", lambda: len(slurm.running(array)) == 2)
    task = slurm.run(["squeue", "-h", "-j", f"{array}_1", "-o", "%A"]).strip()
    asyncio.run(_client(slurm).requeue(task))
    record = parse_job_record(slurm.run(["scontrol", "show", "job", "-o", task]))
    assert record["Restarts"] == "1"
    slurm.run(["scancel", array])


def test_drain_count_and_resume(slurm: SlurmCluster) -> None:  # noqa: F811
    client = _client(slurm)
    assert asyncio.run(client.drained_by_gpuwatchd()) == ()
    reason = asyncio.run(client.drain_node(slurm.node, "Xid 79 on GPU 0\n(fallen off)"))
    assert reason == "gpuwatchd: Xid 79 on GPU 0 (fallen off)"
    slurm.wait("drained", lambda: slurm.node_state() == "drained")
    sinfo = slurm.run(["sinfo", "-h", "-N", "-o", "%E"]).strip()
    assert sinfo == "gpuwatchd: Xid 79 on GPU 0 (fallen off)"
    assert asyncio.run(client.node_state(slurm.node)) == ("drained", reason)
    assert asyncio.run(client.drained_by_gpuwatchd()) == (slurm.node,)
    asyncio.run(client.resume_node(slurm.node))
    slurm.wait("idle", lambda: slurm.node_state() == "idle")
    assert asyncio.run(client.drained_by_gpuwatchd()) == ()


def test_a_drain_by_someone_else_is_not_counted(slurm: SlurmCluster) -> None:  # noqa: F811
    slurm.run(["scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=admin"])
    try:
        assert asyncio.run(_client(slurm).drained_by_gpuwatchd()) == ()
    finally:
        slurm.run(["scontrol", "update", f"NodeName={slurm.node}", "State=RESUME"])


def test_failures_are_typed(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    client = _client(slurm)
    with pytest.raises(SlurmCommandFailed, match="Invalid job id"):
        asyncio.run(client.array_throttle("999999"))
    single = slurm.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300"]).strip()
    with pytest.raises(SlurmOutputError, match="not an array job"):
        asyncio.run(client.array_throttle(single))
    slurm.run(["scancel", single])
    with pytest.raises(SlurmOutputError, match="not a Slurm job id"):
        asyncio.run(client.set_array_throttle("1 State=DRAIN", 2))
    with pytest.raises(ValueError, match="not a Slurm node name"):
        asyncio.run(client.drain_node("n1 State=DOWN", "x"))
    with pytest.raises(SlurmUnavailable, match="cannot run"):
        asyncio.run(Slurm(str(slurm.conf), env={"PATH": str(tmp_path)}).drained_by_gpuwatchd())


def test_parse_job_record_keeps_spaced_values() -> None:
    record = parse_job_record("JobId=7 ArrayJobId=5 Reason=a b c JobState=PENDING")
    assert record == {"JobId": "7", "ArrayJobId": "5", "Reason": "a b c", "JobState": "PENDING"}
    with pytest.raises(ValueError):
        parse_job_record("nothing here")


@pytest.mark.parametrize(
    ("stream", "limit"), [("stdout", OUTPUT_MAX_BYTES), ("stderr", STDERR_MAX_BYTES)]
)
def test_a_client_writing_too_much_is_killed_not_parsed(stream: str, limit: int) -> None:
    # a client past the limit that then hangs: the call fails on the size (not the
    # timeout), nothing of it parsed
    writer = (
        f"import sys, time; sys.{stream}.write('JobId=1 ArrayTaskThrottle=4 ' * {limit // 8});"
        f"sys.{stream}.flush(); time.sleep(60)"
    )
    client = Slurm(timeout_s=30)
    with pytest.raises(SlurmOutputError, match=f"more than {limit} bytes on {stream}"):
        asyncio.run(client.run([sys.executable, "-c", writer]))
    fits = f"import sys; sys.{stream}.write('x' * {limit})"
    out = asyncio.run(client.run([sys.executable, "-c", fits]))
    assert len(out) == (limit if stream == "stdout" else 0)
