"""Finished and operator-stopped worker slots stay down across supervisor restarts
(``workers.json``), until the job's configuration changes or ``start_job`` (real worker
processes, real files; the helpers are test_supervisor.py's)."""

from __future__ import annotations

import os
import signal
from dataclasses import replace

from gpuwatchd.supervisor import WorkerCrash
from gpuwatchd.supervisor.worker import PRESUMED_CLEAN_NOTE
from test_supervisor import LAUNCHER, Env, RecordingLogger, env, make, run, until

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


def test_an_adopted_worker_whose_end_the_exit_hint_calls_clean_is_held_not_crashed(
    env: Env,
) -> None:
    """The exit status of an adopted worker is unknown: the supervisor asks
    ``exit_hint(job, pid, worker_id, quiet)`` (this launch's id; ``quiet``: its own stderr
    shows no crash); True makes the end clean, held finished; False a crash. A worker
    unit's status is known (systemd keeps it): no hint is asked, a SIGKILL is a crash."""
    job = env.job("sleep", workers=2)
    first = make(env, [job])

    async def leave() -> list[int]:
        await first.start()
        await until(lambda: len(env.env_files()) == 2)
        pids = [w.pid for w in first.workers("hpo") if w.pid is not None]
        await first.stop("leave")
        return pids

    pids = run(leave())
    asked: list[tuple[str, int, str | None, bool]] = []
    crashes: list[WorkerCrash] = []

    async def hint(job: str, pid: int, worker_id: str | None, quiet: bool) -> bool:
        asked.append((job, pid, worker_id, quiet))
        return pid == pids[0]

    second = make(env, [job], on_crash=crashes.append, exit_hint=hint)

    async def end_both() -> list[tuple[int, str, str | None, str]]:
        await second.start()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        if LAUNCHER == "systemd":
            await until(lambda: len(crashes) == 2, what="both ends handled")
        else:
            await until(lambda: len(asked) == 2 and len(crashes) == 1, what="both ends handled")
        slots = [(w.worker, w.state, w.held, w.note) for w in second.workers("hpo")]
        await second.stop()
        return slots

    slots = run(end_both())
    if LAUNCHER == "systemd":
        assert asked == []
        ended = crashes[:2]  # then stop()'s SIGTERMs of their restarts (intentional)
        assert sorted(c.pid for c in ended) == sorted(pids)
        assert all(c.returncode == -signal.SIGKILL and not c.intentional for c in ended)
        assert [s for s in slots if s[2] == "finished"] == []
        return
    assert sorted((j, p, q) for j, p, _, q in asked) == sorted(
        [("hpo", pids[0], True), ("hpo", pids[1], True)]
    )
    assert all(worker_id for _, _, worker_id, _ in asked)
    assert crashes[0].pid == pids[1] and not crashes[0].intentional
    held = [s for s in slots if s[2] == "finished"]
    assert held == [(0, "stopped", "finished", PRESUMED_CLEAN_NOTE)]
