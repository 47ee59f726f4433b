"""Who runs a process from its cgroup path: the systemd unit and the Kubernetes pod uid
(parsing of ``/proc/<pid>/cgroup`` as cgroup v1 and v2 with the systemd and cgroupfs drivers
write it), and a process's own in ``status``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunningDaemon
from gpuwatchd.cgroup_identity import cgroup_identity, kubernetes_pod_uid, systemd_unit
from gpuwatchd.jobs.procfs import read_cgroup_identity
from gpuwatchd.model import CgroupIdentity

UID = "8f1e3a52-7b0c-4d8e-9a61-2c5d7e9f0b13"

V1_CGROUPFS = f"""12:pids:/kubepods/burstable/pod{UID}/4b7c0d2e9f
11:memory:/kubepods/burstable/pod{UID}/4b7c0d2e9f
1:name=systemd:/kubepods/burstable/pod{UID}/4b7c0d2e9f
"""
V1_GUARANTEED = f"3:cpu,cpuacct:/kubepods/pod{UID}/9e1d\n"
V2_SYSTEMD = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
    "cri-containerd-6a2b9f0c1d3e4f5a.scope\n"
)
V2_BESTEFFORT = (
    "0::/kubepods.slice/kubepods-besteffort.slice/"
    f"kubepods-besteffort-pod{UID.replace('-', '_')}.slice/crio-77aa.scope\n"
)
STATIC_POD = "0::/kubepods/besteffort/pod0f3d2a9c8b7e6d5c4b3a29180f1e2d3c/c1\n"


@pytest.mark.parametrize("text", [V1_CGROUPFS, V1_GUARANTEED, V2_SYSTEMD, V2_BESTEFFORT])
def test_the_pod_uid_of_each_kubelet_layout(text: str) -> None:
    assert kubernetes_pod_uid(text) == UID


def test_a_static_pod_and_paths_that_are_not_pods() -> None:
    assert kubernetes_pod_uid(STATIC_POD) == "0f3d2a9c8b7e6d5c4b3a29180f1e2d3c"
    for text in (
        "0::/system.slice/docker-4b7c.scope\n",
        f"0::/user.slice/pod{UID}.slice\n",  # not under kubepods
        f"0::/kubepods/burstable/pod{UID}x/c\n",
        "0::/kubepods/burstable/podnot-a-uid/c\n",
        "0::/\n",
        "",
        "garbage without colons\n",
    ):
        assert kubernetes_pod_uid(text) is None, text


def test_the_systemd_unit_of_system_user_transient_and_slurm_processes() -> None:
    assert systemd_unit("0::/system.slice/gpuwatchd.service\n") == ("gpuwatchd.service", None)
    user = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/train.service\n"
    assert systemd_unit(user) == ("train.service", 1000)
    run = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/run-r3f0c1d2.scope\n"
    assert systemd_unit(run) == ("run-r3f0c1d2.scope", 1000)
    assert systemd_unit("0::/system.slice/run-u42.service\n") == ("run-u42.service", None)
    slurm = "0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n"
    assert systemd_unit(slurm) == ("slurmstepd.scope", None)
    template = "0::/system.slice/system-getty.slice/getty@tty1.service\n"
    assert systemd_unit(template) == ("getty@tty1.service", None)
    manager = "0::/user.slice/user-1000.slice/user@1000.service/init.scope\n"
    assert systemd_unit(manager) == ("init.scope", 1000)
    v1 = "4:memory:/user.slice\n1:name=systemd:/system.slice/ssh.service\n"
    assert systemd_unit(v1) == ("ssh.service", None)
    for text in ("0::/user.slice\n", "0::/\n", "5:cpu:/system.slice/x.service\n", ""):
        assert systemd_unit(text) is None, text
    assert systemd_unit("0::/system.slice/" + "a" * 300 + ".service\n") is None


def test_both_together_and_bounded() -> None:
    assert cgroup_identity(V2_SYSTEMD) == CgroupIdentity(
        "cri-containerd-6a2b9f0c1d3e4f5a.scope", None, UID
    )
    # only the first 64 lines are read: a pod named past them is not seen
    assert kubernetes_pod_uid("0::/x\n" * 64 + V2_SYSTEMD) is None
    # a deep path a user built in a delegated subtree is read component by component
    deep = "0::/user.slice/" + "kubepods/" * 5000 + f"pod{UID}/c\n"
    assert kubernetes_pod_uid(deep) == UID
    assert kubernetes_pod_uid("0::/kubepods/" + "x" * 300 + f"/pod{UID}\n") is None


def test_read_from_proc(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(V1_CGROUPFS)
    assert read_cgroup_identity(7, tmp_path) == CgroupIdentity(None, None, UID)
    assert read_cgroup_identity(8, tmp_path) == CgroupIdentity()


def test_status_shows_the_cgroup_of_each_attached_job(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    """The daemon reads the attached process's real ``/proc/<pid>/cgroup`` at its hello
    (this test's own process attaches) and shows what it says, as this module parses it,
    in ``status``, ``jobs`` and ``control.job_attached``."""
    from gpuwatchd.hook import attach

    daemon = run_daemon()
    expected = cgroup_identity(Path("/proc/self/cgroup").read_text())
    os.environ["GPUWATCHD_SOCKET"] = str(daemon.socket)
    try:
        with attach(job="me"):
            (job,) = daemon.wait_until(lambda: daemon.status()["jobs"], what="attached")
            listing = daemon.ctl("--json", "jobs")
    finally:
        del os.environ["GPUWATCHD_SOCKET"]
    cgroup = {
        "systemd_unit": expected.systemd_unit,
        "systemd_user": expected.systemd_user,
        "kubernetes_pod_uid": expected.kubernetes_pod_uid,
    }
    # a path that names neither (a container's "0::/") is one null, not three
    assert job["cgroup"] == (None if expected == CgroupIdentity() else cgroup)
    assert '"cgroup"' in listing.stdout
    (attached,) = [e for e in daemon.events() if e["event"] == "control.job_attached"]
    assert {key: attached[key] for key in cgroup} == cgroup
