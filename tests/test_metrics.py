"""Prometheus export as a user meets it: a real Prometheus (Debian's package, on 127.0.0.1)
scraping a daemon that replays the real 8-GPU H100 trace with a real training job attached;
promtool on the exposition, the alert rules and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import BIN, REPO, TRACES, RunningDaemon

TRACE = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"
CONTRIB = REPO / "contrib"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        body: bytes = reply.read()
        return body


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make prometheus` (apt-get install prometheus)"
    return path


class Prometheus:
    """A private Prometheus server on 127.0.0.1 scraping ``target`` every second."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.port = _free_port()
        config = workdir / "prometheus.yml"
        # the shipped scrape job, pointed at the test's daemon: as a user would add it
        scrape = yaml.safe_load((CONTRIB / "prometheus" / "scrape.yml").read_text())
        scrape[0]["static_configs"] = [{"targets": [target]}]
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(CONTRIB / "prometheus" / "gpuwatchd.rules.yml")],
                    "scrape_configs": scrape,
                }
            )
        )
        checked = subprocess.run(
            [_tool("promtool"), "check", "config", str(config)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        self.log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        reply = json.loads(_get(url))
        assert reply["status"] == "success", reply
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "prometheus exited"
            try:
                result = self.query(expr)
            except OSError:
                result = []
            if result:
                return result
            time.sleep(0.1)
        raise AssertionError(f"no data for {expr} within {timeout_s} s")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def replaying(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> Iterator[tuple[RunningDaemon, str, subprocess.Popen[bytes]]]:
    """A daemon replaying the H100 trace with --metrics-listen and an attached training job."""
    address = f"127.0.0.1:{_free_port()}"
    daemon = run_daemon(
        script={"devices": []},
        args=[
            "--devices",
            f"replay:{TRACE}",
            "--replay-speed",
            "5",
            "--metrics-listen",
            address,
            "--metrics-textfile",
            str(tmp_path / "gpuwatchd.prom"),
        ],
    )
    job = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / "train_digits.py"),
            "--job",
            "digits",
            "--num-workers",
            "0",
            "--duration-s",
            "90",
        ],
        env=daemon.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        daemon.wait_until(
            lambda: any(j.get("last_report") for j in daemon.status()["jobs"]),
            timeout_s=60,
            what="the training job's first report",
        )
        yield daemon, address, job
    finally:
        job.terminate()
        job.wait(timeout=30)


def _promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True
    )


def test_scrape_shows_the_trace_gpus_the_job_and_passes_promtool(
    replaying: tuple[RunningDaemon, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    daemon, address, _job = replaying
    text = _get(f"http://{address}/metrics").decode()
    samples = _samples(text)
    util = samples["gpuwatchd_gpu_utilization_ratio"]
    assert sorted(int(labels["gpu"]) for labels, _ in util) == list(range(8))
    assert all(0.0 <= value <= 1.0 for _, value in util)
    gpus = daemon.status()["gpus"]
    # dcgm-exporter's labels; the model as `model_name` (contrib/prometheus/scrape.yml
    # stores it as dcgm-exporter's `modelName`: test_real_prometheus_... checks that).
    assert {labels["UUID"] for labels, _ in util} == {g["uuid"] for g in gpus}
    assert {labels["model_name"] for labels, _ in util} == {g["name"] for g in gpus}
    assert {labels["Hostname"] for labels, _ in util} == {socket.gethostname()}
    assert samples["gpuwatchd_up"] == [({}, 1.0)]
    knobs = {labels["knob"]: value for labels, value in samples["gpuwatchd_job_knob_value"]}
    assert knobs["num_workers"] == 0.0
    assert [labels["job_name"] for labels, _ in samples["gpuwatchd_job_samples_per_second"]] == [
        "digits"
    ]
    assert samples["gpuwatchd_tick_duration_seconds_count"][0][1] >= 1
    assert samples["gpuwatchd_build_info"][0][0]["version"] == daemon.status()["version"]
    # promtool's parser and lint (naming guide: snake_case, units, _total) find nothing.
    checked = _promtool_check(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""
    # node_exporter's textfile: written by the daemon, the same families.
    textfile = tmp_path / "gpuwatchd.prom"
    daemon.wait_until(textfile.exists, timeout_s=20, what="the metrics textfile")
    assert "gpuwatchd_gpu_utilization_ratio" in _samples(textfile.read_text())


PANELS_EMPTY_IN_REPLAY: Final = {
    "GPU temperature": "the H100 trace has no temperature.gpu column",
    "Worker crashes (15 min)": "no managed worker crashes here",
    "Xid errors (1 h)": "a replayed trace has no Xid errors (NVML only)",
    "Managed job parallelism (ladder)": "no managed job here",
    "Trials ended per hour": "no Optuna study here",
}
"""Dashboard panels whose queries Prometheus answers empty against the replay (checked to
parse and run); test_metrics_counters.py shows their series on a managed Optuna job and
on Xid errors of the fake NVML."""


def test_real_prometheus_scrapes_and_the_dashboard_queries_answer(
    replaying: tuple[RunningDaemon, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    daemon, address, _job = replaying
    prometheus = Prometheus(tmp_path, address)
    try:
        gpus = prometheus.wait_for("gpuwatchd_gpu_memory_used_bytes")
        assert len(gpus) == 8
        assert {r["metric"]["job"] for r in gpus} == {"gpuwatchd"}  # Prometheus's job label
        status_gpus = daemon.status()["gpus"]
        assert {r["metric"]["UUID"] for r in gpus} == {g["uuid"] for g in status_gpus}
        # stored with dcgm-exporter's four labels: the shipped scrape job's relabeling
        assert {r["metric"]["modelName"] for r in gpus} == {g["name"] for g in status_gpus}
        assert all("model_name" not in r["metric"] for r in gpus)
        assert {r["metric"]["Hostname"] for r in gpus} == {socket.gethostname()}
        assert sorted(int(r["metric"]["gpu"]) for r in gpus) == list(range(8))
        rate = prometheus.wait_for('gpuwatchd_job_samples_per_second{job_name="digits"}')
        assert float(rate[0]["value"][1]) > 0
        ticks = prometheus.wait_for("rate(gpuwatchd_ticks_total[10s]) > 0")
        assert len(ticks) == 1
        # Every panel of the shipped dashboard is a valid query; all but the panels named
        # in PANELS_EMPTY_IN_REPLAY return data.
        dashboard = json.loads((CONTRIB / "grafana" / "gpuwatchd.json").read_text())
        panels = {
            p["title"]: [t["expr"] for t in p.get("targets", ())] for p in dashboard["panels"]
        }
        assert len(panels) >= 16 and set(PANELS_EMPTY_IN_REPLAY) <= set(panels)
        for title, exprs in panels.items():
            for expr in exprs:
                expr = expr.replace("$__rate_interval", "1m").replace("$hostname", ".*")
                if title in PANELS_EMPTY_IN_REPLAY:
                    assert prometheus.query(expr) == [], title  # valid, answered, empty
                else:
                    prometheus.wait_for(expr, timeout_s=30)
        # The alert rules load (Prometheus reports them), and the daemon-down alert is
        # not firing while the daemon runs.
        rules = json.loads(_get(f"http://127.0.0.1:{prometheus.port}/api/v1/rules"))
        names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
        assert names == {
            "GpuwatchdDown",
            "GpuwatchdGpuUnderused",
            "GpuwatchdJobDataStarved",
            "GpuwatchdVramNearLimit",
            "GpuwatchdWorkerCrashLoop",
            "GpuwatchdJournalFailing",
        }
        alerts = json.loads(_get(f"http://127.0.0.1:{prometheus.port}/api/v1/alerts"))
        assert [
            a for a in alerts["data"]["alerts"] if a["labels"]["alertname"] == "GpuwatchdDown"
        ] == []
        assert daemon.process.poll() is None
    finally:
        prometheus.close()


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    rules = CONTRIB / "prometheus" / "gpuwatchd.rules.yml"
    checked = subprocess.run(
        [_tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [_tool("promtool"), "test", "rules", "gpuwatchd.rules.test.yml"],
        capture_output=True,
        text=True,
        cwd=CONTRIB / "prometheus",
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_socket_activation_serves_the_fd_systemd_passes(tmp_path: Path) -> None:
    """systemd-socket-activate(1) passes a listening socket as LISTEN_FDS, as
    gpuwatchd-metrics.socket does under systemd; the daemon serves on it."""
    activate = _tool("systemd-socket-activate")
    port = _free_port()
    script = tmp_path / "nvml.json"
    script.write_text(json.dumps({"devices": []}))
    # A managed worker says what it inherited: sd_listen_fds(3) unsets LISTEN_* for it.
    seen = tmp_path / "worker-env.json"
    peek = (
        "import json, os, sys; json.dump({k: os.environ.get(k) for k in "
        "('LISTEN_PID', 'LISTEN_FDS', 'LISTEN_FDNAMES')}, open(sys.argv[1], 'w'))"
    )
    config = tmp_path / "gpuwatchd.json"
    config.write_text(
        json.dumps(
            {
                "jobs": {
                    "peek": {
                        "command": ["python", "-c", peek, str(seen)],
                        "env": {"PATH": f"{BIN}:{os.environ.get('PATH', os.defpath)}"},
                    }
                }
            }
        )
    )
    log = (tmp_path / "daemon.log").open("wb")
    process = subprocess.Popen(
        [
            activate,
            "-l",
            f"127.0.0.1:{port}",
            "--fdname=metrics",
            sys.executable,
            "-m",
            "gpuwatchd.testing.fakerun",
            str(script),
            "run",
            "--devices",
            f"replay:{TRACE}",
            "--socket",
            str(tmp_path / "control.sock"),
            "--state-dir",
            str(tmp_path / "state"),
            "--log-format",
            "json",
            "--config",
            str(config),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # systemd-socket-activate starts the daemon at the first connection.
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline and "gpuwatchd_gpu_utilization_ratio" not in text:
            try:
                text = _get(f"http://127.0.0.1:{port}/metrics", timeout_s=30).decode()
            except OSError:
                time.sleep(0.5)
        assert "gpuwatchd_gpu_utilization_ratio" in text, (tmp_path / "daemon.log").read_text()
        logged = (tmp_path / "daemon.log").read_text()
        assert '"source": "systemd socket"' in logged
        deadline = time.monotonic() + 30
        while not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert json.loads(seen.read_text()) == {
            "LISTEN_PID": None,
            "LISTEN_FDS": None,
            "LISTEN_FDNAMES": None,
        }
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


def test_shipped_socket_unit_listens_on_loopback_only() -> None:
    unit = (REPO / "systemd" / "gpuwatchd-metrics.socket").read_text()
    listen = [
        line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ListenStream=")
    ]
    assert listen == ["127.0.0.1:9879"]
    assert "FileDescriptorName=metrics" in unit and "Service=gpuwatchd.service" in unit
