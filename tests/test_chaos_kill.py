"""Issue 20's acceptance chaos test: an unattended Optuna study under ``gpuwatchd run``
survives trials that die as PyTorch does and the daemon killed *together with all its
workers*, twice, as systemd kills a unit's control group (or the kernel's OOM killer the
daemon's cgroup).

Everything is real but NVML (the fake, two GPUs): ``gpuwatchd run --config --policies``
subprocesses on one state directory and socket, three managed workers started by the
subprocess launcher, each a process of ``tests/chaos_worker.py`` (a client written as
Optuna's examples are: the storage on the command line, ``study.optimize(objective,
n_trials=N, callbacks=[MaxTrialsCallback(TARGET, states=(TrialState.COMPLETE,))])``, the
hook per process as docs/hook.md shows it on odd slots and per trial, as a Trainer per
trial does, on even ones), a real SQLite study without heartbeats.

Chaos, all seeded by ``$GPUWATCHD_CHAOS_SEED`` (see hpo_env.chaos_seeds; printed with
every failure, so a failure replays):

* the study's size: ``TARGET`` COMPLETE trials, 60 with ``$GPUWATCHD_CHAOS_SEED`` set
  (``make test-long``, a replay), 30 without (``make test``, seed 1), the kill points
  scaled to it (hpo_env.chaos_size): both kills either way;
* about 15 % of the trials die mid-trial, drawn per trial number: the recorded
  device-side assert text then ``os._exit(1)``, the ``c10::CUDAError`` abort text then
  ``os.abort()``, or the CUDA OOM text then ``os._exit(1)``; trials take 0.2-0.5 s;
* kill 1: the worker that starts the seeded trial ``PAUSE_AT`` stops between Optuna's
  ask (the trial is RUNNING in the storage) and the hook's first word about it (no
  report, no ``gpuwatchd:worker_id``); the test then freezes the daemon and every worker
  (SIGSTOP), SIGKILLs them all, and starts a daemon on the same state dir and socket;
* kill 2: the same once the study has a seeded number of COMPLETE trials.

Policies: ``restart_study`` (``max_retries`` 3) on ``cuda_assert``/``cuda_oom`` crashes.
The job's restart settings keep the defaults of ``crash_loop``/``min_uptime`` (a short
life with trials finished is no crash loop) and only shorten the backoff and raise the
budget (not what is tested here).

What a user checks at the end (hpo_env.study_problems): the study has ``TARGET`` COMPLETE
trials, none RUNNING or WAITING, no failure retried more than once, no chain longer than
``max_retries``; and no worker slot given up (``failed``). The run is bounded by a
generous deadline on waiting (not a timing check); it also stops waiting once no worker
runs and the study stays unchanged for ``STALL_S``, the stall a user would find. A failure
says the seed and how to replay it, the kills, the study's counts, the trials left behind,
the FAIL trials nothing retried (said, not checked), each worker's state and note, how the
workers ended (the daemons' log lines) and the last daemon's last log lines.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import RunningDaemon, restart_on_same_state
from hpo_env import (
    CHAOS_WORKER,
    CRASHES,
    TWO_EQUAL_GPUS,
    ChaosSize,
    chaos_replay,
    chaos_report,
    chaos_seeds,
    chaos_size,
    make_study,
    managed_workers,
    python_on_path,
    restart_study_policy,
    settle,
    study_problems,
    trials,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

STUDY = "chaos"
SIZE = chaos_size(
    full=ChaosSize(target=60, pause=(6, 16), kill=(28, 40)),
    small=ChaosSize(target=30, pause=(4, 12), kill=(16, 26)),
)
"""The study's size: the smaller one in ``make test`` (no seed given)."""
TARGET = SIZE.target
WORKERS = 3
MAX_RETRIES = 3
CRASH_RATE = 0.15
DEADLINE_S = 300.0
"""How long the whole run may wait for the study (a bound on waiting, not a timing check)."""
STALL_S = 60.0
"""No worker running and the study unchanged this long: stalled, stop waiting."""
KILL_WAIT_S = 120.0
"""How long a kill waits for its moment (the paused trial, the COMPLETE count)."""


def _together(daemon: RunningDaemon) -> list[psutil.Process]:
    """The daemon and every process of its job: its descendants and any process that
    talks to its socket (``GPUWATCHD_SOCKET``, e.g. a worker adopted from an earlier daemon)."""
    root = psutil.Process(daemon.process.pid)
    found = {root.pid: root}
    with contextlib.suppress(psutil.Error):
        found.update((p.pid, p) for p in root.children(recursive=True))
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("GPUWATCHD_SOCKET") == str(daemon.socket):
                found[proc.pid] = proc
    return list(found.values())


def _gone(proc: psutil.Process) -> bool:
    """Ended: reaped, or a zombie its new parent has not reaped yet."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_together(daemon: RunningDaemon) -> int:
    """Freeze the daemon and all its workers (SIGSTOP, until no new process appears), then
    SIGKILL them all, so that none observes another's death; wait until all are gone.
    Returns how many processes were killed."""
    frozen: dict[int, psutil.Process] = {}
    while True:
        new = [p for p in _together(daemon) if p.pid not in frozen]
        if not new:
            break
        for proc in new:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)
            frozen[proc.pid] = proc
    for proc in frozen.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    daemon.process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in frozen.values()):
        assert time.monotonic() < deadline, "killed processes did not end"
        time.sleep(0.05)
    return len(frozen)


def _trial(url: str, number: int) -> Any:
    return next((t for t in trials(url, STUDY) if t.number == number), None)


def _counts(url: str) -> Counter[str]:
    return Counter(t.state.name for t in trials(url, STUDY))


def _wait(
    what: str, predicate: Callable[[], Any], daemon: RunningDaemon, report: Callable[[], str]
) -> Any:
    """``daemon.wait_until(predicate)``, at most :data:`KILL_WAIT_S`; a failure adds
    ``report()`` (the seed, the study, the workers)."""
    try:
        return daemon.wait_until(predicate, timeout_s=KILL_WAIT_S, what=what)
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{report()}", pytrace=False)


@pytest.mark.parametrize("seed", chaos_seeds(), ids=lambda s: f"seed={s}")
def test_study_survives_daemon_and_workers_killed_together(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path, seed: int
) -> None:
    """Proves issue 20's acceptance: with the daemon and every worker SIGKILLed together
    twice, once inside a trial's ask/hook window, the study still reaches its target with
    no trial RUNNING or WAITING, no failure retried twice or beyond ``max_retries``, and no
    worker slot given up."""
    started = time.monotonic()
    pause_at, kill_at = SIZE.plan(seed)
    url = make_study(tmp_path, STUDY)
    mark = tmp_path / "paused"
    command = [
        "python", str(CHAOS_WORKER), "--storage", url, "--study", STUDY,
        "--target", str(TARGET), "--n-trials", str(TARGET), "--seed", str(seed),
        "--faults", str(CRASHES), "--crash-rate", str(CRASH_RATE),
        "--pause-at", str(pause_at), "--mark", str(mark),
    ]  # fmt: skip
    config = write_config(
        tmp_path / "gpuwatchd.json",
        {
            STUDY: {
                "command": command,
                "env": {**python_on_path(), "PYTHONUNBUFFERED": "1"},
                "cwd": str(tmp_path),
                "workers": WORKERS,
                "gpus": "auto",
                "optuna": {"storage": url, "study": STUDY, "max_retries": MAX_RETRIES},
                "restart": {"backoff": "0.3s", "max_backoff": "2s", "budget": 1000},
            }
        },
        interval="0.25s",
        launcher="subprocess",
    )
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy(MAX_RETRIES))
    args = ["--config", str(config), "--policies", str(policies)]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="d1")
    daemons = [first]
    kills: list[str] = []

    def report(verdict: str = "") -> str:
        try:
            workers = managed_workers(daemons[-1].status(), STUDY)
        except AssertionError:
            workers = None
        return chaos_report(
            header=f"seed {seed}, target {TARGET} (replay: "
            f"{chaos_replay(seed, 'tests/test_chaos_kill.py')}); pause at trial {pause_at}, "
            f"kill 2 at {kill_at} COMPLETE; {time.monotonic() - started:.0f} s",
            kills=kills,
            verdict=verdict,
            all_trials=trials(url, STUDY),
            target=TARGET,
            max_retries=MAX_RETRIES,
            workers=workers,
            log="".join(d.log_path.read_text(errors="replace") for d in daemons),
        )

    def kill(why: str) -> None:
        n = kill_together(daemons[-1])
        kills.append(f"{why}: {n} processes")
        name = f"d{len(daemons) + 1}"
        daemons.append(restart_on_same_state(run_daemon, first, args, name=name))

    try:
        # Kill 1: inside the window between Optuna's ask and the hook's first word.
        _wait(f"trial {pause_at} to pause before the hook", mark.exists, first, report)
        paused = _trial(url, pause_at)
        assert paused is not None and paused.state.name == "RUNNING", report()
        assert "gpuwatchd:worker_id" not in paused.user_attrs, report()
        kill(f"trial {pause_at} RUNNING, untagged")
        # Kill 2: somewhere later in the run.
        _wait(
            f"{kill_at} COMPLETE trials",
            lambda: _counts(url)["COMPLETE"] >= kill_at,
            daemons[-1],
            report,
        )
        kill(f"at {_counts(url)['COMPLETE']} COMPLETE")
        verdict = settle(
            lambda: _counts(url),
            lambda: managed_workers(daemons[-1].status(), STUDY),
            TARGET,
            until=started + DEADLINE_S,
            stall_s=STALL_S,
            daemon_gone=lambda: None if daemons[-1].process.poll() is None else "daemon exited",
        )
        workers = managed_workers(daemons[-1].status(), STUDY)
        all_trials = trials(url, STUDY)
        given_up = [w for w in workers if w["state"] == "failed"]
        problems = study_problems(all_trials, TARGET, MAX_RETRIES)
        if verdict != "done" or problems or given_up:
            pytest.fail(report(verdict), pytrace=False)
        print(f"\n{report(verdict)}")
    finally:
        for daemon in daemons:
            if daemon.process.poll() is None:
                kill_together(daemon)
