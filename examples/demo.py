"""`make demo`: the daemon fixes a live PyTorch job whose DataLoader has too many workers.

1. starts `gpuwatchd run` in the foreground with its socket and state in a temp dir,
   the packaged default policies, and `--devices auto` (NVML when a GPU and driver
   are present, host-only otherwise);
2. starts examples/train_digits.py, a real PyTorch CPU training job on scikit-learn's
   digits with `num_workers` set far above what this host's cores can feed;
3. shows `gpuwatchctl status` before, waits for the `host-oversubscribed` policy's tuner
   (`tune_loader`, docs/tuning.md) to cut `num_workers` in the live job, shows
   `gpuwatchctl status` after;
4. stops both and prints what happened. Exit status 0 when the knob was cut.

Runs unprivileged; ends by itself in well under 3 minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
DEADLINE_S = 150.0


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def ctl(socket: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpuwatchctl"), "--socket", str(socket), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=30,
    )


def status_json(socket: Path) -> dict[str, Any] | None:
    result = ctl(socket, "--json", "status", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def job_knob(status: dict[str, Any], job: str, knob: str) -> Any:
    for entry in status["jobs"]:
        if entry["name"] == job and knob in entry["knobs"]:
            return entry["knobs"][knob]["value"]
    return None


def stop(process: subprocess.Popen[Any], name: str) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop on SIGTERM; killing it", flush=True)
            process.kill()
            process.wait()


def main() -> int:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="gpuwatchd-demo-"))
    socket = workdir / "control.sock"
    env = dict(os.environ, GPUWATCHD_SOCKET=str(socket), PYTHONUNBUFFERED="1")
    workers = max(8, 4 * (os.cpu_count() or 1))
    daemon_log = (workdir / "gpuwatchd.log").open("w")
    job_log = (workdir / "train_digits.log").open("w")

    banner(f"starting gpuwatchd (socket and state in {workdir})")
    daemon = subprocess.Popen(
        [
            str(BIN / "gpuwatchd"),
            "run",
            "--socket",
            str(socket),
            "--state-dir",
            str(workdir / "state"),
            "--devices",
            "auto",
            "--log-format",
            "json",
        ],
        stdout=daemon_log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    job: subprocess.Popen[Any] | None = None
    cut: dict[str, Any] | None = None
    try:
        while status_json(socket) is None:
            if daemon.poll() is not None or time.monotonic() - started > 30:
                print((workdir / "gpuwatchd.log").read_text(), file=sys.stderr)
                print("gpuwatchd did not come up", file=sys.stderr)
                return 1
            time.sleep(0.3)
        print(ctl(socket, "status").stdout, flush=True)

        banner(
            f"starting a PyTorch job with DataLoader num_workers={workers} on {os.cpu_count()} CPUs"
        )
        job = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "train_digits.py"),
                "--job",
                "digits",
                "--num-workers",
                str(workers),
                "--duration-s",
                "120",
            ],
            stdout=job_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        while True:
            status = status_json(socket)
            if (
                status
                and job_knob(status, "digits", "num_workers") is not None
                and any(j["name"] == "digits" and j.get("last_report") for j in status["jobs"])
            ):
                break
            if job.poll() is not None or time.monotonic() - started > 60:
                print((workdir / "train_digits.log").read_text(), file=sys.stderr)
                print("the training job did not attach", file=sys.stderr)
                return 1
            time.sleep(0.5)
        banner("gpuwatchctl status, before")
        print(ctl(socket, "status").stdout, flush=True)

        banner("waiting for the host-oversubscribed policy to act (host CPU > 90 % for 5 s)")
        while time.monotonic() - started < DEADLINE_S and job.poll() is None:
            status = status_json(socket)
            if status:
                applied = [
                    d
                    for d in status["decisions"]
                    if d["action"] in ("set_knob", "tune_loader") and d["outcome"] == "applied"
                ]
                if applied:
                    cut = applied[0]
                    break
            time.sleep(1.0)
        if cut is None:
            print("no num_workers cut was applied in time", file=sys.stderr)
            return 1
        time.sleep(3.0)  # let the job run an epoch with the new loader
        banner("gpuwatchctl status, after")
        print(ctl(socket, "status").stdout, flush=True)
    finally:
        if job is not None:
            stop(job, "training job")
        stop(daemon, "gpuwatchd")
        daemon_log.close()
        job_log.close()

    banner("what happened")
    params = cut["params"]
    print(
        f"- policy {cut['policy']!r} cut num_workers {params.get('previous')} -> "
        f"{params['value']} in the live job ({cut['reason'] or 'host CPU saturated'})"
    )
    epochs = [
        line
        for line in (workdir / "train_digits.log").read_text().splitlines()
        if line.startswith("epoch")
    ]
    print(f"- the job ran {len(epochs)} epochs; first and last:")
    for line in (epochs[:1] + epochs[-1:]) if epochs else []:
        print(f"    {line}")
    events = [
        json.loads(line)
        for line in (workdir / "gpuwatchd.log").read_text().splitlines()
        if line.startswith("{")
    ]
    interesting = [
        e
        for e in events
        if e.get("event") in ("running host-only", "finding", "decision", "knob applied", "ready")
    ]
    print("- daemon log (JSON lines, as journald would keep them):")
    for event in interesting[:12]:
        keys = ("event", "policy", "action", "job", "detector", "subject", "message", "reason")
        print("    " + json.dumps({k: event[k] for k in keys if k in event}))
    print(f"- logs kept in {workdir}; demo took {time.monotonic() - started:.0f} s")
    if os.environ.get("GPUWATCHD_DEMO_KEEP") is None:
        shutil.rmtree(workdir / "state", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
