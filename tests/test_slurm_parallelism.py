"""Parallelism through Slurm: a VRAM-pressure finding on the node of an attached Slurm
array lowers its ``ArrayTaskThrottle`` 4 -> 3 -> 2 (never below ``min_workers``), read
back from slurmctld, journaled; ``squeue`` then runs no more than 2 of its tasks; clean
trials raise it again up to ``max_workers``; two nodes acting on one array converge."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import structlog

from conftest import RunningDaemon
from gpuwatchd.config import SlurmArrayConfig, parse_config
from gpuwatchd.errors import ActionRefused, ConfigError
from gpuwatchd.model import JobInfo, SlurmJob
from gpuwatchd.slurm import Slurm, parse_job_record
from gpuwatchd.slurm_actions import SlurmActions, node_name, this_node
from slurm import SlurmCluster, daemon_args, one_gpu, slurm  # noqa: F401  (the module's cluster)

FULL_GPU = one_gpu(79)

POLICY = """
policies:
  - name: vram-lower-parallelism
    when:
      vram_above: {percent: 95, for: 1s}
    do:
      - lower_parallelism: {step: 1}
    cooldown: 2s
"""

ARRAYS = {"arrays": {"hpo": {"max_workers": 4, "min_workers": 2}}}

RAISE_POLICY = """
policies:
  - name: clean-trials-raise
    when:
      trials_succeeded_in_row: {count: 2}
    do:
      - raise_parallelism: {step: 1}
"""

# A task of the array: one hooked Optuna worker (tests/optuna_worker.py --hook) running
# one trial of the shared study (SQLite here, PostgreSQL on a cluster), attached as "hpo".
TASK = """#!/bin/sh
exec {python} {worker} sqlite:///{db} hpo-study --trials 1 --sleep 3 --hook
"""
WORKER = Path(__file__).resolve().parent / "optuna_worker.py"


def _throttle(cluster: SlurmCluster, array: str) -> int:
    line = cluster.run(["scontrol", "show", "job", "-o", array]).splitlines()[0]
    return int(parse_job_record(line)["ArrayTaskThrottle"])


@pytest.mark.long
def test_vram_pressure_lowers_the_array_throttle_to_min_workers(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    args = daemon_args(tmp_path, slurm, ARRAYS, POLICY)
    daemon = run_daemon(script=FULL_GPU, args=args)
    db = tmp_path / "study.db"
    optuna.create_study(study_name="hpo-study", storage=f"sqlite:///{db}")
    task = TASK.format(python=sys.executable, worker=WORKER, db=db)
    env = dict(daemon.env, GPUWATCHD_JOB="hpo")
    array = slurm.submit(tmp_path / "task.sh", task, "0-23%4", env=env)

    def moves() -> list[tuple[int, int]]:
        return [
            (e["previous"], e["throttle"])
            for e in daemon.events()
            if e.get("event") == "slurm.throttle_set"
        ]

    daemon.wait_until(lambda: len(moves()) >= 2, timeout_s=90, what="two throttle moves")
    assert moves() == [(4, 3), (3, 2)]
    assert _throttle(slurm, array) == 2
    # the tasks that ran before the cut end; then Slurm runs at most 2 at once
    slurm.wait("at most 2 running", lambda: len(slurm.running(array)) <= 2, timeout_s=30)
    for _ in range(10):
        assert len(slurm.running(array)) <= 2
    # the floor (min_workers) holds: the engine's ladder decides nothing below it
    assert moves() == [(4, 3), (3, 2)]
    assert _throttle(slurm, array) == 2
    applied = [
        d for d in daemon.status()["decisions"] if d["action"] == "lower_parallelism"
    ]
    assert [d["detail"] for d in applied[:2]] == [
        f"array {array}: ArrayTaskThrottle 4 -> 3",
        f"array {array}: ArrayTaskThrottle 3 -> 2",
    ]
    # the workers ran trials of the one study, each attached under its Slurm array task
    study = optuna.load_study(study_name="hpo-study", storage=f"sqlite:///{db}")
    assert any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)

    # clean trials raise it again, step by step up to max_workers (the policies swapped
    # for the raising one, so the replayed VRAM pressure no longer cuts)
    policies = tmp_path / "policies.yaml"
    policies.write_text(RAISE_POLICY)
    reloaded = daemon.ctl("policy", "reload", str(policies))
    assert reloaded.returncode == 0, reloaded.stderr
    daemon.wait_until(lambda: len(moves()) >= 4, timeout_s=90, what="two raises")
    assert moves() == [(4, 3), (3, 2), (2, 3), (3, 4)]
    assert _throttle(slurm, array) == 4
    slurm.run(["scancel", array])


def _actions(
    cluster: SlurmCluster, jobs: list[JobInfo], cap: int = 1, node: str | None = None
) -> SlurmActions:
    actions = SlurmActions(
        Slurm(str(cluster.conf)),
        {"hpo": SlurmArrayConfig("hpo", max_workers=4, min_workers=2)},
        node=node or cluster.node,
        max_drained_nodes=cap,
        logger=structlog.get_logger("test"),
    )
    actions.observe(jobs)
    return actions


def _sleeping_array(cluster: SlurmCluster, tmp_path: Path) -> str:
    """An array of 10 tasks, 4 at once, each sleeping; its id once one runs here."""
    array = cluster.submit(tmp_path / "task.sh", "#!/bin/sh\nexec sleep 300\n", "0-9%4")
    cluster.wait("a running task", lambda: bool(cluster.running(array)))
    return array


def test_two_nodes_acting_on_one_array_converge(
    slurm: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    array = _sleeping_array(slurm, tmp_path)
    task = JobInfo("hpo", 1, 0.0, slurm=SlurmJob("99", array, 0), uid=os.getuid())
    first, second = _actions(slurm, [task]), _actions(slurm, [task])
    # both ladders go 4 -> 3: the second finds 3 already and leaves it
    assert asyncio.run(first.set_parallelism("hpo", 3, lowering=True)) == (
        f"array {array}: ArrayTaskThrottle 4 -> 3"
    )
    assert asyncio.run(second.set_parallelism("hpo", 3, lowering=True)) == (
        f"array {array}: ArrayTaskThrottle already 3 (at or below 3)"
    )
    # a late raise never undoes a lower it did not see below; clamps hold both ways
    assert "already 3" in asyncio.run(second.set_parallelism("hpo", 3, lowering=False))
    assert asyncio.run(first.set_parallelism("hpo", 0, lowering=True)).endswith("3 -> 2")
    assert asyncio.run(second.set_parallelism("hpo", 9, lowering=False)).endswith("2 -> 4")
    assert _throttle(slurm, array) == 4
    with pytest.raises(ActionRefused, match="has tasks left"):
        asyncio.run(_actions(slurm, []).set_parallelism("hpo", 3, lowering=True))
    # an array whose tasks all ended is forgotten, not acted on
    slurm.run(["scancel", array])
    slurm.wait("the array gone", lambda: not slurm.run(["squeue", "-h", "-j", array]).strip())
    with pytest.raises(ActionRefused, match="has tasks left"):
        asyncio.run(first.set_parallelism("hpo", 3, lowering=True))
    assert first.array_ids("hpo") == ()


def test_an_array_of_another_user_or_node_is_left_alone(
    slurm: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    # a member of the socket's group names someone else's array in its hello
    array = _sleeping_array(slurm, tmp_path)
    stranger = os.getuid() + 4242
    posing = JobInfo("hpo", 1, 0.0, slurm=SlurmJob("99", array, 0), uid=stranger)
    with pytest.raises(ActionRefused, match=rf"array {array}: not changed: it runs as uid"):
        asyncio.run(_actions(slurm, [posing]).set_parallelism("hpo", 2, lowering=True))
    # the array's own user, but its tasks run on another node
    own = JobInfo("hpo", 2, 0.0, slurm=SlurmJob("99", array, 0), uid=os.getuid())
    elsewhere = _actions(slurm, [own], node="gpu07")
    with pytest.raises(ActionRefused, match="no task of it is known to run on node gpu07"):
        asyncio.run(elsewhere.set_parallelism("hpo", 2, lowering=True))
    assert _throttle(slurm, array) == 4
    # once its own user named it here too, the ladder acts on it
    both = _actions(slurm, [posing, own])
    assert asyncio.run(both.set_parallelism("hpo", 2, lowering=True)).endswith("4 -> 2")
    slurm.run(["scancel", array])


def test_the_slurm_node_name_is_checked_at_startup() -> None:
    assert node_name(None, "c.yaml") == this_node()
    assert node_name("gpu07", "c.yaml") == "gpu07"
    with pytest.raises(ConfigError, match=r"^c\.yaml: slurm\.node 'gpu\[1-4\]' is not"):
        node_name("gpu[1-4]", "c.yaml")


def test_the_slurm_section_is_checked(tmp_path: Path) -> None:
    settings = parse_config(
        "slurm:\n  node: gpu07\n  timeout: 5s\n  arrays:\n    hpo: {max_workers: 4}\n", "c.yaml"
    )
    assert settings.slurm is not None
    assert settings.slurm.arrays["hpo"] == SlurmArrayConfig("hpo", 4, 1)
    assert (settings.slurm.node, settings.slurm.timeout_s) == ("gpu07", 5.0)
    for bad, where in [
        ("slurm:\n  nodes: x\n", ":2:"),
        ("slurm:\n  arrays:\n    hpo: {max_workers: 2, min_workers: 3}\n", ":3:"),
        ("slurm:\n  max_drained_nodes: -1\n", ":2:"),
        ("slurm:\n  conf: /etc/slurm/slurm.conf\n  node: gpu[1-4]\n", ":3:"),
        ("slurm:\n  node: '-gpu'\n", ":2:"),
    ]:
        with pytest.raises(ConfigError, match=where):
            parse_config(bad, "c.yaml")


# Tasks split between two daemons standing for two nodes: even tasks attach to the first
# daemon's socket, odd ones to the second's.
TWO_NODE_TASK = """#!/bin/sh
if [ $((SLURM_ARRAY_TASK_ID % 2)) -eq 0 ]; then export GPUWATCHD_SOCKET={first}; \\
else export GPUWATCHD_SOCKET={second}; fi
exec {python} -c "
import time
from gpuwatchd.hook import attach
with attach(job='hpo'):
    time.sleep(300)
"
"""


@pytest.mark.long
def test_two_daemons_on_one_array_end_on_one_throttle(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    args = daemon_args(tmp_path, slurm, ARRAYS, POLICY)
    first = run_daemon(script=FULL_GPU, args=args, name="first")
    second = run_daemon(script=FULL_GPU, args=args, name="second")
    task = TWO_NODE_TASK.format(
        first=first.socket, second=second.socket, python=sys.executable
    )
    array = slurm.submit(tmp_path / "task.sh", task, "0-9%4", env=first.env)

    def outcomes(daemon: RunningDaemon) -> list[str]:
        return [
            d["detail"]
            for d in daemon.status()["decisions"]
            if d["action"] == "lower_parallelism" and d["outcome"] == "applied"
        ]

    for daemon in (first, second):  # each node's ladder goes 4 -> 3 -> 2
        daemon.wait_until(lambda d=daemon: len(outcomes(d)) == 2, timeout_s=60, what="2 moves")
    # each node journaled its two steps: a move it made (both may read 4 at once and
    # set 3: the same value) or the throttle found moved already; never a raise
    step = re.compile(rf"array {array}: ArrayTaskThrottle (4 -> 3|3 -> 2|already [23] .*)")
    assert all(step.fullmatch(d) for d in outcomes(first) + outcomes(second))
    assert _throttle(slurm, array) == 2
    # no oscillation: at the floor neither ladder moves again, the throttle stays 2
    for _ in range(20):
        assert _throttle(slurm, array) == 2
        time.sleep(0.5)
    assert len(outcomes(first)) + len(outcomes(second)) == 4
    slurm.run(["scancel", array])
