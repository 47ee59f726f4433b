"""``node.resume`` and ``drain_node`` through Slurm: a hardware-fault finding drains this
node (``sinfo`` shows it drained with gpuwatchd's reason); the cluster-wide cap, read back
from Slurm, refuses a second node's drain; ``gpuwatchctl node resume`` returns it to idle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import RunningDaemon
from slurm import SlurmCluster, slurm  # noqa: F401  (the module's cluster)

FAILED_REMAP = {
    "devices": [
        {
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {"utilization.gpu": [50.0], "row_remap_failure": [1]},
        }
    ]
}

POLICY = """
policies:
  - name: drain-on-remap-failure
    when:
      row_remap: {kind: failure}
    do:
      - drain_node: {}
    cooldown: 10m
"""


def _start(
    run_daemon: Callable[..., RunningDaemon],
    cluster: SlurmCluster,
    tmp_path: Path,
    node: str,
) -> RunningDaemon:
    config = tmp_path / f"{node}.yaml"
    slurm_section = {"conf": str(cluster.conf), "node": node, "max_drained_nodes": 1}
    config.write_text(json.dumps({"slurm": slurm_section}))
    policies = tmp_path / "policies.yaml"
    policies.write_text(POLICY)
    return run_daemon(
        script=FAILED_REMAP,
        args=["--config", str(config), "--policies", str(policies)],
        name=node,
    )


def _drains(daemon: RunningDaemon) -> list[dict[str, Any]]:
    decisions = daemon.status()["decisions"]
    return [d for d in decisions if d["action"] == "drain_node" and d["outcome"] != "pending"]


def test_a_hardware_fault_drains_the_node_the_cap_holds_and_resume_undoes_it(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    first = _start(run_daemon, slurm, tmp_path, slurm.node)
    [drain] = first.wait_until(lambda: _drains(first), timeout_s=30, what="a drain decision")
    assert drain["outcome"] == "applied", drain
    assert drain["detail"].startswith(f"node {slurm.node} drained: gpuwatchd: ")
    slurm.wait("the node drained", lambda: slurm.node_state() == "drained")
    [line] = slurm.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"]).splitlines()
    name, state, reason = line.split("|", 2)
    assert (name, state) == (slurm.node, "drained")
    assert reason.startswith("gpuwatchd: ") and "row remap" in reason.lower()

    # a second node (its own daemon, state and socket) with the same finding: the cap of
    # 1 node drained by gpuwatchd cluster-wide, read from Slurm, refuses its drain
    second = _start(run_daemon, slurm, tmp_path, "gpu-node-2")
    [refused] = second.wait_until(lambda: _drains(second), timeout_s=30, what="a refusal")
    assert refused["outcome"] == "refused"
    assert f"({slurm.node})" in refused["detail"] and "max_drained_nodes) is 1" in refused["detail"]
    assert slurm.node_state() == "drained"

    done = first.ctl("node", "resume")
    assert done.returncode == 0, done.stderr
    # the state sinfo reports after (a "*" suffix: slurmd's last ping is late)
    assert done.stdout.startswith(f"node {slurm.node} resumed: idle")
    slurm.wait("the node idle", lambda: slurm.node_state() == "idle")
    resumed = [d for d in first.status()["decisions"] if d["action"] == "resume_node"]
    assert [(d["policy"], d["outcome"]) for d in resumed] == [("operator", "applied")]
    # resuming a node that is not drained is refused with Slurm's word
    again = first.ctl("node", "resume")
    assert again.returncode == 1 and "scontrol" in again.stderr


def test_node_resume_without_slurm_is_a_conflict(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon()
    done = daemon.ctl("node", "resume")
    assert done.returncode == 1
    assert "no slurm: section in the config" in done.stderr
