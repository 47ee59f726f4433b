"""A crashed task of a Slurm array: its hook reports PyTorch's device-side assert, the
daemon's ``restart_study`` fails its trial and re-enqueues it once in the array's study
(``slurm.arrays.<job>.optuna``), a later task runs it, and the study ends with no trial
RUNNING; a task that dies before its hook can say a word, and a task without the hook
in an array a hello named, are classified from Slurm (state, exit code, stderr file)
and requeued by ``requeue_task``. Against the real
single-node Slurm (tests/slurm.py); the classification of Slurm's records and the bounded
read of a task's output file on their own first, and the crash scans' spacing on the
monotonic clock."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import structlog
from optuna.trial import TrialState

from conftest import RunningDaemon
from gpuwatchd.config import SlurmArrayConfig
from gpuwatchd.crash import classify_slurm_task
from gpuwatchd.model import JobInfo, SlurmJob
from gpuwatchd.slurm import Slurm, TaskRecord, parse_sacct_rows
from gpuwatchd.slurm_actions import SCAN_EVERY_S, SlurmActions, read_output_tail
from gpuwatchd.testing.clock import FakeClock
from slurm import SlurmCluster, daemon_args, one_gpu, slurm  # noqa: F401  (the module's cluster)

ASSERT_TAIL = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 9, in <module>\n'
    "RuntimeError: CUDA error: device-side assert triggered\n"
)
OOM_KILL = (
    "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=812.batch. Some of your "
    "processes may have been killed by the cgroup out-of-memory handler.\n"
)


@pytest.mark.parametrize(
    ("state", "returncode", "tail", "kind"),
    [
        ("FAILED", 1, ASSERT_TAIL, "cuda_assert"),
        (
            "FAILED",
            1,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n",
            "cuda_oom",
        ),
        ("OUT_OF_MEMORY", 0, "", "host_oom"),  # the cgroup's OOM kill, nothing printed
        ("FAILED", -9, OOM_KILL, "host_oom"),
        ("FAILED", 137, "", "host_oom"),  # a shell's report of its child's SIGKILL
        ("FAILED", 2, "ValueError: bad config\n", "other"),
    ],
)
def test_a_slurm_task_is_classified_from_its_state_exit_and_stderr(
    state: str, returncode: int, tail: str, kind: str
) -> None:
    info = classify_slurm_task(state, returncode, tail)
    assert info.kind == kind
    assert info.reason.startswith(f"Slurm {state}: ")
    if kind == "cuda_assert":
        assert info.evidence == "RuntimeError: CUDA error: device-side assert triggered"
    if tail == OOM_KILL:
        assert info.evidence.startswith("slurmstepd: error: Detected 1 oom-kill event(s)")


def test_exit_codes_and_output_paths_of_a_task_record() -> None:
    task = TaskRecord("815", "812", 3, "FAILED", 0, 9, 1, 1000, "n1", "/o/%A_%a.out", "/e/%j.err")
    assert (task.label, task.returncode) == ("812_3", -9)
    assert task.output_paths() == ("/e/815.err", "/o/812_3.out")
    odd = TaskRecord("815", "812", 3, "FAILED", 1, 0, stdout_path="/o/%u.out", stderr_path="rel")
    assert (odd.returncode, odd.output_paths()) == (1, ())  # %u unknown here; not absolute
    rows = parse_sacct_rows("812_3|OUT_OF_MEMORY|0:125\n812_3.batch|CANCELLED by 0|0:9\n")
    assert rows == [("812_3", "OUT_OF_MEMORY", "0:125"), ("812_3.batch", "CANCELLED", "0:9")]
    accounted = task.accounted(rows)
    assert (accounted.state, accounted.returncode) == ("OUT_OF_MEMORY", -125)
    # the job row FAILED, exit 1; its batch step killed by the cgroup's OOM handler
    steps = [("812_3", "FAILED", "1:0"), ("812_3.batch", "OUT_OF_MEMORY", "0:9")]
    assert (task.accounted(steps).state, task.accounted(steps).returncode) == ("OUT_OF_MEMORY", 1)
    assert task.accounted([("999_1", "COMPLETED", "0:0")]) == task  # not its rows
    with pytest.raises(ValueError):
        parse_sacct_rows("812_3|FAILED\n")


def test_a_tasks_output_is_read_bounded_and_only_from_its_owners_file(tmp_path: Path) -> None:
    out = tmp_path / "task.out"
    out.write_text("x" * 100_000 + "\n" + ASSERT_TAIL)
    uid = os.getuid()
    tail = read_output_tail(str(out), uid, max_bytes=4096)
    assert len(tail) == 4096 and tail.endswith(ASSERT_TAIL)
    with pytest.raises(PermissionError, match="owned by uid"):
        read_output_tail(str(out), uid + 1)
    link = tmp_path / "link.out"
    link.symlink_to(out)
    with pytest.raises(OSError):
        read_output_tail(str(link), uid)  # a link is never followed
    with pytest.raises(PermissionError, match="not a regular file"):
        read_output_tail(str(tmp_path), uid)


POLICY = """
policies:
  - name: crashed-trials-restart
    when:
      job_crashed: {kind: [cuda_assert, cuda_oom]}
    do:
      - restart_study: {max_retries: 3}
"""

# Task 0's trial dies of a device-side assert (the text PyTorch raises); the others run
# one trial each, the first of them after the crash running the re-enqueued one.
TASK = """#!/bin/sh
exec {python} -c "
import os, sys, time
import optuna
from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective
study = optuna.load_study(study_name='hpo-study', storage='sqlite:///{db}')
def objective(trial):
    x = trial.suggest_float('x', 0, 1)
    if os.environ['SLURM_ARRAY_TASK_ID'] == '0':
        raise RuntimeError('CUDA error: device-side assert triggered')
    return x
with attach(study='hpo-study') as watch:
    study.optimize(watch_objective(watch, objective), n_trials=1,
                   callbacks=[StudyCallback(watch)])
"
"""


def _study_daemon(
    cluster: SlurmCluster,
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
    policies: str,
) -> tuple[RunningDaemon, Path]:
    """A daemon with ``policies`` acting on array job ``hpo`` of ``cluster``, whose
    study ``hpo-study`` (one retry) it creates in SQLite; the daemon and the database."""
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    optuna.create_study(study_name="hpo-study", storage=storage)
    array = {
        "max_workers": 2,
        "optuna": {"storage": storage, "study": "hpo-study", "max_retries": 1},
    }
    args = daemon_args(tmp_path, cluster, {"arrays": {"hpo": array}}, policies)
    return run_daemon(script=one_gpu(20), args=args), db


def _outcomes(daemon: RunningDaemon, action: str) -> list[dict[str, object]]:
    """``daemon``'s decisions of ``action`` carried out so far (outcome not ``pending``)."""
    return [
        d
        for d in daemon.status()["decisions"]
        if d["action"] == action and d["outcome"] != "pending"
    ]


def test_a_device_side_assert_fails_and_requeues_the_trial_once(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
) -> None:
    daemon, db = _study_daemon(slurm, run_daemon, tmp_path, POLICY)
    storage = f"sqlite:///{db}"
    task = TASK.format(python=sys.executable, db=db)
    env = dict(daemon.env, GPUWATCHD_JOB="hpo")
    # task 0 alone first, so that its re-enqueued trial is there for the later tasks
    first = slurm.submit(tmp_path / "crash.sh", task, "0", env=env)

    [restart] = daemon.wait_until(
        lambda: _outcomes(daemon, "restart_study"), timeout_s=60, what="a restart_study outcome"
    )
    assert restart["outcome"] == "applied", restart
    assert restart["params"]["crash_kind"] == "cuda_assert"
    assert restart["detail"] == "trial 0 re-enqueued as trial 1 (retry 1/1)"
    slurm.wait_gone(first, "task 0 gone")
    rest = slurm.submit(tmp_path / "rest.sh", task.replace("== '0'", "== 'never'"), "1-2", env=env)
    slurm.wait_gone(rest, "the array done")

    study = optuna.load_study(study_name="hpo-study", storage=storage)
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TrialState.FAIL, 1: TrialState.COMPLETE, 2: TrialState.COMPLETE}
    assert study.trials[1].params == study.trials[0].params  # the re-enqueued one
    assert TrialState.RUNNING not in states.values()
    # one death, one crash: Slurm's record of the FAILED task adds none to the hook's
    assert not [e for e in daemon.events() if e.get("event") == "slurm.task_crashed"]


def test_slurm_records_a_failed_task_and_this_cluster_keeps_no_accounting(
    slurm: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    script = (
        "#!/bin/sh\necho 'RuntimeError: CUDA error: device-side assert triggered' >&2\nexit 3\n"
    )
    array = slurm.submit(tmp_path / "fail.sh", script, "0")
    slurm.wait_gone(array, "the task done")
    client = Slurm(str(slurm.conf))
    [task] = asyncio.run(client.array_tasks(array))
    assert (task.label, task.state, task.returncode) == (f"{array}_0", "FAILED", 3)
    assert (task.user_id, task.batch_host) == (os.getuid(), slurm.node)
    assert task.output_paths() == (f"{tmp_path}/fail.sh.0.out",)
    assert asyncio.run(client.task(task.label)) == task
    assert asyncio.run(client.accounting(task.label)) is None  # no slurmdbd: no accounting


def test_crash_scans_are_spaced_on_the_monotonic_clock_whatever_the_wall_clock_does(
    slurm: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    # a task of an array a hello named here ends FAILED: the second scan that reads it
    # ended posts its crash, stamped with the tick's wall-clock time; the scans are
    # SCAN_EVERY_S apart on the injected monotonic clock, so a wall clock stepped an hour
    # on starts none early and one stepped back holds none back
    array = slurm.submit(tmp_path / "fail.sh", "#!/bin/sh\nexit 3\n", "0")
    slurm.wait_gone(array, "the task done")
    clock = FakeClock()
    actions = SlurmActions(
        Slurm(str(slurm.conf)),
        {"hpo": SlurmArrayConfig("hpo", max_workers=2)},
        node=slurm.node,
        max_drained_nodes=1,
        logger=structlog.get_logger("test"),
        clock=clock,
    )
    hello = JobInfo("hpo", 4242, 0.0, slurm=SlurmJob(array, array, 0), uid=os.getuid())
    actions.observe([hello])

    async def crashes_posted(wall_s: float, monotonic_step_s: float) -> list[float]:
        clock.advance(monotonic_step_s)
        actions.start_scan(wall_s)
        scans = [t for t in asyncio.all_tasks() if t.get_name() == "gpuwatchd-slurm-scan"]
        await asyncio.gather(*scans)
        return [event.timestamp_s for event in actions.take_events()]

    async def scan_three_ticks() -> list[list[float]]:
        steps = [(1_000.0, 0.0), (4_600.0, 0.0), (500.0, SCAN_EVERY_S)]
        return [await crashes_posted(wall_s, step_s) for wall_s, step_s in steps]

    # the first scan sees it ended; the wall clock's hour starts no scan; the monotonic
    # clock's SCAN_EVERY_S does, though the wall clock went back
    assert asyncio.run(scan_three_ticks()) == [[], [], [500.0]]


# Task 0 dies of a device-side assert in its first run ({die}: with or without its hook's
# word); requeued (SLURM_RESTART_COUNT=1) it runs the re-enqueued trial.
REQUEUED_TASK = """#!/bin/sh
exec {python} -c "
import os, sys, time
import optuna
from gpuwatchd.hook import attach
from gpuwatchd.hook.optuna import StudyCallback, watch_objective
study = optuna.load_study(study_name='hpo-study', storage='sqlite:///{db}')
def objective(trial):
    x = trial.suggest_float('x', 0, 1)
    if os.environ.get('SLURM_RESTART_COUNT', '0') == '0':
        for _ in range(20):  # steps: the hook's reports name the trial running
            watch.record_step(0.1, 0.0, 8)
            time.sleep(0.1)
        {die}
    return x
with attach(study='hpo-study') as watch:
    study.optimize(watch_objective(watch, objective), n_trials=1,
                   callbacks=[StudyCallback(watch)])
"
"""

REQUEUE_POLICY = """
policies:
  - name: crashed-tasks
    when:
      job_crashed: {kind: [cuda_assert]}
    do:
      - restart_study: {max_retries: 1}
      - requeue_task: {max_requeues: 1}
"""


# The process ends at once after printing PyTorch's assert (as when the assert aborts it):
# no crash report from the hook; or the hook reports the RuntimeError it raised.
SILENT = (
    "print('RuntimeError: CUDA error: device-side assert triggered', file=sys.stderr); "
    "sys.stderr.flush(); os._exit(1)"
)
REPORTED = "raise RuntimeError('CUDA error: device-side assert triggered')"


# The reported variant is `long` (make test-long): the hook's crash path is proven by the
# first test here, Slurm's record adding none to it too; this adds the requeue by hello.
@pytest.mark.parametrize(
    "die",
    [
        pytest.param(SILENT, id="silent"),
        pytest.param(REPORTED, id="reported", marks=pytest.mark.long),
    ],
)
def test_a_task_dead_of_an_assert_has_its_trial_retried_and_is_requeued(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
    die: str,
) -> None:
    daemon, db = _study_daemon(slurm, run_daemon, tmp_path, REQUEUE_POLICY)
    storage = f"sqlite:///{db}"
    env = dict(daemon.env, GPUWATCHD_JOB="hpo")
    job = slurm.submit(
        tmp_path / "task.sh",
        REQUEUED_TASK.format(python=sys.executable, db=db, die=die),
        "0",
        env=env,
    )

    def outcomes() -> dict[str, dict[str, object]] | None:
        done = {
            str(d["action"]): d for d in daemon.status()["decisions"] if d["outcome"] != "pending"
        }
        return done if {"restart_study", "requeue_task"} <= done.keys() else None

    done = daemon.wait_until(outcomes, timeout_s=90, what="restart_study and requeue_task")
    requeue, restart = done["requeue_task"], done["restart_study"]
    assert requeue["outcome"] == "applied", requeue
    # the crash names its task: read from Slurm, or as the crashed hook's hello named it
    assert requeue["params"]["slurm_job"] == f"{job}_0"
    assert requeue["params"]["crash_kind"] == "cuda_assert"
    assert str(requeue["detail"]).startswith(f"task {job}_0 requeued (FAILED, exit 1:0)")
    failed = "marked FAIL, " if die == SILENT else ""  # RUNNING, or failed by Optuna
    assert (restart["outcome"], restart["detail"]) == (
        "applied",
        f"trial 0 {failed}re-enqueued as trial 1 (retry 1/1)",
    )
    assert requeue["finished_at_s"] >= restart["finished_at_s"]  # it waited for the trial
    slurm.wait_gone(job, "the requeued task done", timeout_s=90)
    record = slurm.run(["scontrol", "show", "job", "-o", f"{job}_0"])
    assert "Restarts=1 " in record and "JobState=COMPLETED " in record

    study = optuna.load_study(study_name="hpo-study", storage=storage)
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TrialState.FAIL, 1: TrialState.COMPLETE}
    assert study.trials[1].params == study.trials[0].params  # the re-enqueued one
    crashed = [e for e in daemon.events() if e.get("event") == "slurm.task_crashed"]
    expected = [(f"{job}_0", "cuda_assert")] if die == SILENT else []  # one death, one crash
    assert [(e["task"], e["crash_kind"]) for e in crashed] == expected


# Task 0 attaches through the hook (the daemon learns the array from its hello) and
# lives a while; task 1 runs no hook and its batch script is SIGKILLed, as the kernel's
# OOM killer does, in its first run ({when}: only then, or in every run).
PLAIN_TASK = """#!/bin/sh
if [ "$SLURM_ARRAY_TASK_ID" = 1 ]; then
    sleep 4
    {when}kill -9 $$
    exit 0
fi
exec {python} -c "
import time
from gpuwatchd.hook import attach
with attach():
    time.sleep(10)
"
"""

OOM_POLICY = """
policies:
  - name: killed-tasks
    when:
      job_crashed: {kind: [host_oom]}
    do:
      - requeue_task: {max_requeues: 1}
"""


FIRST_RUN = '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] && '


# every-run is `long` (make test-long): max_requeues's refusal is also proven on a fake
# (tests/test_action_requeue_task.py); here it is the real Restarts that stops it.
@pytest.mark.parametrize(
    "when",
    [pytest.param(FIRST_RUN, id="once"), pytest.param("", id="every-run", marks=pytest.mark.long)],
)
def test_a_plain_task_of_a_known_array_killed_by_sigkill_is_a_host_oom_and_requeued(
    slurm: SlurmCluster,  # noqa: F811
    run_daemon: Callable[..., RunningDaemon],
    tmp_path: Path,
    when: str,
) -> None:
    args = daemon_args(tmp_path, slurm, {"arrays": {"hpo": {"max_workers": 2}}}, OOM_POLICY)
    daemon = run_daemon(script=one_gpu(20), args=args)
    env = dict(daemon.env, GPUWATCHD_JOB="hpo")
    job = slurm.submit(
        tmp_path / "plain.sh", PLAIN_TASK.format(python=sys.executable, when=when), "0-1", env=env
    )

    def requeued() -> list[dict[str, object]]:
        return _outcomes(daemon, "requeue_task")

    requeue = daemon.wait_until(requeued, timeout_s=90, what="a requeue_task outcome")[0]
    assert requeue["outcome"] == "applied", requeue
    params = requeue["params"]
    assert (params["slurm_job"], params["crash_kind"], params["pid"]) == (
        f"{job}_1",
        "host_oom",
        None,  # no hook: no process known
    )
    assert str(requeue["detail"]).startswith(f"task {job}_1 requeued (FAILED, exit 0:9)")
    slurm.wait_gone(job, "the array done", timeout_s=90)
    record = slurm.run(["scontrol", "show", "job", "-o", f"{job}_1"])
    assert "Restarts=1 " in record
    if when == FIRST_RUN:
        assert "JobState=COMPLETED " in record
        assert len(requeued()) == 1
        return
    # killed again in its requeued run: a second crash, and max_requeues says no
    assert "JobState=FAILED " in record
    again = daemon.wait_until(lambda: requeued()[1:], timeout_s=30, what="a second outcome")
    assert [(d["outcome"], d["detail"]) for d in again] == [
        ("refused", f"task {job}_1 was requeued 1 time(s) already (max_requeues 1)")
    ]
