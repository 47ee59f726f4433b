"""HostSampler against real processes: a job with busy DataLoader-like worker children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from gpuwatchd.model import HostSample, JobProcessSample
from gpuwatchd.sampling.host import CHILDREN_REFRESH_S, HostSampler

# A "job": starts N busy worker processes, says "ready N" on stdout, and starts one
# more worker for every line it reads on stdin. Workers exit when their parent dies.
JOB = r"""
import multiprocessing as mp, os, sys, time

def busy(parent):
    data = b"x" * (8 * 2**20)  # 8 MiB written, so resident
    x = 0
    while os.getppid() == parent:
        x += 1

if __name__ == "__main__":
    mp.set_start_method("fork")
    workers = []
    def spawn():
        p = mp.Process(target=busy, args=(os.getpid(),), daemon=True)
        p.start()
        workers.append(p)
    for _ in range(int(sys.argv[1])):
        spawn()
    print("ready", len(workers), flush=True)
    for line in sys.stdin:
        if line.strip() == "more":
            spawn()
        elif line.strip() == "kill-one":
            workers[0].kill()
            workers[0].join()
            workers.pop(0)
        print("ready", len(workers), flush=True)
"""


StartJob = Callable[[int], "subprocess.Popen[str]"]


@pytest.fixture
def job() -> Iterator[StartJob]:
    """``job(n)`` starts a job with ``n`` busy workers; all are killed at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(workers: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", JOB, str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, to clean up workers too
        )
        procs.append(proc)
        assert read_ready(proc) == workers
        return proc

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def read_ready(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    word, count = proc.stdout.readline().split()
    assert word == "ready"
    return int(count)


def tell(proc: subprocess.Popen[str], line: str) -> int:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return read_ready(proc)


def only_job(sample: HostSample) -> JobProcessSample:
    (job_sample,) = sample.jobs
    return job_sample


def test_host_sample_has_cpu_and_memory() -> None:
    sampler = HostSampler()
    time.sleep(0.2)
    sample = sampler.sample(123.0)
    assert sample.timestamp_s == 123.0
    assert 0.0 <= sample.cpu_pct <= 100.0
    assert sample.cpu_count == os.cpu_count()
    assert 0 < sample.memory_used_bytes < sample.memory_total_bytes
    assert sample.jobs == ()


@pytest.fixture(params=["proc-children", "psutil-scan"])
def children_source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with /proc/<pid>/task/<tid>/children, and again with psutil's full scan
    (the fallback for kernels without that file)."""
    if request.param == "psutil-scan":
        monkeypatch.setattr("gpuwatchd.sampling.host._proc_children", lambda pid: None)
    return str(request.param)


def test_job_with_busy_workers_then_job_exits(job: StartJob, children_source: str) -> None:
    proc = job(3)
    sampler = HostSampler()
    first = only_job(sampler.sample(0.0, [proc.pid]))
    assert first.pid == proc.pid and first.num_worker_children == 3
    assert first.rss_bytes > 3 * 8 * 2**20  # job + three workers holding 8 MiB each

    time.sleep(1.0)
    second = only_job(sampler.sample(1.0, [proc.pid]))
    assert second.num_worker_children == 3
    assert second.cpu_pct > 10.0, second  # three spinning workers, percent of one core
    assert second.rss_bytes > 3 * 8 * 2**20

    # The job dies (not yet reaped: a zombie), then is reaped: dropped quietly both times.
    proc.kill()
    deadline = time.monotonic() + 10
    while only_job_or_none(sampler.sample(2.0, [proc.pid])) is not None:
        assert time.monotonic() < deadline, "the dead job is still reported"
        time.sleep(0.05)
    proc.wait(timeout=10)
    assert sampler.sample(3.0, [proc.pid]).jobs == ()


def only_job_or_none(sample: HostSample) -> JobProcessSample | None:
    return sample.jobs[0] if sample.jobs else None


def test_children_are_rescanned_at_most_every_refresh_interval(
    job: StartJob, children_source: str
) -> None:
    proc = job(1)
    sampler = HostSampler()
    assert only_job(sampler.sample(100.0, [proc.pid])).num_worker_children == 1

    assert tell(proc, "more") == 2
    # The new worker exists, but no /proc scan happens before the interval is over.
    assert only_job(sampler.sample(101.0, [proc.pid])).num_worker_children == 1
    assert only_job(sampler.sample(100.0 + CHILDREN_REFRESH_S, [proc.pid])).num_worker_children == 2

    # A worker that exits is dropped at once, without waiting for a rescan, and its
    # going makes the next sample look for new children (a rebuilt DataLoader).
    assert tell(proc, "kill-one") == 1
    assert only_job(sampler.sample(106.0, [proc.pid])).num_worker_children == 1
    assert tell(proc, "more") == 2
    assert only_job(sampler.sample(107.0, [proc.pid])).num_worker_children == 2


def test_unknown_and_detached_pids_are_left_out(job: StartJob) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    proc = job(1)
    sampler = HostSampler()
    sample = sampler.sample(0.0, [gone.pid, proc.pid, proc.pid])
    assert [j.pid for j in sample.jobs] == [proc.pid]
    assert sampler.sample(1.0, []).jobs == ()  # a job that detached is forgotten
