"""``allocated_but_idle``: a GPU Slurm allocated to an attached job that the job leaves idle.

The pure detector on hand-made snapshots, and the daemon end to end: FakeNvml's two GPUs
and a real Slurm task (tests/slurm.py's cluster) with the hook, whose environment holds
what Slurm's gres/gpu plugin sets for a job given GPUs 0 and 1 (``SLURM_JOB_GPUS=0,1``),
running on GPU 0 only. The test cluster cannot allocate these GPUs (gres/gpu needs a
gres.conf naming real device files), so the task sets the allocation's variables itself;
the rest is real: Slurm's job ids, the hook, the socket, the daemon's tick, policy engine,
log and metrics endpoint.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TWO_GPUS, RunningDaemon
from gpuwatchd.cgroup_identity import cgroup_identity
from gpuwatchd.control.messages import parse_slurm, slurm_gpus, slurm_identity
from gpuwatchd.detectors import DETECTORS, AllocatedButIdle
from gpuwatchd.errors import ProtocolError
from gpuwatchd.metrics.collector import SLURM_JOB_IDS_MAX, slurm_job_labels
from gpuwatchd.model import (
    NA,
    CgroupIdentity,
    Finding,
    GpuProcess,
    GpuSample,
    JobInfo,
    SlurmJob,
    Snapshot,
)
from gpuwatchd.windows import Windows
from pg import free_port
from slurm import SlurmCluster, slurm  # noqa: F401  (the module's cluster)


def gpu(index: int, util: float | None, pids: Sequence[int] = ()) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        index=index,
        name="H100",
        timestamp_s=0.0,
        utilization_gpu_pct=NA if util is None else util,
        processes=tuple(GpuProcess(pid) for pid in pids),
    )


def attached(name: str, pid: int, job_id: str, gpus: Sequence[str], **more: object) -> JobInfo:
    given = SlurmJob(job_id, gpus=tuple(gpus), user="alice", **more)  # type: ignore[arg-type]
    return JobInfo(name=name, pid=pid, connected_at_s=0.0, slurm=given)


class Rig:
    def __init__(self, **params: object) -> None:
        self.detector = AllocatedButIdle(AllocatedButIdle.parse_params(params, _fail))
        self.windows = Windows(self.detector.needs())

    def step(
        self,
        t: float,
        gpus: Sequence[GpuSample],
        jobs: Sequence[JobInfo],
        process_slurm: tuple[tuple[int, SlurmJob], ...] = (),
    ) -> list[Finding]:
        snapshot = Snapshot(t, tuple(gpus), None, tuple(jobs), process_slurm=process_slurm)
        self.windows.observe(snapshot)
        return self.detector.evaluate(self.windows)


def _fail(key: str, message: str) -> None:
    raise AssertionError(f"{key}: {message}")


def test_the_allocated_gpu_the_job_leaves_idle_is_found_after_for() -> None:
    rig = Rig(percent=10, **{"for": "30s"})
    jobs = [attached("hpo", 100, "77", ["0", "1"])]
    for t in (0.0, 15.0):
        assert rig.step(t, [gpu(0, 97.0, [100]), gpu(1, 0.0)], jobs) == []
    (finding,) = rig.step(30.0, [gpu(0, 97.0, [100]), gpu(1, 0.0)], jobs)
    assert finding.detector == "allocated_but_idle"
    assert (finding.gpu_index, finding.job, finding.since_s) == (1, "hpo", 0.0)
    assert finding.subject == "gpu:GPU-00000001-0000-0000-0000-000000000000"
    assert "Slurm to job 77, user alice" in finding.message
    assert "GPU 1" in finding.message and "utilization.gpu 0.0 % <= 10 %" in finding.message


def test_a_gpu_the_job_uses_or_keeps_busy_or_that_is_na_does_not_match() -> None:
    rig = Rig(**{"for": "0s"})
    jobs = [attached("hpo", 100, "77", ["0", "1"])]
    assert rig.step(0.0, [gpu(0, 0.0, [100]), gpu(1, 60.0)], jobs) == []  # a rank without hook
    assert rig.step(1.0, [gpu(0, 0.0, [100]), gpu(1, None)], jobs) == []
    assert [f.gpu_index for f in rig.step(2.0, [gpu(0, 0.0, [100]), gpu(1, 2.0)], jobs)] == [1]


def test_a_break_restarts_the_streak_and_a_detached_job_ends_it() -> None:
    rig = Rig(**{"for": "10s"})
    jobs = [attached("hpo", 100, "77", ["0", "1"])]
    rig.step(0.0, [gpu(0, 50.0, [100]), gpu(1, 0.0)], jobs)
    rig.step(5.0, [gpu(0, 50.0, [100]), gpu(1, 0.0, [100])], jobs)  # it used GPU 1 a moment
    assert rig.step(10.0, [gpu(0, 50.0, [100]), gpu(1, 0.0)], jobs) == []
    assert rig.step(20.0, [gpu(0, 50.0, [100]), gpu(1, 0.0)], jobs) != []
    assert rig.detector.streaks() == {"77@gpu:" + gpu(1, 0.0).uuid: 10.0}
    assert rig.step(30.0, [gpu(0, 50.0, [100]), gpu(1, 0.0)], []) == []
    assert rig.detector.streaks() == {}


def test_a_job_nvml_lists_nowhere_is_not_judged() -> None:
    """NVML lists no process of the job (a container without the host's PID namespace
    lists none at all): an idle GPU of its allocation is no evidence it is not used."""
    rig = Rig(**{"for": "0s"})
    jobs = [attached("hpo", 100, "77", ["0", "1"])]
    assert rig.step(0.0, [gpu(0, 5.0), gpu(1, 0.0)], jobs) == []


def test_the_ranks_of_one_slurm_job_are_judged_together() -> None:
    """Two ranks of job 77, each on its own GPU, share the allocation 0,1,2: only GPU 2
    is idle; an array task is named as squeue names it, by UUID allocation too."""
    rig = Rig(**{"for": "0s"})
    uuid2 = gpu(2, 0.0).uuid
    jobs = [
        attached("ddp", 100, "77", ["0", "1"], array_job_id="70", array_task_id=7),
        attached("ddp-1", 101, "77", ["1", uuid2[:12]], array_job_id="70", array_task_id=7),
    ]
    gpus = [gpu(0, 90.0, [100]), gpu(1, 0.0, [101]), gpu(2, 0.0), gpu(3, 0.0)]
    (finding,) = rig.step(0.0, gpus, jobs)
    assert finding.gpu_index == 2 and finding.job == "ddp"
    assert "job 70_7" in finding.message and "attached as ddp, ddp-1" in finding.message


def test_a_job_without_the_hook_is_judged_from_its_gpu_processes() -> None:
    """A Slurm job none of whose processes has the hook: its GPU process's environment
    (read by the tick) gives the allocation; the finding names no attached job."""
    rig = Rig(**{"for": "0s"})
    on_gpu0 = ((200, SlurmJob("88", user="bob", gpus=("0", "1"))),)
    (finding,) = rig.step(0.0, [gpu(0, 95.0, [200]), gpu(1, 1.0)], [], on_gpu0)
    assert (finding.gpu_index, finding.job) == (1, None)
    assert "job 88, user bob (no process with the hook)" in finding.message
    # its second process moves onto GPU 1: nothing left idle
    both = (*on_gpu0, (201, SlurmJob("88", gpus=("0", "1"))))
    assert rig.step(1.0, [gpu(0, 95.0, [200]), gpu(1, 1.0, [201])], [], both) == []


def test_a_job_seen_outside_its_allocation_is_not_judged() -> None:
    """CUDA_VISIBLE_DEVICES=0 inside a job Slurm confined to GPU 1 (ConstrainDevices
    renumbers): the process runs on NVML's GPU 1, so the entry "0" is not NVML's index and
    GPU 0 must not be called idle."""
    rig = Rig(**{"for": "0s"})
    jobs = [attached("hpo", 100, "77", ["0"])]
    assert rig.step(0.0, [gpu(0, 0.0), gpu(1, 90.0, [100])], jobs) == []


def test_jobs_without_an_allocation_or_with_unknown_gpus_never_match() -> None:
    """Idle GPUs 1 and 2 belong to no allocation that names them: a job outside Slurm, a
    Slurm job without GPUs, and entries no GPU of the node has (9, a foreign UUID)."""
    rig = Rig(**{"for": "0s"})
    jobs = [
        JobInfo(name="plain", pid=5, connected_at_s=0.0),
        attached("nogpus", 6, "78", []),
        attached("elsewhere", 7, "79", ["0", "9", "GPU-ffffffff"]),
    ]
    gpus = [gpu(0, 30.0, [5, 6, 7]), gpu(1, 0.0), gpu(2, 0.0)]
    assert rig.step(0.0, gpus, jobs) == []


def test_the_allocation_from_the_environment_slurm_sets() -> None:
    assert slurm_gpus({"SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]
    assert slurm_gpus({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == ["2", "3"]
    assert slurm_gpus({"GPU_DEVICE_ORDINAL": "1"}) == ["1"]
    assert slurm_gpus({"CUDA_VISIBLE_DEVICES": "GPU-0123abcd-0000,1,1"}) == [
        "GPU-0123abcd-0000",
        "1",
    ]
    assert slurm_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == []
    assert slurm_gpus({"SLURM_JOB_GPUS": "0;rm", "CUDA_VISIBLE_DEVICES": "0"}) == []
    assert slurm_gpus({"SLURM_JOB_GPUS": ",".join(map(str, range(65)))}) == []
    field = slurm_identity({"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0,1"})
    assert field == {"job_id": "77", "gpus": ["0", "1"]}
    assert parse_slurm(field) == SlurmJob("77", gpus=("0", "1"))
    for bad in ("0,1", ["x"], ["0"] * 65, [1]):
        with pytest.raises(ProtocolError, match=r"slurm\.gpus"):
            parse_slurm({"job_id": "77", "gpus": bad})


def test_registered_for_policies() -> None:
    assert DETECTORS["allocated_but_idle"] is AllocatedButIdle
    assert AllocatedButIdle.parse_params(None, _fail) == {"percent": 10.0, "for": 300.0}


# -- the daemon, under Slurm -------------------------------------------------------------

TASK = """#!/bin/sh
echo $$ > {tmp}/task.$SLURM_ARRAY_TASK_ID.pid
# What Slurm's gres/gpu plugin sets for a job given two GPUs (--gres=gpu:2); the test
# cluster has no gres.conf (it needs real /dev/nvidia* devices), so the task sets it.
if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then
    export SLURM_JOB_GPUS=0,1 CUDA_VISIBLE_DEVICES=0,1
    exec {python} -c '
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
from gpuwatchd.hook import attach
with attach(job="hpo", knobs={{"num_workers": 2}}):
    time.sleep(120)
' {socket}
fi
export SLURM_JOB_GPUS=2,3 CUDA_VISIBLE_DEVICES=2,3
exec sleep 120
"""

POLICY = """
policies:
  - name: allocated-idle
    when:
      allocated_but_idle: {percent: 10, for: 1s}
    do:
      - log: {level: warning}
"""


def test_the_daemon_finds_the_allocated_gpu_a_slurm_job_leaves_idle(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    """Two Slurm tasks on the fake NVML's four GPUs: task 0 (hooked) given GPUs 0 and 1
    runs on GPU 0 only, task 1 (no hook) given GPUs 2 and 3 on GPU 2 only. GPUs 1 and 3
    are findings naming each task's Slurm job, and the scrape labels task 0's series."""
    socket = tmp_path / "d" / "run" / "control.sock"  # run_daemon's first daemon's
    pidfiles = [tmp_path / f"task.{task}.pid" for task in (0, 1)]
    text = TASK.format(tmp=tmp_path, python=sys.executable, socket=socket)
    env = dict(os.environ, GPUWATCHD_SOCKET=str(socket))
    array = slurm.submit(tmp_path / "task.sh", text, "0-1", env=env)
    try:
        slurm.wait(
            "the tasks' pids", lambda: all(p.exists() and p.read_text().strip() for p in pidfiles)
        )
        pid, unhooked = (int(p.read_text()) for p in pidfiles)
        job_id = _slurm_job_id(pid)
        script = json.loads(json.dumps(TWO_GPUS))
        for n in (2, 3):  # two more idle GPUs
            script["devices"].append(dict(script["devices"][1], uuid=f"GPU-{n}{'0' * 7}-0"))
        script["devices"][0]["processes"] = [[pid, 2**30, 80.0]]  # GPU 0: task 0's
        script["devices"][2]["processes"] = [[unhooked, 2**30]]  # GPU 2: task 1's
        policies = tmp_path / "policies.yaml"
        policies.write_text(POLICY)
        address = f"127.0.0.1:{free_port()}"
        daemon = run_daemon(
            script=script, args=["--policies", str(policies), "--metrics-listen", address]
        )
        assert daemon.socket == socket

        def findings() -> dict[int, dict[str, Any]] | None:
            found = {
                f["gpu_index"]: f
                for f in daemon.status()["findings"]
                if f["detector"] == "allocated_but_idle"
            }
            return found if len(found) == 2 else None

        found = daemon.wait_until(findings, timeout_s=60, what="two allocated_but_idle findings")
        assert sorted(found) == [1, 3]  # never 0 or 2: each task's own GPU
        assert found[1]["job"] == "hpo"
        assert f"GPU 1 allocated by Slurm to job {array}_0, user root" in found[1]["message"]
        assert found[3]["job"] is None
        assert (
            f"GPU 3 allocated by Slurm to job {array}_1, user root (no process with the hook)"
            in (found[3]["message"])
        )
        status = daemon.status()
        (job,) = status["jobs"]
        assert job["slurm"]["gpus"] == ["0", "1"] and job["slurm"]["job_id"] == job_id
        # the task without the hook, on GPU 2: its Slurm job and cgroup path in status
        (process,) = status["gpus"][2]["processes"]
        assert process["pid"] == unhooked
        assert (process["slurm"]["array_job_id"], process["slurm"]["array_task_id"]) == (array, 1)
        assert process["slurm"]["gpus"] == ["2", "3"]
        identity = cgroup_identity(Path(f"/proc/{unhooked}/cgroup").read_text())
        if identity == CgroupIdentity():  # the path names neither (a container's "0::/")
            assert process["cgroup"] is None
        else:
            assert process["cgroup"]["systemd_unit"] == identity.systemd_unit
            assert process["cgroup"]["kubernetes_pod_uid"] == identity.kubernetes_pod_uid
        (attached_event,) = [e for e in daemon.events() if e["event"] == "control.job_attached"]
        assert attached_event["slurm_gpus"] == ["0", "1"]
        logged = daemon.wait_until(
            lambda: [e for e in daemon.events() if e.get("policy") == "allocated-idle"],
            what="the policy's log decision",
        )
        assert f"GPU 1 allocated by Slurm to job {array}_0" in json.dumps(logged[0])
        # the scrape: the Slurm job id labels the job's series and its GPU process's
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            scraped = reply.read().decode()
        samples = {
            sample.name: sample
            for family in text_string_to_metric_families(scraped)
            for sample in family.samples
        }
        knob = samples["gpuwatchd_job_knob_value"]
        assert (knob.labels["job_name"], knob.labels["slurm_job_id"], knob.value) == (
            "hpo",
            job_id,
            2,
        )
        process_sm = samples["gpuwatchd_gpu_process_sm_active_ratio"]
        assert (process_sm.labels["pid"], process_sm.labels["slurm_job_id"]) == (str(pid), job_id)
        assert samples["gpuwatchd_slurm_job_ids_over_cap"].value == 0
    finally:
        slurm.run(["scancel", array])


def _slurm_job_id(pid: int) -> str:
    """``SLURM_JOB_ID`` of process ``pid`` (what Slurm gave the task)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (value,) = [
        item[len(b"SLURM_JOB_ID=") :] for item in environ if item.startswith(b"SLURM_JOB_ID=")
    ]
    return value.decode()


def test_the_slurm_job_id_label_values_are_capped() -> None:
    """Past SLURM_JOB_IDS_MAX distinct ids in one scrape (hellos may claim any id) the
    highest ids share the label value _other, and the gauge counts them."""
    jobs = tuple(
        JobInfo(f"j{i}", 1000 + i, 0.0, slurm=SlurmJob(str(i + 1)))
        for i in range(SLURM_JOB_IDS_MAX + 5)
    )
    view: Any = SimpleNamespace(jobs=jobs, process_slurm={7: "999999"})
    labels, over = slurm_job_labels(view)
    assert over == 6
    assert labels["1"] == "1" and labels[str(SLURM_JOB_IDS_MAX)] == str(SLURM_JOB_IDS_MAX)
    assert labels[str(SLURM_JOB_IDS_MAX + 1)] == "_other" and labels["999999"] == "_other"
    assert len(set(labels.values())) == SLURM_JOB_IDS_MAX + 1
