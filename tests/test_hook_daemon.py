"""The hook against the REAL daemon (``run_daemon``: a gpuwatchd subprocess on the fake
NVML): a live PyTorch CPU job survives a SIGKILLed and restarted daemon, and job events
reach the daemon. (``gpuwatchctl knob`` and a policy changing a live job's loader are in
tests/test_daemon.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon

REPO = Path(__file__).resolve().parents[1]


def start_job(daemon: RunningDaemon, tmp_path: Path, duration_s: float) -> subprocess.Popen[bytes]:
    log = (tmp_path / "digits.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / "train_digits.py"),
            "--job",
            "digits",
            "--num-workers",
            "2",
            "--views",
            "1",
            "--duration-s",
            str(duration_s),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=daemon.env,
    )


def job_entry(daemon: RunningDaemon, pid: int) -> dict[str, Any] | None:
    """The job's entry in ``gpuwatchctl --json status`` (None while the daemon is down)."""
    result = daemon.ctl("--json", "status")
    if result.returncode != 0:
        return None
    for entry in json.loads(result.stdout)["jobs"]:
        if entry["name"] == "digits" and entry["pid"] == pid and entry.get("last_report"):
            return dict(entry)
    return None


@pytest.mark.slow
def test_a_live_job_survives_a_killed_daemon_and_re_registers_with_its_knobs(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    job = start_job(daemon, tmp_path, duration_s=120)
    try:
        daemon.wait_until(lambda: job_entry(daemon, job.pid), timeout_s=60, what="job attached")
        changed = daemon.ctl("knob", "digits", "num_workers", "1", "--wait", "30")
        assert changed.returncode == 0, changed.stderr

        daemon.process.send_signal(signal.SIGKILL)  # no cleanup: the socket file stays
        daemon.process.wait(timeout=10)
        assert daemon.socket.exists()
        log_before = (tmp_path / "digits.log").read_text()
        assert job.poll() is None, log_before  # the job did not notice

        with (daemon.workdir / "daemon.log").open("ab") as log:
            daemon.process = subprocess.Popen(
                daemon.process.args, stdout=log, stderr=subprocess.STDOUT, env=daemon.env
            )

        def re_registered() -> dict[str, Any] | None:
            entry = job_entry(daemon, job.pid)
            if entry is None or entry["last_report"]["timestamp_s"] <= entry["connected_at_s"]:
                return None
            return entry

        entry = daemon.wait_until(re_registered, timeout_s=30, what="job re-registered")
        killed_at_steps = entry["last_report"]["steps"]
        assert entry["knobs"]["num_workers"]["value"] == 1  # its current value, from hello
        assert entry["knobs"]["num_workers"]["min"] == 0
        assert job.poll() is None
        daemon.wait_until(
            lambda: (
                (job_entry(daemon, job.pid) or {}).get("last_report", {}).get("steps", 0)
                > killed_at_steps
            ),
            timeout_s=20,
            what="reports after the restart",
        )
        assert job.poll() is None  # still training
        output = (tmp_path / "digits.log").read_text()
        assert "Traceback" not in output, output  # (SIGTERM below may make workers complain)
    finally:
        job.terminate()
        job.wait(timeout=30)


@pytest.mark.slow
def test_job_events_and_cuda_fields_reach_the_real_daemon(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    daemon = run_daemon()
    code = (
        "import time, torch\n"
        "from gpuwatchd.hook import attach\n"
        "def boom(micro):\n"
        "    raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 8 GiB')\n"
        "with attach(job='oomy', knobs={'batch_size': 8}, oom='halve') as w:\n"
        "    loader = w.loader(lambda k: [torch.arange(k['batch_size'])] * 50)\n"
        "    for batch in loader:\n"
        "        try:\n"
        "            w.step(lambda m: (_ for _ in ()).throw(\n"
        "                torch.cuda.OutOfMemoryError('CUDA out of memory.')) if len(m) > 2\n"
        "                else None, batch)\n"
        "        except torch.cuda.OutOfMemoryError:\n"
        "            pass\n"
        "        time.sleep(0.02)\n"
        "    w.report_trial(5, 'COMPLETE')\n"
        "    time.sleep(0.6)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    events = daemon.wait_until(
        lambda: [e for e in daemon.events() if e.get("event") == "control.job_event"] or None,
        what="job events logged",
    )
    assert [(e["job"], e["kind"]) for e in events][:3] == [
        ("oomy", "oom"),
        ("oomy", "oom"),
        ("oomy", "trial"),
    ]
    applied = [
        e
        for e in daemon.events()
        if e.get("event") == "control.knob_applied" and e.get("job") == "oomy"
    ]
    assert [(e["knob"], e["value"], e["source"]) for e in applied] == [("batch_size", 2, "job")]


@pytest.mark.slow
def test_a_job_declaring_persistent_workers_is_watched_by_the_real_daemon(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    """docs/hook.md's ``persistent_workers`` knob: the job attaches with it (gpuwatchd 0.1.0
    refused the hello and the job trained unwatched)."""
    daemon = run_daemon()
    code = (
        "import time\n"
        "from gpuwatchd.hook import attach\n"
        "with attach(job='pw', knobs={'num_workers': 2, 'persistent_workers': True}) as w:\n"
        "    time.sleep(3)\n"
    )
    job = subprocess.Popen([sys.executable, "-c", code], env=daemon.env, stderr=subprocess.PIPE)
    try:
        entry = daemon.wait_until(
            lambda: next((j for j in daemon.status()["jobs"] if j["pid"] == job.pid), None),
            what="the job attached",
        )
        assert {k: v["value"] for k, v in entry["knobs"].items()} == {
            "num_workers": 2,
            "persistent_workers": True,
        }
        _, stderr = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert b"refused" not in stderr
    assert not [e for e in daemon.events() if e["event"] == "control.hello_refused"]


@pytest.mark.slow
def test_a_knob_the_daemon_drops_leaves_the_job_watched_and_its_other_knobs_tunable(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    """Issue 21: one knob descriptor the daemon refuses (a name over 64 characters, which
    the hook itself allows) no longer leaves the job unwatched: the daemon attaches it with
    the valid knob and logs what it dropped with the pid; the job says so in one stderr
    line, and the valid knob is still the daemon's to change."""
    daemon = run_daemon()
    long_name = "k" * 80
    code = (
        "import time\n"
        "from gpuwatchd.hook import attach\n"
        f"with attach(job='dk', knobs={{'num_workers': 2, {long_name!r}: 1}}) as w:\n"
        "    deadline = time.monotonic() + 40\n"
        "    while w.knobs['num_workers'] == 2 and time.monotonic() < deadline:\n"
        "        w.apply_knobs()\n"
        "        time.sleep(0.05)\n"
        "    print(w.knobs['num_workers'], flush=True)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", code],
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        entry = daemon.wait_until(
            lambda: next((j for j in daemon.status()["jobs"] if j["pid"] == job.pid), None),
            what="the job attached",
        )
        assert set(entry["knobs"]) == {"num_workers"}
        changed = daemon.ctl("knob", "dk", "num_workers", "1", "--wait", "30")
        assert changed.returncode == 0, changed.stderr
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert stdout.strip() == "1"
    warned = [line for line in stderr.splitlines() if "dropped knob" in line]
    assert len(warned) == 1 and long_name in warned[0] and "1..64 characters" in warned[0]
    (dropped,) = [e for e in daemon.events() if e["event"] == "control.knobs_dropped"]
    assert dropped["pid"] == job.pid and dropped["job"] == "dk"
    assert [d["knob"] for d in dropped["dropped"]] == [long_name]
    assert dropped["level"] == "warning"
    assert not [e for e in daemon.events() if e["event"] == "control.hello_refused"]
