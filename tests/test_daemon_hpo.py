"""Managed jobs wired into the daemon: a real ``gpuwatchd run --config`` on the fake NVML
(two GPUs) supervising the example Optuna worker (``examples/hpo/worker.py``: real
PyTorch CPU trials, real Optuna on SQLite, the hook's Optuna integration).

The worker's ``--fault-once PATH:KIND`` makes exactly one process die as PyTorch on a GPU
does, with the recorded outputs of ``tests/data/crashes``: ``assert`` (the kernel's assert
lines, then an uncaught ``torch.AcceleratorError``: Optuna fails the trial, exit status 1)
and ``abort`` (``terminate called ... c10::CUDAError``, SIGABRT: the trial stays RUNNING
until the daemon fails it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, RunningDaemon, restart_on_same_state
from gpuwatchd.journal import JOURNAL_FILENAME, Journal
from gpuwatchd.model import Decision
from hpo_env import (
    CRASHES,
    TWO_EQUAL_GPUS,
    decisions,
    make_study,
    managed_workers,
    restart_study_policy,
    states,
    trials,
    worker_command,
    write_config,
)

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_placed_crashes_classified_trials_recovered_workers_relaunched(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "hpo")
    command = worker_command(
        url,
        "hpo",
        "--target", "8",
        "--steps", "20",
        "--step-time", "0.05",
        "--faults", str(CRASHES),
        "--head-min", "10",  # out of the poisoned corner: exactly the two faults below
        "--fault-once", f"{tmp_path / 'assert.once'}:assert",
        "--fault-once", f"{tmp_path / 'abort.once'}:abort",
    )  # fmt: skip
    config = write_config(
        tmp_path / "gpuwatchd.json",
        {
            "hpo": {
                "command": command,
                "cwd": str(tmp_path),
                "workers": 2,
                "gpus": "auto",
                "optuna": {"storage": url, "study": "hpo", "max_retries": 2},
                "restart": {"backoff": "0.3s", "max_backoff": "1s"},
            }
        },
    )
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy())
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    state_dir = daemon.workdir / "state"

    # Placement: one worker per GPU (both idle: most free memory per worker), logged.
    placed = daemon.wait_until(
        lambda: [e for e in daemon.events() if e["event"] == "worker placed"][:2],
        what="two placements",
    )
    assert sorted(e["gpu"] for e in placed) == [0, 1]
    assert all("most free memory per worker" in e["reason"] for e in placed)
    first = managed_workers(daemon.status(), "hpo")
    assert sorted(w["gpu"] for w in first) == [0, 1]
    jobs = daemon.ctl("jobs")
    assert jobs.returncode == 0, jobs.stderr
    assert "Managed workers" in jobs.stdout and "most free memory" in jobs.stdout

    # Both first trials die: each crash is classified, decided on once, recovered.
    def restart_decisions() -> list[dict[str, Any]]:
        done = [
            d
            for d in decisions(state_dir)
            if d["action"] == "restart_study" and d["outcome"] != "pending"
        ]
        return done if len(done) == 2 else []

    made = daemon.wait_until(restart_decisions, timeout_s=90, what="two restart_study outcomes")
    crashed = [e for e in daemon.events() if e["event"] == "worker crashed"]
    assert sorted(e["kind"] for e in crashed) == ["cuda_assert", "cuda_assert"]
    assert {e["pid"] for e in crashed} == {d["params"]["pid"] for d in made}
    assert all(d["outcome"] == "applied" for d in made), made
    assert all("re-enqueued as trial" in d["detail"] for d in made), made

    # The study finishes: every trial ended, each dead trial FAIL with one retry that ran.
    daemon.wait_until(
        lambda: all(w["state"] == "stopped" for w in managed_workers(daemon.status(), "hpo")),
        timeout_s=120,
        what="the study to finish",
    )
    by_number = {t.number: t for t in trials(url, "hpo")}
    assert set(states(url, "hpo")) <= {"COMPLETE", "PRUNED", "FAIL"}
    dead = [d["params"]["trial_number"] for d in made]
    assert all(isinstance(n, int) for n in dead), made
    for number in dead:
        assert by_number[number].state.name == "FAIL"
        (retry,) = [t for t in by_number.values() if t.user_attrs.get("gpuwatchd:parent") == number]
        assert retry.user_attrs["gpuwatchd:retry"] == 1
        assert retry.user_attrs["gpuwatchd:retry_reason"] == "cuda_assert"
        assert retry.state.name in ("COMPLETE", "PRUNED")
    # The SIGABRT one was still RUNNING: the daemon failed it (and said why).
    reasons = [by_number[n].user_attrs.get("gpuwatchd:failed_reason") for n in dead]
    assert reasons.count("cuda_assert") == 1, reasons

    # Relaunched: both slots restarted once, as new processes, and show the crash kind.
    final = managed_workers(daemon.status(), "hpo")
    assert sorted(w["restarts"] for w in final) == [1, 1]
    assert all(w["last_crash_kind"] == "cuda_assert" for w in final)
    started = [e["pid"] for e in daemon.events() if e["event"] == "worker started"]
    assert len(started) == 4 and len(set(started)) == 4
    assert daemon.stop() == 0


def test_leave_then_adopt_then_stop(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """``on_daemon_stop: leave`` keeps the worker running through a daemon stop; the next
    daemon adopts it (same pid, shown as adopted) and its own stop (``stop``) ends it."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    job = {"command": sleeper, "workers": 1, "gpus": [1], "on_daemon_stop": "leave"}
    config = write_config(tmp_path / "leave.json", {"sleepy": job})
    first = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)], name="first")
    (worker,) = first.wait_until(
        lambda: [w for w in managed_workers(first.status(), "sleepy") if w["pid"]],
        what="the worker",
    )
    assert worker["gpu"] == 1 and "fixed list" in worker["placement_reason"]
    pid = worker["pid"]
    assert first.stop() == 0
    assert _alive(pid), "on_daemon_stop: leave must leave the worker running"

    config = write_config(tmp_path / "stop.json", {"sleepy": {**job, "on_daemon_stop": "stop"}})
    second = restart_on_same_state(
        run_daemon, first, ["--config", str(config)], script=TWO_EQUAL_GPUS
    )
    (adopted,) = managed_workers(second.status(), "sleepy")
    assert (adopted["pid"], adopted["adopted"], adopted["state"]) == (pid, True, "running")
    assert any(e["event"] == "worker adopted" and e["pid"] == pid for e in second.events())
    assert second.stop() == 0
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "on_daemon_stop: stop must end the worker"


def test_a_bad_job_config_names_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "jobs:\n  hpo:\n    command: [python]\n    restart:\n      backoff: 5 parsecs\n"
    )
    result = subprocess.run(
        [str(BIN / "gpuwatchd"), "run", "--config", str(config), "--socket", "s.sock"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert f"{config}:5:" in result.stderr and "restart.backoff" in result.stderr


def test_a_worker_dying_while_the_daemon_is_down_has_its_trial_retried(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """The daemon is SIGKILLed; meanwhile the worker starts a new trial (its hook cannot
    reach anyone) and dies of a device-side assert in it. ``workers.json`` still names the
    worker's older trial: the restarted daemon finds the trial it died in through the
    study itself (``gpuwatchd:worker_id``, written by the hook) and retries that one."""
    url = make_study(tmp_path, "hpo")
    gate = tmp_path / "fault.now"
    command = worker_command(
        url,
        "hpo",
        "--target", "6",
        "--steps", "20",
        "--step-time", "0.05",
        "--faults", str(CRASHES),
        "--head-min", "10",
        "--fault-when", f"{gate}:assert",
    )  # fmt: skip
    job = {
        "command": command,
        "cwd": str(tmp_path),
        "workers": 1,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "hpo", "max_retries": 2},
        "restart": {"backoff": "0.3s", "max_backoff": "1s"},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy())
    args = ["--config", str(config), "--policies", str(policies)]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="first")
    state_dir = first.workdir / "state"
    workers_json = state_dir / "jobs" / "hpo" / "workers.json"

    def recorded() -> dict[str, Any] | None:
        data = json.loads(workers_json.read_text()) if workers_json.exists() else {}
        entries = [w for w in data.get("workers", []) if w.get("trial_number") is not None]
        return entries[0] if entries else None

    entry = first.wait_until(recorded, timeout_s=60, what="a trial recorded in workers.json")
    pid, worker_id, old_trial = entry["pid"], entry["worker_id"], entry["trial_number"]
    assert worker_id.startswith("hpo.0.")
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    gate.write_text("")
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the worker did not die of the fault"
    assert json.loads(workers_json.read_text())["workers"][0]["trial_number"] == old_trial
    (dead,) = [t for t in trials(url, "hpo") if t.state.name == "FAIL"]
    assert dead.number > old_trial, "the fault must strike in a trial the daemon never heard of"
    assert dead.user_attrs["gpuwatchd:worker_id"] == worker_id

    second = restart_on_same_state(run_daemon, first, args, script=TWO_EQUAL_GPUS)
    (made,) = second.wait_until(
        lambda: [
            d
            for d in decisions(state_dir)
            if d["action"] == "restart_study" and d["outcome"] != "pending"
        ],
        timeout_s=60,
        what="the restart_study decision",
    )
    assert made["params"]["trial_number"] == dead.number, made
    assert made["outcome"] == "applied" and "re-enqueued as trial" in made["detail"], made
    gone = [e for e in second.events() if e["event"] == "worker ended while gpuwatchd was down"]
    assert [(e["pid"], e["kind"]) for e in gone] == [(pid, "cuda_assert")]
    located = [e for e in second.events() if e["event"] == "crashed trial from the study"]
    assert [(e["trial"], e["previous"]) for e in located] == [(dead.number, old_trial)]

    second.wait_until(
        lambda: all(w["state"] == "stopped" for w in managed_workers(second.status(), "hpo")),
        timeout_s=120,
        what="the study to finish",
    )
    by_number = {t.number: t for t in trials(url, "hpo")}
    assert set(states(url, "hpo")) <= {"COMPLETE", "PRUNED", "FAIL"}
    (retry,) = [
        t for t in by_number.values() if t.user_attrs.get("gpuwatchd:parent") == dead.number
    ]
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "cuda_assert"
    assert retry.state.name in ("COMPLETE", "PRUNED")
    assert retry.params == dead.params
    assert second.stop() == 0


ATTACHED_UNTIL_GATE = """\
import os, signal, sys, time
from gpuwatchd.hook import attach

gate, code = sys.argv[1], int(sys.argv[2])
with attach():
    while not os.path.exists(gate):
        time.sleep(0.05)
    if code > 0:
        raise SystemExit(code)  # an error exit inside the block: no clean detach
if code < 0:  # a second block after a clean first one, killed inside it
    with attach():
        time.sleep(1.5)
        os.kill(os.getpid(), -code)
"""


def test_an_adopted_worker_that_exits_cleanly_is_not_restarted(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A restarted daemon is not the parent of an adopted worker: it reads the exit status
    its launcher shim wrote. Exit 0 is the end (stopped, not restarted, no crash), while
    the adopted workers that exit with an error inside their block, or attach again after
    a clean block and are killed, count as crashes."""
    script = tmp_path / "attached.py"
    script.write_text(ATTACHED_UNTIL_GATE)
    codes = {"clean": 0, "error": 3, "again": -signal.SIGKILL}
    gates = {name: tmp_path / f"{name}.gate" for name in codes}
    job = {"workers": 1, "gpus": [0], "on_daemon_stop": "leave"}
    jobs = {
        name: {**job, "command": [sys.executable, str(script), str(gates[name]), str(code)]}
        for name, code in codes.items()
    }
    config = write_config(tmp_path / "jobs.json", jobs)
    first = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)], name="first")
    pids = {
        name: first.wait_until(
            lambda name=name: managed_workers(first.status(), name)[0]["pid"],
            what=f"the {name} worker",
        )
        for name in jobs
    }
    assert first.stop() == 0
    second = restart_on_same_state(
        run_daemon, first, ["--config", str(config)], script=TWO_EQUAL_GPUS
    )
    for name, pid in pids.items():
        (adopted,) = managed_workers(second.status(), name)
        assert (adopted["pid"], adopted["adopted"]) == (pid, True)
    # Both hooks reconnect to the new daemon before their processes end.
    second.wait_until(
        lambda: {j["pid"] for j in second.status()["jobs"]} >= set(pids.values()),
        timeout_s=30,
        what="both hooks attached to the second daemon",
    )
    for gate in gates.values():
        gate.write_text("")

    def ended(name: str) -> dict[str, Any] | None:
        (worker,) = managed_workers(second.status(), name)
        return worker if worker["pid"] != pids[name] else None

    clean = second.wait_until(lambda: ended("clean"), timeout_s=30, what="clean worker's end")
    assert (clean["state"], clean["pid"], clean["restarts"]) == ("stopped", None, 0)
    assert clean["note"] == "exited with status 0"  # its launcher shim's exit file says
    for name in ("error", "again"):
        crash = second.wait_until(lambda n=name: ended(n), timeout_s=30, what=f"{name}'s end")
        assert crash["state"] in ("backoff", "running") and crash["last_crash_kind"] == "other"
    events = second.events()
    crashed = [e["job"] for e in events if e["event"] == "worker crashed"]
    assert sorted(crashed) == ["again", "error"]
    exited = [e for e in events if e["event"] == "worker exited"]
    assert [(e["job"], e["pid"], e["status"]) for e in exited] == [("clean", pids["clean"], 0)]
    assert not [e for e in events if e["event"] == "worker started" and e["job"] == "clean"]
    assert second.stop() == 0


def test_a_restart_study_cut_short_by_a_kill_is_finished_once_at_the_next_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A daemon killed between journaling a ``restart_study`` (pending) and carrying it
    out leaves it ``unknown``; its crash has left the crash ledger. The next daemon
    re-runs the idempotent study part, records the real outcome, and does it once."""
    import optuna
    from optuna.trial import TrialState

    url = make_study(tmp_path, "hpo")
    study = optuna.load_study(study_name="hpo", storage=url)
    dead = study.ask()
    dead.suggest_float("lr", 1e-4, 1e-1, log=True)
    study.tell(dead, state=TrialState.FAIL)  # Optuna failed it: the worker died after
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    params = {
        "job": "hpo",
        "pid": 4242,
        "crash_kind": "cuda_assert",
        "gpu_index": 0,
        "trial_number": dead.number,
        "max_retries": 2,
    }
    with Journal.open(state_dir / JOURNAL_FILENAME) as journal:
        decision = Decision(
            "crashed-trials-restart", "restart_study", params, time.time() - 5, (), job="hpo"
        )
        journal.record_tick(time.time() - 5, decisions=[decision])
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    job = {
        "command": sleeper,
        "workers": 1,
        "gpus": [0],
        "optuna": {"storage": url, "study": "hpo", "max_retries": 2},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    args = ["--config", str(config), "--state-dir", str(state_dir)]

    def retries() -> list[Any]:
        every = trials(url, "hpo")
        return [t for t in every if t.user_attrs.get("gpuwatchd:parent") == dead.number]

    for name in ("first", "second"):
        daemon = run_daemon(script=TWO_EQUAL_GPUS, args=args, name=name)
        (made,) = decisions(state_dir)
        resumed = [e for e in daemon.events() if e["event"] == "interrupted decision resumed"]
        assert daemon.stop() == 0
        (retry,) = retries()
        assert made["outcome"] == "applied", made
        assert made["detail"] == (
            f"resumed after a daemon restart: trial {dead.number} re-enqueued as trial "
            f"{retry.number} (retry 1/2)"
        )
        assert retry.state.name == "WAITING"  # its params wait in Optuna's fixed_params
        assert retry.system_attrs["fixed_params"] == dead.params
        assert len(resumed) == (1 if name == "first" else 0)
