"""Finished and operator-stopped worker slots stay down across supervisor restarts
(``workers.json``), until the job's configuration changes or ``start_job`` (real worker
processes, real files; the helpers are test_supervisor.py's)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import replace

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.worker import EXIT_LINE_NOTE
from test_supervisor import LAUNCHER, Env, RecordingLogger, emitted, env, make, run, until

__all__ = ["env"]  # the fixture, used by name


def test_a_finished_worker_is_not_relaunched_by_the_next_supervisor(env: Env) -> None:
    job = env.job("done", workers=2)
    first = make(env, [job])

    async def finish() -> None:
        await first.start()
        await until(lambda: all(w.state == "stopped" for w in first.workers("hpo")))
        await first.stop()

    run(finish())
    assert len(env.env_files()) == 2

    log = RecordingLogger()
    second = make(env, [job], log=log)

    async def again() -> list[str | None]:
        await second.start()
        held = [w.held for w in second.workers("hpo")]
        await second.stop()
        return held

    assert run(again()) == ["finished", "finished"]
    assert len(env.env_files()) == 2, "a finished slot was launched again"
    assert [e["reason"] for e in log.events("worker.held")] == ["finished", "finished"]

    # A changed configuration (another argv) starts the slots again.
    changed = replace(job, command=(*job.command, "--again"))
    third = make(env, [changed])

    async def changed_config() -> None:
        await third.start()
        await until(lambda: len(env.env_files()) == 4, what="both slots started again")
        await until(lambda: all(w.state == "stopped" for w in third.workers("hpo")))
        await third.stop()

    run(changed_config())


def test_job_stop_holds_and_job_start_starts_again(env: Env) -> None:
    job = env.job("sleep", workers=2)
    sup = make(env, [job])

    async def stop_it() -> int:
        await sup.start()
        await until(lambda: len(env.env_files()) == 2)
        stopped = await sup.stop_job("hpo")
        await sup.stop()
        return stopped

    assert run(stop_it()) == 2
    second = make(env, [job])

    async def start_it() -> tuple[list[str], int, int]:
        await second.start()
        states = [w.state for w in second.workers("hpo")]
        started = await second.start_job("hpo")
        await until(lambda: len(env.env_files()) == 4)
        stopped, restarted = await second.restart_job("hpo")
        await until(lambda: len(env.env_files()) == 6)
        await second.stop()
        return states, started, stopped + restarted

    states, started, both = run(start_it())
    assert states == ["stopped", "stopped"]  # held across the restart: nothing launched
    assert started == 2 and both == 4
    assert len(env.env_files()) == 6


def test_an_adopted_worker_is_finished_only_with_its_exit_line_never_by_a_detach(
    env: Env,
) -> None:
    """An adopted worker is not this supervisor's child. Both workers' hooks detached
    (the Optuna pattern attaches per trial); one then exits cleanly, the other is
    SIGKILLed: the first is held finished, the second is a crash and its slot runs again
    (issue 20: a detach is not an exit). The statuses come from the launcher shim's exit
    files (or, for a worker unit, from systemd): exact. The clean one's exit file is
    removed first here, as for a launch an older gpuwatchd made without the shim: its
    hook's exit line in its stderr is then the evidence."""
    job = env.job("hooked", workers=2)
    pids = _left_after_detach(env, job)
    second = make(env, [job])

    async def end_both() -> list[tuple[int, str, str | None, str]]:
        await second.start()
        if LAUNCHER != "systemd":
            (clean,) = [w for w in second.workers("hpo") if w.pid == pids[0]]
            (env.state / "jobs" / "hpo" / f"exit-{clean.worker_id}.json").unlink()
        os.kill(pids[0], signal.SIGUSR1)
        os.kill(pids[1], signal.SIGKILL)
        await until(lambda: len(emitted(second)) == 1, what="the killed one reported")
        await until(
            lambda: any(w.held == "finished" for w in second.workers("hpo")),
            what="the clean one held",
        )
        await until(lambda: len(env.env_files()) == 3, what="the killed slot relaunched")
        slots = [(w.worker, w.state, w.held, w.note) for w in second.workers("hpo")]
        await second.stop()
        return slots

    slots = run(end_both())
    assert emitted(second)[0].pid == pids[1] and not emitted(second)[0].intentional
    assert emitted(second)[0].returncode == -signal.SIGKILL
    note = "exited with status 0" if LAUNCHER == "systemd" else EXIT_LINE_NOTE
    held = [s for s in slots if s[2] == "finished"]
    assert held == [(0, "stopped", "finished", note)]


def test_a_worker_killed_while_no_supervisor_ran_is_a_crash_though_its_hook_detached(
    env: Env,
) -> None:
    """Killed with the daemon (after its hook's last detach), a worker is not presumed
    finished: the next supervisor reports the end (status unknown) and starts the slot
    again. One that exited cleanly meanwhile (its exit line) is held finished."""
    job = env.job("hooked", workers=2)
    pids = _left_after_detach(env, job)
    os.kill(pids[0], signal.SIGUSR1)
    os.kill(pids[1], signal.SIGKILL)
    for pid in pids:
        _wait_gone(pid)
    log = RecordingLogger()
    second = make(env, [job], log=log)

    async def again() -> list[tuple[int, str, str | None]]:
        await second.start()
        await until(lambda: len(env.env_files()) == 3, what="the killed slot relaunched")
        slots = [(w.worker, w.state, w.held) for w in second.workers("hpo")]
        await second.stop()
        return slots

    slots = run(again())
    assert [c.pid for c in emitted(second)[:1]] == [pids[1]]
    assert emitted(second)[0].returncode in (None, -signal.SIGKILL)
    assert (0, "stopped", "finished") in slots
    assert [e["worker"] for e in log.events("worker.held")] == []


def _left_after_detach(env: Env, job: JobConfig) -> list[int]:
    """Start ``job``'s two hooked workers, wait until both hooks detached, stop the
    supervisor with ``leave``; the workers' pids (still running)."""
    first = make(env, [job])

    async def leave() -> list[int]:
        await first.start()
        await until(lambda: len(env.env_files()) == 2)
        await until(lambda: _detached(env, 2), what="both hooks detached")
        pids = [w.pid for w in first.workers("hpo") if w.pid is not None]
        await first.stop("leave")
        return pids

    return run(leave())


def _detached(env: Env, count: int) -> bool:
    return len(list(env.out.glob("detached-*"))) >= count


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # a subprocess worker of the first supervisor is our child: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} did not end")
