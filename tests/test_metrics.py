"""Prometheus export as a user meets it: a real Prometheus (Debian's package, on 127.0.0.1)
scraping a daemon that replays the real 8-GPU H100 trace with a real training job attached;
promtool on the exposition, the alert rules and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, TRACES, RunningDaemon

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
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{CONTRIB / 'prometheus' / 'gpuwatchd.rules.yml'}']\n"
            "scrape_configs:\n"
            "  - job_name: gpuwatchd\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
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
            time.sleep(0.5)
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


def test_scrape_shows_the_trace_gpus_the_job_and_passes_promtool(
    replaying: tuple[RunningDaemon, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    daemon, address, _job = replaying
    text = _get(f"http://{address}/metrics").decode()
    checked = subprocess.run(
        [_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    samples = _samples(text)
    util = samples["gpuwatchd_gpu_utilization_ratio"]
    assert sorted(int(labels["gpu"]) for labels, _ in util) == list(range(8))
    assert all(0.0 <= value <= 1.0 for _, value in util)
    assert {labels["uuid"] for labels, _ in util} == {g["uuid"] for g in daemon.status()["gpus"]}
    assert samples["gpuwatchd_up"] == [({}, 1.0)]
    knobs = {labels["knob"]: value for labels, value in samples["gpuwatchd_job_knob_value"]}
    assert knobs["num_workers"] == 0.0
    assert [labels["job_name"] for labels, _ in samples["gpuwatchd_job_samples_per_second"]] == [
        "digits"
    ]
    assert samples["gpuwatchd_tick_duration_seconds_count"][0][1] >= 1
    # node_exporter's textfile: written by the daemon, the same families.
    textfile = tmp_path / "gpuwatchd.prom"
    daemon.wait_until(textfile.exists, timeout_s=20, what="the metrics textfile")
    assert "gpuwatchd_gpu_utilization_ratio" in _samples(textfile.read_text())


def test_real_prometheus_scrapes_and_the_dashboard_queries_answer(
    replaying: tuple[RunningDaemon, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    daemon, address, _job = replaying
    prometheus = Prometheus(tmp_path, address)
    try:
        gpus = prometheus.wait_for("gpuwatchd_gpu_memory_used_bytes")
        assert len(gpus) == 8
        assert {r["metric"]["job"] for r in gpus} == {"gpuwatchd"}  # Prometheus's job label
        rate = prometheus.wait_for('gpuwatchd_job_samples_per_second{job_name="digits"}')
        assert float(rate[0]["value"][1]) > 0
        # Every panel of the shipped dashboard is a valid query Prometheus answers.
        dashboard = json.loads((CONTRIB / "grafana" / "gpuwatchd.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
        assert len(exprs) >= 6
        # Worker crashes have no series until a managed worker crashes (none here).
        empty_by_design = [e for e in exprs if "worker_crashes" in e]
        assert len(empty_by_design) == 1
        for expr in exprs:
            if expr not in empty_by_design:
                prometheus.wait_for(
                    expr.replace("$__rate_interval", "1m").replace("$hostname", ".*"),
                    timeout_s=30,
                )
        assert prometheus.query(empty_by_design[0]) == []  # valid, answered, empty
        # The alert rules load (Prometheus reports them), and the daemon-down alert is
        # not firing while the daemon runs.
        rules = json.loads(_get(f"http://127.0.0.1:{prometheus.port}/api/v1/rules"))
        names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
        assert "GpuwatchdDown" in names and "GpuwatchdGpuUnderused" in names
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
