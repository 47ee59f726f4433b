"""The worker supervisor with real worker processes (small Python scripts), real files and
real signals; only the GPU inventory is a list of model.GpuSample."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpuwatchd.config import JobConfig
from gpuwatchd.errors import ConfigError, SupervisorError
from gpuwatchd.jobs.drain import DrainRequests
from gpuwatchd.jobs.procfs import is_same_process
from gpuwatchd.jobs.records import WorkerCrash, WorkerInfo
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.jobs.workers_file import STATE_FILE
from gpuwatchd.model import GpuSample, JobInfo
from gpuwatchd.restart import RestartPolicy

T = TypeVar("T")
LAUNCHER = os.environ.get("GPUWATCHD_TEST_LAUNCHER", "subprocess")
"""The launcher these tests run the supervisor with: ``subprocess`` here; ``systemd`` when
tests/test_supervisor_units.py runs them again inside a booted systemd."""
CRASHES = Path(__file__).parent / "data" / "crashes"
GIB = 2**30

WORKER_SCRIPT = r"""
import json, os, signal, subprocess, sys, time

mode = sys.argv[1]
if mode == "drainable":  # SIGUSR1 = the hook's drain: finish and exit 0. Set before the
    # env file below tells the test this worker runs (a drain may follow at once).
    signal.signal(signal.SIGUSR1, lambda *a: os._exit(0))
out = os.environ["TEST_OUT"]
n = os.environ.get("GPUWATCHD_WORKER", "?")
keys = ["GPUWATCHD_JOB", "GPUWATCHD_SOCKET", "GPUWATCHD_WORKER", "GPUWATCHD_WORKER_ID",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER", "NOTIFY_SOCKET", "WATCHDOG_USEC", "JOB_VAR", "HOME", "USER",
        "TRICKY"]
info = {k: os.environ.get(k) for k in keys}
info.update(cwd=os.getcwd(), pid=os.getpid(), uid=os.getuid(), pgid=os.getpgrp())
info["argv"] = sys.argv[1:]
with open("/proc/self/cgroup") as f:
    info["cgroup"] = f.read()
path = f"{out}/env-{n}-{os.getpid()}.json"
with open(path + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(path + ".tmp", path)
print(f"stdout of worker {n}", flush=True)
print(f"stderr of worker {n}", file=sys.stderr, flush=True)


def die(text_path, rc):
    sys.stderr.write(open(text_path).read())
    sys.stderr.flush()
    if rc == -6:
        os.abort()
    if rc < 0:
        os.kill(os.getpid(), -rc)
    os._exit(rc)


if mode == "crash":  # crash FILE RC DELAY
    time.sleep(float(sys.argv[4]))
    die(sys.argv[2], int(sys.argv[3]))
elif mode == "crash-once":  # crash-once FILE RC DELAY MARKER
    if not os.path.exists(sys.argv[5]):
        open(sys.argv[5], "w").close()
        time.sleep(float(sys.argv[4]))
        die(sys.argv[2], int(sys.argv[3]))
elif mode == "drainable":  # its SIGUSR1 handler is set at the top
    pass
elif mode == "stubborn":  # ignores SIGTERM and has a child (a DataLoader worker)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(f"{out}/child-{n}", "w") as f:
        f.write(str(child.pid))
elif mode == "done":  # a study finished: exit 0
    sys.exit(0)
elif mode == "hooked":  # as Optuna's per-trial attach: attach, detach, then SIGUSR1: exit 0
    from gpuwatchd.hook import attach

    ended = []
    signal.signal(signal.SIGUSR1, lambda *a: ended.append(1))
    with attach():
        pass
    open(f"{out}/detached-{n}-{os.getpid()}", "w").close()  # (stderr is a journal in a unit)
    while not ended:
        time.sleep(0.05)
    sys.exit(0)
elif mode == "spam":  # spam BYTES LINES
    sys.stdout.write("x" * int(sys.argv[2]) + "\n")
    sys.stdout.flush()
    for i in range(int(sys.argv[3])):
        sys.stderr.write(f"line {i}\n")
    sys.stderr.flush()
while True:
    time.sleep(0.5)
"""

DAEMON_SCRIPT = r"""
import asyncio, json, sys
from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.supervisor import Supervisor

spec = json.loads(sys.argv[1])

async def main():
    job = JobConfig(name=spec["name"], command=tuple(spec["command"]), cwd=spec["cwd"],
                    env=spec["env"], workers=spec["workers"], restart=spec["restart"])
    sup = Supervisor([job], state_dir=spec["state_dir"], socket_path=spec["socket"],
                     launcher=spec["launcher"])
    await sup.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


@dataclass
class RecordingLogger:
    """A structlog-like logger that keeps (level, event, fields)."""

    records: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def _add(self, level: str, event: str, **kw: Any) -> None:
        self.records.append((level, event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        self._add("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, **kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._add("exception", event, **kw)

    def events(self, event: str) -> list[dict[str, Any]]:
        return [kw for _, e, kw in self.records if e == event]


@dataclass
class Env:
    """Paths and helpers of one test."""

    root: Path
    out: Path
    state: Path
    script: Path
    pids: list[int] = field(default_factory=list)
    cursor: str = ""
    """The journal's cursor when the test began (systemd launcher): its output starts after."""

    def cmd(self, *args: str) -> tuple[str, ...]:
        return (sys.executable, str(self.script), *args)

    def job(self, *args: str, **kw: Any) -> JobConfig:
        kw.setdefault("workers", 1)
        kw.setdefault("cwd", str(self.root))
        kw.setdefault("env", {"TEST_OUT": str(self.out), "JOB_VAR": "from-job"})
        kw.setdefault("restart", {"backoff": "50ms", "max_backoff": "200ms", "stop_timeout": "2s"})
        return JobConfig(name=kw.pop("name", "hpo"), command=self.cmd(*args), **kw)

    def env_files(self, worker: int | None = None) -> list[dict[str, Any]]:
        pattern = "env-*.json" if worker is None else f"env-{worker}-*.json"
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(pattern))]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    e = Env(root=tmp_path, out=out, state=tmp_path / "state", script=script)
    if LAUNCHER == "systemd":
        shown = _journalctl("-n", "0", "--show-cursor", "-q")
        e.cursor = shown.strip().removeprefix("-- cursor: ")
    yield e
    # Whatever a failing test left behind: every process a worker recorded.
    for info in e.env_files():
        e.pids.append(int(info["pid"]))
    for child in out.glob("child-*"):
        e.pids.append(int(child.read_text()))
    for pid in e.pids:
        if is_same_process(pid, None):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if LAUNCHER == "systemd":  # worker units a failing test left: the next test reuses names
        for argv in (["systemctl", "stop", "gpuwatchd-jobs.slice"], ["systemctl", "reset-failed"]):
            subprocess.run(argv, capture_output=True, check=False, timeout=60)


def _journalctl(*args: str) -> str:
    done = subprocess.run(
        ["journalctl", "--no-pager", *args], capture_output=True, text=True, timeout=60
    )
    return done.stdout


def output(env: Env, job: str, worker: int, *, expect: str = "") -> str:
    """What worker ``worker`` of ``job`` wrote in this test, stdout then stderr: its files
    (subprocess launcher) or its unit's journal, ``journalctl -u`` (systemd launcher; the
    journal takes a moment to receive it: waited for up to 10 s until ``expect`` is in)."""
    if LAUNCHER != "systemd":
        jobdir = env.state / "jobs" / job
        return "".join(
            (jobdir / f"worker-{worker}.{ext}").read_text()
            for ext in ("out", "err")
            if (jobdir / f"worker-{worker}.{ext}").exists()
        )
    # Each launch's lines carry SYSLOG_IDENTIFIER=<its worker id> ("<job>.<slot>.<hex>"):
    # `journalctl -u` can miss a short-lived process's lines (systemd issue #2913).
    prefix = f"{job}.{worker}."
    deadline = time.monotonic() + 10.0
    while True:
        subprocess.run(["journalctl", "--sync"], capture_output=True, timeout=60, check=False)
        shown = _journalctl("-o", "json", "--all", f"--after-cursor={env.cursor}")
        entries = [json.loads(line) for line in shown.splitlines() if line.strip()]
        text = "".join(
            e["MESSAGE"] + "\n"
            for e in entries
            if e.get("_TRANSPORT") == "stdout"
            and str(e.get("SYSLOG_IDENTIFIER", "")).startswith(prefix)
        )
        if expect in text or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def until(pred: Callable[[], bool], timeout_s: float = 8.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


def gpu(index: int, used_gib: float, total_gib: float = 80, error: str | None = None) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        index=index,
        name="NVIDIA H100 80GB HBM3",
        timestamp_s=0.0,
        memory_used_bytes=int(used_gib * GIB),
        memory_total_bytes=int(total_gib * GIB),
        error=error,
    )


def emitted(*sups: Supervisor) -> list[WorkerCrash]:
    """The crash events ``sups`` emitted that nobody took (no daemon tick runs here)."""
    return [crash for sup in sups for crash in sup.crashes_pending]


def make(
    env: Env,
    jobs: Sequence[JobConfig],
    *,
    inventory: Sequence[GpuSample] = (),
    drains: DrainRequests | None = None,
    log: RecordingLogger | None = None,
    **kw: Any,
) -> Supervisor:
    environ = dict(os.environ, NOTIFY_SOCKET="/run/notify", WATCHDOG_USEC="30000000")
    log = log if log is not None else RecordingLogger()
    sup = Supervisor(
        jobs,
        state_dir=env.state,
        socket_path=env.root / "control.sock",
        logger=log,
        drains=drains,
        environ=environ,
        poll_interval_s=kw.pop("poll_interval_s", 0.05),
        launcher=kw.pop("launcher", LAUNCHER),
        **kw,
    )
    sup.note_gpus(inventory)
    if jobs:  # never a silent fallback: the launcher asked for is the one used
        (chosen,) = log.events("supervisor.launcher_chosen")
        assert chosen["launcher"] == LAUNCHER, chosen
    return sup


def run_until_failed(sup: Supervisor, job: str = "hpo") -> WorkerInfo:
    """Start ``sup``, wait until ``job``'s first worker is ``failed``, stop; that worker."""

    async def body() -> WorkerInfo:
        await sup.start()
        await until(lambda: sup.workers(job)[0].state == "failed", what=f"{job} failed")
        info = sup.workers(job)[0]
        await sup.stop()
        return info

    return run(body())


def running(sup: Supervisor, job: str = "hpo") -> list[WorkerInfo]:
    return [w for w in sup.workers(job) if w.state == "running"]


def alive(pid: int | None) -> bool:
    return pid is not None and is_same_process(pid, None)


# --------------------------------------------------------------------------- pure parts


def test_restart_policy_parses_durations_and_rejects_bad_keys() -> None:
    policy = RestartPolicy.from_mapping({"backoff": "2s", "max_backoff": "1m", "budget": 3})
    assert (policy.backoff_s, policy.max_backoff_s, policy.budget) == (2.0, 60.0, 3)
    assert [policy.delay_s(k) for k in (1, 2, 3, 5, 6, 100)] == [2, 4, 8, 32, 60, 60]
    assert RestartPolicy() == RestartPolicy.from_mapping({})
    assert RestartPolicy().delay_s(1) == 5.0 and RestartPolicy().delay_s(50) == 300.0
    for bad, message in (
        ({"backof": "5s"}, "unknown key restart.backof"),
        ({"backoff": "soon"}, "restart.backoff"),
        ({"budget": 0}, "positive integer"),
        ({"budget": True}, "positive integer"),
        ({"backoff": "10s", "max_backoff": "1s"}, "shorter than"),
    ):
        with pytest.raises(ConfigError, match=message):
            RestartPolicy.from_mapping(bad, job="j")


def test_bad_jobs_are_refused(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SupervisorError, match="configured twice"):
        make(env, [env.job("sleep"), env.job("sleep")])
    with pytest.raises(SupervisorError, match="cannot name a directory"):
        make(env, [env.job("sleep", name="../x")])
    with pytest.raises(ConfigError, match=r"restart\.budget"):
        make(env, [env.job("sleep", restart={"budget": -1})])
    with pytest.raises(SupervisorError, match="no such user"):
        make(env, [env.job("sleep", user="no-such-user-gpuwatchd")])
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(SupervisorError, match="needs gpuwatchd to run as root") as err:
        make(env, [env.job("sleep", user="root")])
    assert err.value.code == "forbidden"


# --------------------------------------------------------------------------- real workers


def test_workers_start_placed_with_env_and_output_files(env: Env) -> None:
    log = RecordingLogger()
    inventory = [gpu(0, used_gib=40), gpu(1, used_gib=1), gpu(2, 0, error="GPU is lost")]
    sup = make(env, [env.job("sleep", workers=3)], inventory=inventory, log=log)

    async def body() -> list[WorkerInfo]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 3, what="3 workers")
        await until(lambda: all("stderr of" in output(env, "hpo", n) for n in range(3)))
        infos = sup.workers("hpo")
        await sup.stop()
        return infos

    infos = run(body())
    assert [(w.worker, w.gpu_index, w.state) for w in infos] == [
        (0, 1, "running"),
        (1, 0, "running"),
        (2, 1, "running"),
    ]
    by_worker = {e["GPUWATCHD_WORKER"]: e for e in env.env_files()}
    assert sorted(by_worker) == ["0", "1", "2"]
    for n, info in by_worker.items():
        assert info["GPUWATCHD_JOB"] == "hpo"
        assert info["GPUWATCHD_SOCKET"] == str(env.root / "control.sock")
        assert info["CUDA_VISIBLE_DEVICES"] == str(infos[int(n)].gpu_index)
        assert info["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert info["GPUWATCHD_WORKER_ID"].startswith(f"hpo.{n}.")
        assert info["GPUWATCHD_WORKER_ID"] == infos[int(n)].worker_id
        assert info["JOB_VAR"] == "from-job"
        assert info["NOTIFY_SOCKET"] is None and info["WATCHDOG_USEC"] is None
        assert info["cwd"] == str(env.root)
        assert info["pgid"] == info["pid"]  # own session: a stop reaches its children
        unit_cgroup = f"/gpuwatchd-jobs.slice/gpuwatchd-hpo-{n}.service"
        assert (unit_cgroup in info["cgroup"]) == (LAUNCHER == "systemd"), info["cgroup"]
        assert infos[int(n)].pid == info["pid"]
    jobdir = env.state / "jobs" / "hpo"
    text = output(env, "hpo", 2, expect="stderr of worker 2\n")
    assert text == "stdout of worker 2\nstderr of worker 2\n"
    placed = log.events("worker placed")
    assert [(p["job"], p["worker"], p["gpu"]) for p in placed] == [
        ("hpo", 0, 1),
        ("hpo", 1, 0),
        ("hpo", 2, 1),
    ]
    assert all("most free memory per worker" in p["reason"] for p in placed)
    assert not any(alive(w.pid) for w in infos)
    assert json.loads((jobdir / STATE_FILE).read_text())["workers"] == []
    status = sup.status()["jobs"][0]
    assert status["parallelism"] == 3 and len(status["workers"]) == 3
    assert {w["state"] for w in status["workers"]} == {"stopped"}


def test_fixed_gpu_list_and_no_gpu(env: Env) -> None:
    log = RecordingLogger()
    fixed = env.job("sleep", name="fixed", workers=3, gpus=(2, 0))
    nogpu = env.job("sleep", name="cpu", workers=1)
    sup = make(env, [fixed, nogpu], log=log)

    async def body() -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 4)
        result = sup.workers("fixed"), sup.workers("cpu")
        await sup.stop()
        return result

    fixed_infos, cpu_infos = run(body())
    assert [w.gpu_index for w in fixed_infos] == [2, 0, 2]
    assert cpu_infos[0].gpu_index is None
    cpu_env = [e for e in env.env_files() if e["GPUWATCHD_JOB"] == "cpu"]
    assert cpu_env[0]["CUDA_VISIBLE_DEVICES"] == ""
    warned = log.events("worker has no GPU; CUDA_VISIBLE_DEVICES is empty")
    assert warned and warned[0]["job"] == "cpu" and "no GPU available" in warned[0]["reason"]


@pytest.mark.parametrize(
    ("recorded", "returncode", "kind", "sig"),
    [
        ("assert_acceleratorerror_script_generated.txt", 1, "cuda_assert", None),
        ("abort_c10_cudaerror_assert.txt", -6, "cuda_assert", "SIGABRT"),
        ("oom_torch_outofmemoryerror_chained.txt", 1, "cuda_oom", None),
    ],
)
def test_a_crash_is_classified_reported_and_restarted_after_backoff(
    env: Env, recorded: str, returncode: int, kind: str, sig: str | None
) -> None:
    log = RecordingLogger()

    marker = env.root / "crashed-once"
    job = env.job(
        "crash-once",
        str(CRASHES / recorded),
        str(returncode),
        "0.4",
        str(marker),
        restart={"backoff": "300ms", "max_backoff": "1s"},
    )
    sup = make(env, [job], log=log)

    async def body() -> tuple[WorkerInfo, float]:
        await sup.start()
        first = sup.workers("hpo")[0]
        assert first.pid is not None
        assert sup.note_trial(first.pid, 17)
        await until(lambda: bool(emitted(sup)), what="the crash")
        await until(lambda: len(running(sup)) == 1 and running(sup)[0].pid != first.pid)
        restarted_at = time.time()
        info = sup.workers("hpo")[0]
        await sup.stop()
        return info, restarted_at

    info, restarted_at = run(body())
    crash, stopped = emitted(sup)  # the crash, then stop()'s SIGTERM of the restarted worker
    assert stopped.intentional and stopped.returncode == -signal.SIGTERM
    assert crash.crash_info.kind == kind
    assert crash.crash_info.signal == sig
    assert crash.returncode == returncode
    assert crash.trial_number == 17
    assert crash.gpu_index is None
    assert not crash.intentional
    assert (CRASHES / recorded).read_text().splitlines()[-1].strip() in crash.stderr_tail
    assert crash.uptime_s is not None and crash.uptime_s >= 0.4
    event = crash.to_event()
    assert (event.kind, event.crash_kind, event.trial_number) == ("crash", kind, 17)
    assert restarted_at - crash.timestamp_s >= 0.25  # the backoff (300 ms) was waited
    assert info.restarts == 1 and info.last_crash_kind == kind
    scheduled = log.events("worker restart scheduled")
    assert scheduled[0]["delay_s"] == pytest.approx(0.3)
    (crashed_log,) = log.events("worker crashed")
    assert crashed_log["kind"] == kind and crashed_log["returncode"] == returncode


def test_a_crash_loop_ends_in_failed(env: Env) -> None:
    log = RecordingLogger()
    job = env.job(
        "crash",
        str(CRASHES / "assert_runtimeerror_traceback.txt"),
        "1",
        "0",
        restart={"backoff": "20ms", "max_backoff": "40ms", "crash_loop": 3, "min_uptime": "5s"},
    )
    sup = make(env, [job], log=log)

    async def body() -> WorkerInfo:
        await sup.start()
        await until(lambda: sup.workers("hpo")[0].state == "failed", what="failed")
        await asyncio.sleep(0.3)  # and it stays failed: no further start
        info = sup.workers("hpo")[0]
        await sup.stop()
        return info

    info = run(body())
    assert info.state == "failed" and info.pid is None
    assert "crash loop" in info.note and "3 times in a row without progress" in info.note
    assert info.restarts == 2
    assert len(emitted(sup)) == 3 and {c.crash_info.kind for c in emitted(sup)} == {"cuda_assert"}
    assert len(env.env_files()) == 3
    assert log.events("worker failed")[0]["worker"] == 0


def test_deaths_after_progress_are_no_crash_loop_however_short_the_runs(env: Env) -> None:
    """A crash loop is deaths without progress, not short runs (issue 20: a worker that
    finished trials between 1-s deaths was given up). Each launch here dies 0.3 s after
    its start, far inside ``min_uptime``; the first three speak through the hook (the
    daemon's tick hands the attached jobs to ``observe``) before dying: no crash loop.
    Then the launches stop speaking: two deaths without progress and the slot fails."""
    job = env.job(
        "crash",
        str(CRASHES / "assert_runtimeerror_traceback.txt"),
        "1",
        "0.3",
        restart={"backoff": "10ms", "max_backoff": "10ms", "crash_loop": 2, "min_uptime": "5s"},
    )
    sup = make(env, [job])

    async def body() -> tuple[list[str], WorkerInfo]:
        await sup.start()
        seen: set[int] = set()
        states: list[str] = []
        while len(seen) < 3:  # three launches make progress, then die
            (w,) = sup.workers("hpo")
            if w.pid is not None and w.pid not in seen:
                seen.add(w.pid)
                sup.observe([JobInfo(name="hpo", pid=w.pid, connected_at_s=time.time())])
            await asyncio.sleep(0.01)
        await until(lambda: len(emitted(sup)) >= 3, what="three deaths after progress")
        states.append(sup.workers("hpo")[0].state)
        await until(lambda: sup.workers("hpo")[0].state == "failed", what="failed")
        info = sup.workers("hpo")[0]
        await sup.stop()
        return states, info

    states, info = run(body())
    assert states[0] in ("running", "backoff"), states
    assert len(emitted(sup)) == 5  # 3 with progress, then 2 without: crash_loop 2
    assert "without progress" in info.note and "2 times in a row" in info.note


def test_an_exhausted_budget_stops_the_worker(env: Env) -> None:
    log = RecordingLogger()
    job = env.job(
        "crash",
        str(CRASHES / "oom_capacty_max_split_size.txt"),
        "1",
        "0",
        restart={"backoff": "10ms", "max_backoff": "10ms", "budget": 2, "min_uptime": "0s"},
    )
    sup = make(env, [job], log=log)

    async def body() -> WorkerInfo:
        await sup.start()
        await until(lambda: sup.workers("hpo")[0].state == "stopped", what="stopped")
        info = sup.workers("hpo")[0]
        await sup.stop()
        return info

    info = run(body())
    assert info.state == "stopped" and info.restarts == 2
    assert info.note.startswith("restart budget exhausted: 2 restarts within 3600 s")
    assert info.last_crash_kind == "cuda_oom"
    assert len(env.env_files()) == 3
    assert log.events("restart budget exhausted")
    assert sup.status()["jobs"][0]["restarts_in_window"] == 2


def test_set_parallelism_now_stops_the_newest_and_raising_starts_again(env: Env) -> None:
    sup = make(env, [env.job("sleep", workers=3)])

    async def body() -> tuple[list[WorkerInfo], list[WorkerInfo], list[WorkerInfo]]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 3)
        before = sup.workers("hpo")
        with pytest.raises(SupervisorError, match=r"0\.\.3"):
            await sup.set_parallelism("hpo", 4)
        with pytest.raises(SupervisorError, match="no managed job"):
            await sup.set_parallelism("nope", 1)
        await sup.set_parallelism("hpo", 1, mode="now")
        await until(lambda: len(sup.workers("hpo")) == 1, what="two workers gone")
        lowered = sup.workers("hpo")
        await sup.set_parallelism("hpo", 2)
        await until(lambda: len(running(sup)) == 2)
        raised = sup.workers("hpo")
        await sup.stop()
        return before, lowered, raised

    before, lowered, raised = run(body())
    assert [w.worker for w in lowered] == [0] and lowered[0].pid == before[0].pid
    assert not alive(before[1].pid) and not alive(before[2].pid)
    stopped = sorted(emitted(sup)[:2], key=lambda c: c.worker)
    assert [(c.worker, c.intentional, c.returncode) for c in stopped] == [
        (1, True, -signal.SIGTERM),
        (2, True, -signal.SIGTERM),
    ]
    assert all(c.crash_info.kind == "other" for c in stopped)
    assert [w.worker for w in raised] == [0, 1] and raised[1].pid not in (
        before[1].pid,
        before[2].pid,
    )
    assert sup.parallelism("hpo") == 2


def test_set_parallelism_drain_asks_the_hook_and_falls_back_to_sigterm(env: Env) -> None:
    asked: list[tuple[str, int]] = []

    async def drain(job: str, pid: int) -> bool:
        asked.append((job, pid))
        if len(asked) == 1:
            os.kill(pid, signal.SIGUSR1)  # what the hook's drain does: finish, exit 0
            return True
        return False  # no hook attached: the supervisor must stop it itself

    drains = DrainRequests()
    sup = make(env, [env.job("drainable", workers=3)], drains=drains)

    async def body() -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        answering = asyncio.ensure_future(drains.serve(drain))  # the daemon's job runner
        await asyncio.sleep(0)
        await sup.start()
        await until(lambda: len(env.env_files()) == 3)
        before = sup.workers("hpo")
        await sup.set_parallelism("hpo", 2, mode="drain")
        await until(lambda: len(sup.workers("hpo")) == 2, what="drained worker gone")
        await sup.set_parallelism("hpo", 1, mode="drain")
        await until(lambda: len(sup.workers("hpo")) == 1, what="stopped worker gone")
        after = sup.workers("hpo")
        await sup.stop()
        answering.cancel()
        return before, after

    before, after = run(body())
    assert asked == [("hpo", before[2].pid), ("hpo", before[1].pid)]
    assert [w.worker for w in after] == [0]
    # The drained one exited 0 (no report); the one without a hook got SIGTERM.
    assert [(c.worker, c.intentional) for c in emitted(sup)[:1]] == [(1, True)]


def test_stop_kills_the_whole_session_after_the_grace(env: Env) -> None:
    job = env.job("stubborn", workers=2, restart={"stop_timeout": "300ms"})
    log = RecordingLogger()
    sup = make(env, [job], log=log)

    async def body() -> tuple[list[WorkerInfo], float]:
        await sup.start()
        await until(lambda: len(list(env.out.glob("child-*"))) == 2, what="children")
        infos = sup.workers("hpo")
        started = time.monotonic()
        await sup.stop()
        return infos, time.monotonic() - started

    infos, took = run(body())
    children = [int(p.read_text()) for p in env.out.glob("child-*")]
    assert len(children) == 2
    for pid in [w.pid for w in infos] + children:
        assert not alive(pid), f"pid {pid} survived stop()"
    assert took >= 0.3
    assert len(log.events("worker ignored SIGTERM; sending SIGKILL")) == 2


def test_restart_worker_and_place_next(env: Env) -> None:
    sup = make(env, [env.job("sleep", workers=2)])

    async def body() -> tuple[list[WorkerInfo], list[WorkerInfo], list[WorkerInfo]]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 2)
        before = sup.workers("hpo")
        with pytest.raises(SupervisorError) as err:
            await sup.restart_worker("hpo", 9)
        assert err.value.code == "not_found"
        await sup.restart_worker("hpo", 0, gpu=3)
        await until(lambda: sup.workers("hpo")[0].pid not in (None, before[0].pid))
        await until(lambda: len(env.env_files(0)) == 2)
        restarted = sup.workers("hpo")
        sup.place_next("hpo", 5)
        # Worker 0 is now the newest: lowering the parallelism takes it away.
        await sup.set_parallelism("hpo", 1, mode="now")
        await until(lambda: [w.worker for w in sup.workers("hpo")] == [1])
        await sup.set_parallelism("hpo", 2)
        await until(lambda: len(running(sup)) == 2)
        result = before, restarted, sup.workers("hpo")
        await sup.stop()
        return result

    before, restarted, final = run(body())
    assert not alive(before[0].pid)
    assert restarted[0].gpu_index == 3 and "restart_worker" in restarted[0].placement_reason
    assert restarted[0].restarts == 1
    new_env = [e for e in env.env_files(0) if e["pid"] == restarted[0].pid]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in new_env] == ["3"]
    assert emitted(sup)[0].intentional and emitted(sup)[0].worker == 0
    assert final[1].pid == before[1].pid  # the older worker stayed
    assert final[0].gpu_index == 5 and "place_next" in final[0].placement_reason


def test_output_is_rotated_and_the_stderr_tail_is_bounded(env: Env) -> None:
    spam = env.job("spam", "5000", "300", workers=1)
    sup = make(env, [spam], output_max_bytes=1000)
    jobdir = env.state / "jobs" / "hpo"

    async def body() -> None:
        await sup.start()
        if LAUNCHER == "systemd":  # a unit's output is the journal's to keep and rotate
            await until(lambda: "line 299" in output(env, "hpo", 0), what="all output")
        else:
            await until(lambda: (jobdir / "worker-0.out.1").exists(), what="rotation")
            await until(lambda: (jobdir / "worker-0.err.1").exists(), what="err rotation")
        await sup.set_parallelism("hpo", 0, mode="now")
        await until(lambda: bool(emitted(sup)))
        await sup.stop()

    run(body())
    if LAUNCHER == "systemd":
        assert "x" * 5000 in output(env, "hpo", 0, expect="x" * 5000)
    else:
        assert (jobdir / "worker-0.out.1").stat().st_size > 5000
        assert (jobdir / "worker-0.out").stat().st_size < 1000
    tail = emitted(sup)[0].stderr_tail.splitlines()
    assert len(tail) == 200 and tail[-1] == "line 299"


def test_observe_takes_trial_numbers_from_the_hook(env: Env) -> None:
    sup = make(env, [env.job("sleep")])

    async def body() -> dict[str, Any]:
        await sup.start()
        pid = sup.workers("hpo")[0].pid
        assert pid is not None
        sup.observe([JobInfo(name="hpo", pid=pid, connected_at_s=0.0, trial_number=42)])
        assert not sup.note_trial(os.getpid(), 1)  # not one of ours
        state: dict[str, Any] = json.loads((env.state / "jobs" / "hpo" / STATE_FILE).read_text())
        await sup.stop()
        return state

    state = run(body())
    assert state["workers"][0]["trial_number"] == 42
    assert state["workers"][0]["start_ticks"] > 0


def test_stop_leave_then_a_new_supervisor_adopts(env: Env) -> None:
    sup = make(env, [env.job("sleep", workers=2)])

    async def first() -> list[WorkerInfo]:
        await sup.start()
        await until(lambda: len(env.env_files()) == 2)
        infos = sup.workers("hpo")
        await sup.stop("leave")
        return infos

    left = run(first())
    assert all(alive(w.pid) for w in left)
    second = make(env, [env.job("sleep", workers=2)])

    async def again() -> list[WorkerInfo]:
        await second.start()
        infos = second.workers("hpo")
        await second.stop()
        return infos

    adopted = run(again())
    assert [(w.pid, w.adopted) for w in adopted] == [(w.pid, True) for w in left]
    assert len(env.env_files()) == 2  # no duplicates were started
    assert not any(alive(w.pid) for w in left)


def test_adoption_after_a_daemon_sigkill(env: Env) -> None:
    """A real supervisor process is SIGKILLed; its workers live on and are adopted."""
    daemon_py = env.root / "daemon.py"
    daemon_py.write_text(DAEMON_SCRIPT)
    spec = {
        "name": "hpo",
        "command": list(env.cmd("sleep")),
        "cwd": str(env.root),
        "env": {"TEST_OUT": str(env.out)},
        "workers": 2,
        "restart": {"backoff": "50ms"},
        "state_dir": str(env.state),
        "socket": str(env.root / "control.sock"),
        "launcher": LAUNCHER,
    }
    with (env.root / "daemon.log").open("wb") as log_file:
        daemon = subprocess.Popen(
            [sys.executable, str(daemon_py), json.dumps(spec)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    state_file = env.state / "jobs" / "hpo" / STATE_FILE
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if len(env.env_files()) == 2 and state_file.exists():
                recorded = json.loads(state_file.read_text())["workers"]
                if len(recorded) == 2:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the daemon did not start 2 workers")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=10)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    pids = {w["worker"]: w["pid"] for w in recorded}
    ids = {w["worker"]: w["worker_id"] for w in recorded}
    launched = {e["pid"]: e["GPUWATCHD_WORKER_ID"] for e in env.env_files()}
    assert {pids[n]: ids[n] for n in pids} == launched  # one id per launch, in workers.json
    assert all(alive(pid) for pid in pids.values()), "workers must outlive the daemon"
    os.kill(pids[1], signal.SIGKILL)  # worker 1 dies while no daemon watches

    async def wait_gone() -> None:
        await until(lambda: not alive(pids[1]))

    run(wait_gone())

    log = RecordingLogger()
    sup = make(env, [env.job("sleep", workers=2)], log=log)

    async def body() -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        await sup.start()
        at_start = sup.workers("hpo")
        await until(lambda: len(running(sup)) == 2)
        os.kill(pids[0], signal.SIGKILL)  # the adopted worker dies: seen through its pidfd
        await until(lambda: len(emitted(sup)) == 2, what="adopted worker's death")
        await until(lambda: len(running(sup)) == 2 and pids[0] not in {w.pid for w in running(sup)})
        await until(lambda: len(env.env_files(0)) == 2, what="worker 0 restarted")
        after = sup.workers("hpo")
        await sup.stop()
        return at_start, after

    at_start, after = run(body())
    assert at_start[0].pid == pids[0] and at_start[0].adopted
    assert at_start[1].pid != pids[1] and not at_start[1].adopted
    assert len(env.env_files(0)) == 2  # the original worker 0 and its later restart only
    assert len(env.env_files(1)) == 2  # the original worker 1 and its replacement
    gone_while_down, adopted_died = emitted(sup)[:2]  # then stop()'s SIGTERMs (intentional)
    assert all(c.intentional for c in emitted(sup)[2:])
    assert (gone_while_down.worker, gone_while_down.pid) == (1, pids[1])
    assert (gone_while_down.worker_id, adopted_died.worker_id) == (ids[1], ids[0])
    assert at_start[0].worker_id == ids[0]
    restarted = {e["GPUWATCHD_WORKER_ID"] for e in env.env_files()} - set(ids.values())
    assert len(restarted) == 2  # the replacements got new ids
    # systemd kept each unit's exit status, the launcher shim wrote each launch's exit
    # file: exact, even while no daemon ran
    assert gone_while_down.returncode == adopted_died.returncode == -signal.SIGKILL
    assert gone_while_down.crash_info.signal == "SIGKILL"
    assert (adopted_died.worker, adopted_died.pid) == (0, pids[0])
    assert log.events("worker adopted")[0]["pid"] == pids[0]
    assert log.events("worker ended while gpuwatchd was down")[0]["worker"] == 1
    assert not any(alive(w.pid) for w in after)


def test_spawn_failure_counts_as_a_fast_crash(env: Env) -> None:
    job = replace(
        env.job("sleep", restart={"backoff": "10ms", "crash_loop": 2}),
        command=(str(env.root / "no-such-program"),),
    )
    log = RecordingLogger()
    sup = make(env, [job], log=log)

    info = run_until_failed(sup)
    assert info.last_crash_reason is not None
    # Popen's FileNotFoundError, or systemd-run's "Failed to find executable ...".
    assert info.last_crash_reason.startswith("cannot start: ")
    assert "No such file or directory" in info.last_crash_reason
    assert info.last_crash_kind == "environment"
    # Restarting cannot mend a missing program: failed at once, the budget untouched.
    assert len(log.events("worker start failed")) == 1
    assert info.note.startswith("environment failure at start: ")
    assert info.restarts == 0


def test_env_values_arguments_and_a_relative_command_reach_the_worker_as_popen_gives_them(
    env: Env,
) -> None:
    """A value with quotes, ``$``, backslashes, a backtick and a newline, arguments with
    ``$`` (a Hydra override, ``$5``) and ``./run.sh`` relative to the job's ``cwd``: the
    worker gets them as written (systemd expands ``$`` in ``ExecStart=`` and resolves a
    relative path from its own directory; the systemd launcher must undo both)."""
    tricky = 'a"b\\c $HOME ${HOME} `id` #x\nsecond line'
    wrapper = env.root / "run.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {env.script} "$@"\n')
    wrapper.chmod(0o755)
    args = ("done", "hydra.sweep.dir=multirun/${now:%Y}", "$5", "a$$b")
    job = replace(
        env.job("done", env={"TEST_OUT": str(env.out), "TRICKY": tricky}),
        command=("./run.sh", *args),
    )
    sup = make(env, [job])

    async def body() -> None:
        await sup.start()
        await until(lambda: len(env.env_files()) == 1)
        await until(lambda: sup.workers("hpo")[0].state != "running")
        await sup.stop()

    run(body())
    (info,) = env.env_files()
    assert info["argv"] == list(args)
    assert info["TRICKY"] == tricky
    assert info["cwd"] == str(env.root)
    assert not list((env.state / "jobs" / "hpo").glob("*.env"))  # nothing left on disk


def test_a_missing_cwd_is_an_environment_failure_that_says_so(env: Env) -> None:
    job = env.job("sleep", cwd=str(env.root / "no-such-dir"))
    log = RecordingLogger()
    sup = make(env, [job], log=log)

    info = run_until_failed(sup)
    assert info.last_crash_kind == "environment"
    assert info.note.startswith("environment failure at start: ")
    assert "No such file or directory" in info.note
    assert len(log.events("worker start failed")) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_user_switch_as_root(env: Env) -> None:
    """As root a worker runs as `nobody` (uid, groups, HOME, USER from the passwd entry).

    The commands are /usr/bin/id and /usr/bin/env (this interpreter may live where
    `nobody` cannot read); the output files are opened by the daemon and inherited.
    """
    import pwd

    nobody = pwd.getpwnam("nobody")
    ident = JobConfig(name="ident", command=("/usr/bin/id", "-u"), cwd="/", user="nobody")
    show = JobConfig(name="show", command=("/usr/bin/env",), cwd="/", user="nobody")
    sup = make(env, [ident, show])

    async def body() -> None:
        await sup.start()
        await until(lambda: {w.state for w in sup.workers()} == {"stopped"}, what="both exit")
        await sup.stop()

    run(body())
    assert output(env, "ident", 0, expect="\n").strip() == str(nobody.pw_uid)
    shown = dict(
        line.split("=", 1) for line in output(env, "show", 0, expect="GPUWATCHD_JOB").splitlines()
    )
    assert shown["USER"] == "nobody" and shown["HOME"] == nobody.pw_dir
    assert shown["GPUWATCHD_JOB"] == "show"
    assert sup.workers("ident")[0].note == "exited with status 0"


def test_lowering_parallelism_while_a_restart_is_stopping_the_worker_removes_it(
    env: Env,
) -> None:
    """Review finding: ``set_parallelism(..., "drain")`` picked a slot that
    ``restart_worker`` was stopping and tried to drain it (``stopping -> draining`` is no
    transition): the call raised and the restart was lost. The slot is on its way out
    already: it is removed after its process ends, not relaunched."""
    job = env.job("stubborn", restart={"stop_timeout": "1s"})

    async def no_hook(job: str, pid: int) -> bool:
        return False  # the daemon's drain: no hook answered

    drains = DrainRequests()
    sup = make(env, [job], drains=drains)

    async def body() -> list[WorkerInfo]:
        answering = asyncio.ensure_future(drains.serve(no_hook))  # the daemon's job runner
        await asyncio.sleep(0)
        await sup.start()
        await until(lambda: any(env.out.glob("child-*")), what="SIGTERM ignored")
        await sup.restart_worker("hpo", 0)
        await until(lambda: sup.workers("hpo")[0].state == "stopping", what="stopping")
        await sup.set_parallelism("hpo", 0, "drain")
        await until(lambda: sup.workers("hpo") == [], what="the slot removed", timeout_s=15)
        left = sup.workers("hpo")
        await sup.stop()
        answering.cancel()
        return left

    assert run(body()) == []
    assert len(env.env_files()) == 1, "the stopping slot was relaunched"
