"""The GPU battery (issue 22): gpuwatchd against a real NVIDIA GPU, in one command.

    make gpu-check                              # here: the venv; on a GPU machine below
    python bench/gpu_check.py --out DIR [--only nvml_probe,record] [--budget-s 450]

Each section runs real parts (NVML through ``pynvml``, ``gpuwatchd run --devices nvml``,
CUDA PyTorch jobs, a real Optuna study on SQLite) and writes its figures into
``DIR/gpu_check.json`` as soon as it ends, with the texts and traces it recorded beside
it (``nvml_probe.json``, ``record.csv``, ``cuda_assert_stderr.txt``,
``cuda_oom_stderr.txt``); those become fixtures of the CPU suite (tests/data/gpu/).
Sections: ``env``, ``nvml_probe`` (every NVML question of issue 22, idle / busy SMs /
tiny kernels), ``record`` (``gpuwatchd record`` on real NVML during those phases),
``nvml_cost`` (µs per GPU-sample of the sampler), ``tuning`` (a data-starved CUDA job
found and its ``num_workers`` tuned by the daemon), ``oom`` (a real CUDA OOM: classified
``cuda_oom`` when uncaught; halved by the hook without the job dying), ``cuda_assert``
(a real device-side assert in a managed Optuna worker, classified and its trial
retried), ``batch_finder`` (the finder's answer against the largest batch that really
fits), ``hook_step`` (the hook's cost per CUDA step). A section that fails does not stop
the others; the run stops starting sections when ``--budget-s`` is nearly spent.

Without an NVIDIA GPU it says so, runs its CPU-side parts (the probe on
``gpuwatchd.testing``'s FakeNvml) and exits with status 2. Exit status 0: every section
passed; 1: one failed. ``--rehearse`` runs the daemon sections on the CPU with
``--devices none`` to check the battery itself (their GPU assertions then fail).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket as socketlib
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "bench" / "gpu"
PY = sys.executable

SECTIONS = (
    "env",
    "nvml_probe",
    "record",
    "nvml_cost",
    "sampler_fields",
    "tuning",
    "oom",
    "cuda_assert",
    "batch_finder",
    "hook_step",
)
"""Every section, in the order they run."""

SECTION_MIN_S = {"tuning": 60, "oom": 40, "cuda_assert": 60, "batch_finder": 30}
"""Seconds a section needs at least; it is skipped when less of the budget is left."""


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this repository importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)
    env.update(extra or {})
    return env


def run(
    argv: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (killed after ``timeout_s``); stdout and stderr as text."""
    if shutil.which(argv[0]) is None and not Path(argv[0]).exists():
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found")
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env or child_env(),
            cwd=cwd or REPO,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return subprocess.CompletedProcess(
            argv, 124, out, err + f"\n[timed out after {timeout_s} s]"
        )


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


# -- the daemon --------------------------------------------------------------------------


class Daemon:
    """``gpuwatchd run`` on a private socket and state directory, its JSON log in a file."""

    def __init__(
        self,
        workdir: Path,
        policies: str,
        devices: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "control.sock"
        self.state_dir = workdir / "state"
        self.log_path = workdir / "daemon.log"
        self.env = child_env({"GPUWATCHD_SOCKET": str(self.socket)})
        policy_path = workdir / "policies.yaml"
        policy_path.write_text(policies)
        config_path = workdir / "gpuwatchd.json"
        config_path.write_text(json.dumps({"interval": "1s", **(config or {})}, indent=1))
        self.argv = [
            PY, "-m", "gpuwatchd", "run",
            "--config", str(config_path),
            "--policies", str(policy_path),
            "--socket", str(self.socket),
            "--state-dir", str(self.state_dir),
            "--devices", devices,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Daemon:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as out:
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
            )
        self.wait_until(lambda: self.ctl("--json", "status").returncode == 0, 30, "daemon up")
        return self

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def ctl(self, *args: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
        """``gpuwatchctl --socket S ARGS``."""
        argv = [PY, "-m", "gpuwatchd.cli.ctl", "--socket", str(self.socket), *args]
        return run(argv, timeout_s, self.env)

    def status(self) -> dict[str, Any]:
        result = self.ctl("--json", "status")
        return json.loads(result.stdout) if result.returncode == 0 else {}

    def events(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines so far."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def journal(self) -> list[dict[str, Any]]:
        """``gpuwatchctl events --json --since 1h``: findings, decisions, outcomes."""
        result = self.ctl("events", "--json", "--since", "1h")
        if result.returncode != 0:
            return []
        return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_until(self, check: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"daemon exited ({self.process.returncode}) waiting for {what}:\n"
                    + tail(self.log_path.read_text(errors="replace"))
                )
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not within {timeout_s} s")


# -- sections ----------------------------------------------------------------------------


class Battery:
    """The sections, sharing the output directory, the device choice and the report."""

    def __init__(self, out: Path, rehearse: bool) -> None:
        self.out = out
        self.rehearse = rehearse
        self.devices = "none" if rehearse else "nvml"
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))

    def workdir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    # env --------------------------------------------------------------------------------

    def env(self) -> dict[str, Any]:
        smi = run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,pci.bus_id",
             "--format=csv,noheader"], 20)  # fmt: skip
        code = (
            "import json, torch, importlib.metadata as m\n"
            "v = lambda n: (lambda: m.version(n))() if n else None\n"
            "out = {'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            "       'cuda_available': torch.cuda.is_available()}\n"
            "for n in ('nvidia-ml-py', 'optuna', 'numpy', 'psutil', 'PyYAML'):\n"
            "    try: out[n] = m.version(n)\n"
            "    except Exception as e: out[n] = None\n"
            "if out['cuda_available']:\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    out['device'] = {'name': p.name, 'sms': p.multi_processor_count,\n"
            "                     'memory_bytes': p.total_memory}\n"
            "print(json.dumps(out))\n"
        )
        versions = run([PY, "-c", code], 60)
        return {
            "status": "pass" if versions.returncode == 0 else "fail",
            "python": platform.python_version(),
            "nvidia_smi": smi.stdout.strip() or tail(smi.stderr, 3),
            "versions": json.loads(versions.stdout)
            if versions.returncode == 0
            else tail(versions.stderr),
        }

    # nvml_probe -------------------------------------------------------------------------

    @contextlib.contextmanager
    def load(self, phase: str, seconds: float) -> Iterator[subprocess.Popen[str]]:
        """``bench/gpu/load.py --phase PHASE`` running (ready) for the block."""
        process = subprocess.Popen(
            [PY, str(GPU / "load.py"), "--phase", phase, "--seconds", str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(
                    f"load {phase} did not start: {line!r} "
                    f"{process.stderr.read() if process.stderr else ''}"
                )
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def nvml_probe(self) -> dict[str, Any]:
        sys.path.insert(0, str(GPU))
        import nvml_probe  # bench/gpu/nvml_probe.py
        import pynvml

        answers: dict[str, Any] = {"idle": nvml_probe.probe(pynvml, "idle")}
        with self.load("busy", 60):
            time.sleep(2)
            answers["busy"] = nvml_probe.probe(pynvml, "busy")
        with self.load("tiny", 60):
            time.sleep(2)
            answers["tiny"] = nvml_probe.probe(pynvml, "tiny")
        (self.out / "nvml_probe.json").write_text(json.dumps(answers, indent=1, sort_keys=True))
        summary: dict[str, Any] = {}
        for label, answer in answers.items():
            devices = answer.get("devices", [])
            if not devices:
                summary[label] = {"error": answer.get("nvmlInit")}
                continue
            dev = devices[0]
            gpm = dev.get("gpm", {}).get("metrics", {})
            summary[label] = {
                "utilization.gpu": dev["nvmlDeviceGetUtilizationRates"].get("value", {}).get("gpu"),
                "gpm": {
                    k.removeprefix("NVML_GPM_METRIC_"): v.get("value")
                    for k, v in gpm.items()
                    if isinstance(v, dict) and "value" in v
                },
                "process_utilization": dev["nvmlDeviceGetProcessUtilization"],
                "clocks_event_reasons": dev["nvmlDeviceGetCurrentClocksEventReasons"].get("value"),
            }
        idle = answers["idle"].get("devices", [{}])[0]
        unsupported = sorted(
            name
            for name, answer in idle.items()
            if isinstance(answer, dict)
            and answer.get("error", {}).get("name", "").endswith("NotSupported")
        )
        missing = sorted(
            name
            for name, answer in idle.items()
            if isinstance(answer, dict) and answer.get("missing")
        )
        us = {
            name: answer["us"][0]
            for name, answer in idle.items()
            if isinstance(answer, dict) and "us" in answer and isinstance(answer["us"], list)
        }
        return {
            "status": "pass" if all("devices" in a for a in answers.values()) else "fail",
            "phases": summary,
            "not_supported": unsupported,
            "missing_in_bindings": missing,
            "call_us_median_idle": us,
            "field_values_us": idle.get("field_values", {}).get("us"),
            "gpm_us": idle.get("gpm", {}).get("us"),
            "file": "nvml_probe.json",
        }

    # record -----------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        path = self.out / "record.csv"
        path.unlink(missing_ok=True)
        recorder = subprocess.Popen(
            [PY, "-m", "gpuwatchd", "record", "--dcgm", "--interval", "0.5", "--duration", "90s",
             "--out", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        marks: list[tuple[str, float]] = [("idle", time.time())]
        time.sleep(4)
        for phase, seconds in (("busy", 7.0), ("tiny", 6.0)):
            with self.load(phase, seconds + 10) as _:
                marks.append((phase, time.time()))
                time.sleep(seconds)
            marks.append(("idle", time.time()))
        time.sleep(2)
        recorder.send_signal(signal.SIGTERM)  # record stops cleanly and exits 0
        _, err = recorder.communicate(timeout=30)
        rows = (
            [line.split(", ") for line in path.read_text().splitlines()[1:]]
            if path.exists()
            else []
        )
        utils = [row[4] for row in rows if len(row) > 4]
        na = sum(1 for row in rows for cell in row[:9] if cell == "[N/A]")  # nvidia-smi's 9
        numbers = [float(u.split()[0]) for u in utils if u.split()[0].replace(".", "").isdigit()]
        replay = run([PY, "-m", "gpuwatchd", "replay", str(path), "--json"], 60)
        return {
            "status": "pass" if recorder.returncode == 0 and rows and na == 0 else "fail",
            "returncode": recorder.returncode,
            "rows": len(rows),
            "na_cells": na,
            "utilization_gpu_max": max(numbers) if numbers else None,
            "header": path.read_text().splitlines()[0] if path.exists() else None,
            "phases": [(phase, time.strftime("%H:%M:%S", time.gmtime(at))) for phase, at in marks],
            "stderr": tail(err, 5),
            "replay_returncode": replay.returncode,
            "replay_tail": tail(replay.stdout or replay.stderr, 8),
            "file": "record.csv",
        }

    # nvml_cost --------------------------------------------------------------------------

    def nvml_cost(self) -> dict[str, Any]:
        from gpuwatchd.sampling.nvml import NvmlSampler

        sampler = NvmlSampler()
        sampler.open()
        try:
            for _ in range(5):
                sampler.sample(time.time())
            times = []
            gpus = 0
            for _ in range(200):
                started = time.perf_counter()
                gpus = len(sampler.sample(time.time()))
                times.append(time.perf_counter() - started)
            xid = []
            for _ in range(50):
                started = time.perf_counter()
                sampler.poll_xid_events(time.time())
                xid.append(time.perf_counter() - started)
            errors = sampler.device_errors
            xid_devices, xid_error = sampler.xid_devices, sampler.xid_error
        finally:
            sampler.close()
        full = NvmlSampler(slow_interval_s=0.0)  # every read a full one (GPM, fields, ...)
        full.open()
        try:
            full.sample(time.time())
            full_times = []
            for _ in range(30):
                started = time.perf_counter()
                full.sample(time.time())
                full_times.append(time.perf_counter() - started)
        finally:
            full.close()
        per_sample = statistics.median(times) * 1e6 / max(gpus, 1)
        return {
            "status": "pass" if gpus and not errors else "fail",
            "gpus": gpus,
            "us_per_gpu_sample_median": round(per_sample, 1),
            "us_per_gpu_sample_p95": round(
                sorted(times)[int(0.95 * len(times))] * 1e6 / max(gpus, 1), 1
            ),
            "xid_poll_us_median": round(statistics.median(xid) * 1e6, 1),
            "us_per_gpu_full_read_median": round(
                statistics.median(full_times) * 1e6 / max(gpus, 1), 1
            ),
            "xid_devices": list(xid_devices),
            "xid_error": xid_error,
            "device_errors": errors,
        }

    # sampler_fields ---------------------------------------------------------------------

    def sampler_fields(self) -> dict[str, Any]:
        """The sampler's DCGM-like fields on real NVML while the GPU is busy, then runs
        tiny kernels (GPM read every 0.5 s here; the daemon's default is every 5 s)."""
        from gpuwatchd.model import NA
        from gpuwatchd.sampling.nvml import NvmlSampler

        def plain(value: Any) -> Any:
            return None if value is NA else value

        phases: dict[str, Any] = {}
        for phase in ("busy", "tiny"):
            with self.load(phase, 60):
                sampler = NvmlSampler(slow_interval_s=0.5)
                sampler.open()
                try:
                    samples = []
                    for _ in range(8):
                        samples.append(sampler.sample(time.time())[0])
                        time.sleep(0.5)
                finally:
                    sampler.close()
            last = samples[-1]
            health = last.health
            phases[phase] = {
                "utilization_gpu_pct": plain(last.utilization_gpu_pct),
                "sm_active_pct": plain(last.sm_active_pct),
                "sm_occupancy_pct": plain(last.sm_occupancy_pct),
                "tensor_active_pct": plain(last.tensor_active_pct),
                "dram_active_pct": plain(last.dram_active_pct),
                "gpm_unavailable": last.gpm_unavailable,
                "health": {
                    f.name: plain(getattr(health, f.name)) for f in dataclasses.fields(health)
                },
                "processes": [
                    (p.pid, plain(p.used_gpu_memory_bytes), plain(p.sm_util_pct))
                    for p in last.processes
                ],
                "mig_devices": len(last.mig_devices),
                "stale": [s.stale for s in samples if s.stale],
                "errors": [s.error for s in samples if s.error],
            }
        busy, tiny = phases["busy"], phases["tiny"]
        ok = (
            isinstance(busy["sm_active_pct"], float)
            and isinstance(tiny["sm_active_pct"], float)
            and busy["sm_active_pct"] > 50 > tiny["sm_active_pct"]
            and not busy["stale"] + tiny["stale"] + busy["errors"] + tiny["errors"]
            and any(p[2] is not None for p in busy["processes"])
        )
        return {"status": "pass" if ok else "fail", "phases": phases}

    # tuning -----------------------------------------------------------------------------

    TUNING_POLICY = """\
policies:
  - name: starved-tune
    when:
      data_starved: {fraction: 0.5, for: 3s}
    do:
      - tune_loader: {knob: num_workers, direction: up, max: 4, measure: 3s, noise: 0.05}
"""

    def tuning(self) -> dict[str, Any]:
        work = self.workdir("tuning")
        device_args = ["--device", "cpu", "--cost", "60"] if self.rehearse else []
        with Daemon(work, self.TUNING_POLICY, self.devices) as daemon:
            job_log = work / "job.log"
            with job_log.open("w") as out:
                job = subprocess.Popen(
                    [PY, str(GPU / "starved_job.py"), "--job", "starved", "--duration-s", "90",
                     *device_args],
                    stdout=out, stderr=subprocess.STDOUT, env=daemon.env, cwd=REPO,
                )  # fmt: skip
            gpu_before: list[Any] = []
            try:
                time.sleep(8)
                gpu_before = [
                    (g.get("utilization_gpu_pct"), g.get("sm_active_pct"))
                    for g in daemon.status().get("gpus", [])
                ]

                def held() -> list[dict[str, Any]] | None:
                    found = [
                        e
                        for e in daemon.journal()
                        if e.get("kind") == "decision" and e.get("action") == "tune_loader"
                    ]
                    if found and found[-1]["params"].get("verdict") in (
                        "worse",
                        "plateau",
                        "bound",
                    ):
                        return found
                    return None

                try:
                    decisions = daemon.wait_until(held, 75, "the tuner to hold")
                    held_ok = True
                except TimeoutError:
                    decisions = [
                        e
                        for e in daemon.journal()
                        if e.get("kind") == "decision" and e.get("action") == "tune_loader"
                    ]
                    held_ok = False
                time.sleep(4)
                status = daemon.status()
                gpu_after = [
                    (g.get("utilization_gpu_pct"), g.get("sm_active_pct"))
                    for g in status.get("gpus", [])
                ]
                journal = daemon.journal()
            finally:
                job.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.wait(timeout=20)
                if job.poll() is None:
                    job.kill()
        findings = [
            e
            for e in journal
            if e.get("kind") == "finding_started" and e.get("detector") == "data_starved"
        ]
        keys = ("previous", "value", "verdict", "samples_per_s_before", "samples_per_s_after")
        moves = [{k: d["params"].get(k) for k in keys} for d in decisions]
        outcomes = {
            e.get("decision_id"): e.get("outcome") for e in journal if e.get("kind") == "outcome"
        }
        applied = [d for d in decisions if outcomes.get(d.get("decision_id")) == "applied"]
        final = moves[-1]["value"] if moves else None
        return {
            "status": "pass" if findings and moves and held_ok and (final or 0) > 0 else "fail",
            "data_starved_findings": len(findings),
            "finding_message": findings[0].get("message") if findings else None,
            "tuner_decisions": moves,
            "applied_moves": len(applied),
            "held": held_ok,
            "num_workers_final": final,
            "utilization_gpu_before": gpu_before,
            "utilization_gpu_after": gpu_after,
            "job_log_tail": tail(job_log.read_text(errors="replace"), 12),
        }

    # oom --------------------------------------------------------------------------------

    def oom(self) -> dict[str, Any]:
        from gpuwatchd.crash import classify

        work = self.workdir("oom")
        raised = run([PY, str(GPU / "oom_job.py"), "--job", "oom-raise", "--oom", "raise",
                      "--steps", "1"],
                     120, child_env({"GPUWATCHD_SOCKET": str(work / "absent.sock")}))  # fmt: skip
        (self.out / "cuda_oom_stderr.txt").write_text(raised.stderr)
        crash = classify(raised.returncode, tail(raised.stderr, 200))
        with Daemon(work, "policies: []\n", self.devices) as daemon:
            halved = run([PY, str(GPU / "oom_job.py"), "--job", "oomy", "--oom", "halve",
                          "--steps", "2"],
                         180, daemon.env)  # fmt: skip
            time.sleep(2)
            events = daemon.events()
        job_events = [
            e for e in events if e.get("event") == "control.job_event" and e.get("job") == "oomy"
        ]
        applied = [
            (e.get("knob"), e.get("value"), e.get("source"))
            for e in events
            if e.get("event") == "control.knob_applied" and e.get("job") == "oomy"
        ]
        steps = [line for line in halved.stdout.splitlines() if line.startswith("step ")]
        return {
            "status": "pass"
            if crash.kind == "cuda_oom" and halved.returncode == 0 and job_events and steps
            else "fail",
            "uncaught": {
                "returncode": raised.returncode,
                "kind": crash.kind,
                "evidence": crash.to_dict().get("evidence"),
                "stderr_tail": tail(raised.stderr, 4),
            },
            "halved": {
                "returncode": halved.returncode,
                "oom_events": [(e.get("kind"), str(e.get("message"))[:200]) for e in job_events],
                "knobs_applied": applied,
                "steps": steps,
                "stderr_tail": tail(halved.stderr, 6),
            },
            "file": "cuda_oom_stderr.txt",
        }

    # cuda_assert ------------------------------------------------------------------------

    ASSERT_POLICY = """\
policies:
  - name: crashed-trials-restart
    when:
      job_crashed: {kind: [cuda_assert, cuda_oom]}
    do:
      - restart_study: {max_retries: 1}
"""

    def cuda_assert(self) -> dict[str, Any]:
        import optuna

        work = self.workdir("assert")
        url = f"sqlite:///{work / 'hpo.db'}"
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(storage=url, study_name="hpo", direction="minimize")
        study.enqueue_trial({"lr": 0.01, "hidden": 32, "head": 9})  # the poisoned corner
        device = "cpu" if self.rehearse else "cuda"
        command = [
            PY, str(REPO / "examples" / "hpo" / "worker.py"), "--storage", url, "--study", "hpo",
            "--target", "5", "--steps", "8", "--step-time", "0.01", "--head-min", "10",
            "--device", device,
        ]  # fmt: skip
        config = {
            "jobs": {
                "hpo": {
                    "command": command,
                    "cwd": str(work),
                    "workers": 1,
                    "optuna": {"storage": url, "study": "hpo", "max_retries": 1},
                    "restart": {"backoff": "0.5s", "max_backoff": "2s"},
                }
            }
        }
        with Daemon(work, self.ASSERT_POLICY, self.devices, config) as daemon:

            def done() -> bool:
                managed = daemon.status().get("managed", [])
                workers = [
                    w for job in managed if job.get("job") == "hpo" for w in job.get("workers", [])
                ]
                return bool(workers) and all(w.get("state") == "stopped" for w in workers)

            finished = True
            try:
                daemon.wait_until(done, 100, "the study to finish")
            except TimeoutError:
                finished = False
            events = daemon.events()
            state_dir = daemon.state_dir
        crashed = [e for e in events if e.get("event") == "worker crashed"]
        db = sqlite3.connect(f"file:{state_dir / 'journal.sqlite3'}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute(
                "SELECT policy, action, params, outcome, detail FROM decisions ORDER BY id"
            ).fetchall()
        finally:
            db.close()
        restarts = [
            {"params": json.loads(r[2]), "outcome": r[3], "detail": r[4]}
            for r in rows if r[1] == "restart_study"
        ]  # fmt: skip
        trials = optuna.load_study(study_name="hpo", storage=url).get_trials(deepcopy=False)
        states: dict[str, int] = {}
        for trial in trials:
            states[trial.state.name] = states.get(trial.state.name, 0) + 1
        retried = [
            {"number": t.number, "state": t.state.name,
             "parent": t.user_attrs.get("gpuwatchd:parent"),
             "retry_reason": t.user_attrs.get("gpuwatchd:retry_reason"), "params": t.params}
            for t in trials if "gpuwatchd:parent" in t.user_attrs
        ]  # fmt: skip
        text = ""
        for path in sorted(state_dir.rglob("*")):
            if path.is_file() and path.suffix != ".sqlite3":
                content = path.read_text(errors="replace")
                if "device-side assert" in content or "Traceback" in content:
                    text = content
                    break
        (self.out / "cuda_assert_stderr.txt").write_text(text)
        kinds = [e.get("kind") for e in crashed]
        return {
            "status": "pass"
            if finished and kinds and all(k == "cuda_assert" for k in kinds) and retried
            else "fail",
            "study_finished": finished,
            "crashes": [
                {
                    "kind": e.get("kind"),
                    "evidence": str(e.get("evidence"))[:300],
                    "returncode": e.get("returncode"),
                }
                for e in crashed
            ],
            "restart_study": restarts,
            "retries": retried,
            "trial_states": states,
            "file": "cuda_assert_stderr.txt",
        }

    # batch_finder -----------------------------------------------------------------------

    def batch_finder(self) -> dict[str, Any]:
        found = run(
            [PY, "-m", "gpuwatchd.hook.batch_size", "--model", "bench.gpu.bs_model:factory",
             "--start", "64", "--json", "--no-daemon"], 150)  # fmt: skip
        truth = run([PY, str(GPU / "bs_model.py")], 150)
        result: dict[str, Any] = {
            "finder_returncode": found.returncode,
            "truth_returncode": truth.returncode,
        }
        try:
            answer = json.loads(found.stdout)
            real = json.loads(truth.stdout.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            result.update(
                status="fail", finder_stderr=tail(found.stderr), truth_stderr=tail(truth.stderr)
            )
            return result
        true_max = real["true_max_batch_size"]
        result.update(
            status="pass" if 0 < answer["batch_size"] <= true_max else "fail",
            finder={
                k: answer.get(k)
                for k in (
                    "batch_size",
                    "max_batch_size",
                    "peak_bytes",
                    "budget_bytes",
                    "free_bytes",
                    "safety",
                    "measure",
                )
            },
            finder_probes=len(answer.get("probes", [])),
            true_max_batch_size=true_max,
            truth_probes=real["probes"],
            finder_max_over_true=round(answer["max_batch_size"] / true_max, 3)
            if true_max
            else None,
            finder_batch_over_true=round(answer["batch_size"] / true_max, 3) if true_max else None,
        )
        return result

    # hook_step --------------------------------------------------------------------------

    def hook_step(self) -> dict[str, Any]:
        work = self.workdir("hook")
        with Daemon(work, "policies: []\n", self.devices) as daemon:
            device = ["--device", "cpu", "--steps", "10", "--runs", "2"] if self.rehearse else []
            measured = run(
                [PY, str(GPU / "hook_step.py"), "--steps", "2000", "--runs", "5", *device],
                150,
                daemon.env,
            )
        try:
            figures = json.loads(measured.stdout.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return {"status": "fail", "stderr": tail(measured.stderr)}
        return {"status": "pass", **figures, "load_average": os.getloadavg()}


# -- the run -----------------------------------------------------------------------------


def gpu_present() -> str | None:
    """``None`` when NVML sees a GPU, else why not (one line)."""
    try:
        import pynvml
    except ImportError as exc:
        return f"no NVML bindings ({exc})"
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML: {exc}"
    return None if count > 0 else "NVML reports 0 devices"


def cpu_parts(out: Path) -> dict[str, Any]:
    """What runs without a GPU: the probe on FakeNvml (the battery's own plumbing)."""
    sys.path.insert(0, str(GPU))
    import nvml_probe  # bench/gpu/nvml_probe.py

    from gpuwatchd.testing.nvml import FakeNvml

    answer = nvml_probe.probe(FakeNvml.h100s(2), "fake")
    (out / "nvml_probe_fake.json").write_text(json.dumps(answer, indent=1, sort_keys=True))
    return {
        "status": "pass" if len(answer.get("devices", [])) == 2 else "fail",
        "file": "nvml_probe_fake.json",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="report directory")
    parser.add_argument("--only", default=None, help="comma-separated sections")
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="stop starting sections after"
    )
    parser.add_argument(
        "--rehearse", action="store_true", help="run the daemon sections on the CPU"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socketlib.gethostname(),
        "sections": {},
    }
    path = args.out / "gpu_check.json"

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=1, default=str))

    absent = None if args.rehearse else gpu_present()
    if absent is not None:
        log(f"no NVIDIA GPU ({absent}): running the CPU-side parts only")
        report.update(gpu=False, reason=absent)
        report["sections"]["cpu_parts"] = cpu_parts(args.out)
        save()
        log(f"report: {path}")
        return 2
    report["gpu"] = not args.rehearse
    wanted = (
        SECTIONS if args.only is None else tuple(s for s in SECTIONS if s in args.only.split(","))
    )
    battery = Battery(args.out, args.rehearse)
    try:
        for name in wanted:
            left = args.budget_s - (time.monotonic() - started)
            if left < SECTION_MIN_S.get(name, 15):
                report["sections"][name] = {
                    "status": "skipped",
                    "reason": f"{left:.0f} s of the budget left",
                }
                save()
                continue
            log(f"{name} ...")
            t0 = time.monotonic()
            try:
                result = getattr(battery, name)()
            except Exception as exc:
                result = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": tail(traceback.format_exc(), 12)}  # fmt: skip
            result["seconds"] = round(time.monotonic() - t0, 1)
            report["sections"][name] = result
            save()
            log(f"{name}: {result['status']} in {result['seconds']} s")
    finally:
        shutil.rmtree(battery.work, ignore_errors=True)
    statuses = {n: s["status"] for n, s in report["sections"].items()}
    report["summary"] = statuses
    save()
    log(f"summary: {statuses}; report: {path}")
    return 0 if all(s == "pass" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
