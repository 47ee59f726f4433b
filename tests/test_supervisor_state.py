"""workers.json (gpuwatchd.jobs.workers_file): written atomically, read back, and every
kind of bad file or entry refused with a reason instead of an exception."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs import workers_file
from gpuwatchd.jobs.job import Job
from gpuwatchd.jobs.worker import Worker
from job_fixture import make_job


def _job(tmp_path: Path) -> Job:
    cfg = JobConfig(name="hpo", command=("python", "train.py"), workers=4)
    return make_job(cfg, tmp_path, parallelism=3)


def test_save_names_the_live_workers_and_load_reads_them_back(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.workers[1] = Worker(
        number=1,
        state="running",
        pid=os.getpid(),
        start_ticks=123,
        gpu=0,
        started_at_s=1000.5,
        restarts=2,
        trial_number=7,
        placement_reason="most free",
        worker_id="hpo.1.abc",
    )
    job.workers[0] = Worker(number=0, state="draining", pid=4242, gpu=None)
    job.workers[2] = Worker(number=2, state="backoff", pid=None)  # nothing runs
    job.workers[3] = Worker(number=3, state="stopped", pid=77)  # not live
    workers_file.save(job, [10.0, 20.0])
    path = tmp_path / workers_file.STATE_FILE
    assert path.exists() and not list(tmp_path.glob("*.tmp*"))

    saved = workers_file.parse(workers_file.load(path))
    assert saved.parallelism == 3
    assert saved.restart_times_s == (10.0, 20.0)
    assert [w.worker for w in saved.workers] == [0, 1]
    one = saved.workers[1]
    assert (one.pid, one.start_ticks, one.gpu, one.trial_number) == (os.getpid(), 123, 0, 7)
    assert (one.restarts, one.placement_reason, one.worker_id) == (2, "most free", "hpo.1.abc")
    assert one.started_at_s == 1000.5
    assert saved.bad_entries == ()


def test_a_missing_file_is_an_empty_state(tmp_path: Path) -> None:
    assert workers_file.load(tmp_path / workers_file.STATE_FILE) == {}
    empty = workers_file.parse({})
    assert (empty.parallelism, empty.workers, empty.bad_entries) == (None, (), ())


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("{not json", workers_file.UnreadableState),
        (json.dumps({"version": 99, "workers": []}), workers_file.OtherVersionState),
        (json.dumps([1, 2]), workers_file.OtherVersionState),
    ],
)
def test_an_unusable_file_is_refused_with_a_reason(
    tmp_path: Path, text: str, refusal: type[workers_file.UnusableState]
) -> None:
    path = tmp_path / workers_file.STATE_FILE
    path.write_text(text, encoding="utf-8")
    with pytest.raises(refusal) as caught:
        workers_file.load(path)
    assert str(caught.value)


def test_bad_entries_are_skipped_and_named_and_wrong_types_dropped() -> None:
    saved = workers_file.parse(
        {
            "version": workers_file.STATE_VERSION,
            "parallelism": True,  # a bool is not a count
            "restart_times_s": [1, "x", 2.5],
            "workers": [
                {"worker": 0},  # no pid
                "garbage",
                {"worker": "one", "pid": 5},
                {"worker": 2, "pid": 9, "trial_number": "7", "worker_id": 3, "restarts": "x"},
            ],
        }
    )
    assert saved.parallelism is None
    assert saved.restart_times_s == (1.0, 2.5)
    assert len(saved.bad_entries) == 3 and "'garbage'" in saved.bad_entries
    (w,) = saved.workers
    assert (w.worker, w.pid, w.trial_number, w.worker_id, w.restarts) == (2, 9, None, None, 0)
