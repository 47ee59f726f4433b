"""The metrics a replayed trace cannot show, scraped from real daemons: a managed Optuna job
whose worker dies of a CUDA assert (crashes, trials by state, decisions, the ladder), Xid
errors of the fake NVML, a flood of connections to the endpoint, and systemd's
``LISTEN_FDS`` handed to a real process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TWO_GPUS, RunningDaemon
from gpuwatchd.metrics.account import MAX_SERIES, OTHER, MetricsAccount
from gpuwatchd.metrics.serve import MAX_CONNECTIONS
from gpuwatchd.model import JobEvent, JobInfo, Snapshot
from hpo_env import (
    TWO_EQUAL_GPUS,
    decisions,
    one_assert_job,
    restart_study_policy,
    states,
    wait_until_stopped,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` of ``address``: sample name -> sorted label items -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def _by(
    samples: dict[tuple[tuple[str, str], ...], float], *names: str
) -> dict[tuple[str, ...], float]:
    """The samples keyed by the values of the labels ``names``."""
    return {tuple(dict(key)[n] for n in names): value for key, value in samples.items()}


@pytest.mark.slow
def test_a_managed_optuna_job_shows_its_crash_trials_decision_and_ladder(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url, config = one_assert_job(tmp_path)
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy())
    address = f"127.0.0.1:{_free_port()}"
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS,
        args=["--config", str(config), "--policies", str(policies), "--metrics-listen", address],
    )
    wait_until_stopped(daemon, "hpo")
    metrics = _scrape(address)

    # The worker that died of the assert, by the supervisor's classification.
    assert _by(metrics["gpuwatchd_worker_crashes_total"], "job_name", "kind") == {
        ("hpo", "cuda_assert"): 1.0
    }
    # Trials by state: what the study itself holds (the dead trial FAIL, the rest and its
    # retry COMPLETE), each counted once although the hook and the crash both name it.
    in_study = states(url, "hpo")
    assert in_study.get("FAIL") == 1 and in_study.get("COMPLETE", 0) >= 2, in_study
    assert _by(metrics["gpuwatchd_study_trials_total"], "job_name", "study", "state") == {
        ("hpo", "hpo", state): float(n) for state, n in in_study.items()
    }
    # The restart_study decision with its outcome, as the journal has it.
    journaled = [d for d in decisions(daemon.workdir / "state") if d["action"] == "restart_study"]
    assert [d["outcome"] for d in journaled] == ["applied"]
    counted = _by(metrics["gpuwatchd_decisions_total"], "policy", "action", "outcome")
    assert counted[("crashed-trials-restart", "restart_study", "applied")] == 1.0
    # The ladder and the slots.
    assert _by(metrics["gpuwatchd_job_parallelism"], "job_name") == {("hpo",): 1.0}
    assert _by(metrics["gpuwatchd_job_parallelism_max"], "job_name") == {("hpo",): 1.0}
    assert _by(metrics["gpuwatchd_job_workers"], "job_name", "state") == {("hpo", "stopped"): 1.0}
    assert _by(metrics["gpuwatchd_job_worker_restarts_total"], "job_name") == {("hpo",): 1.0}


def test_xid_errors_are_counted_per_gpu_since_the_start(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    """25 Xid errors on GPU 0: the counter says 25, while ``status`` lists the last 20."""
    script = json.loads(json.dumps(TWO_GPUS))
    # five at each of samples 1-5 (a tick plays one sample: 25 ticks would be 5 s)
    script["devices"][0]["xids"] = [[1 + n // 5, 31] for n in range(25)]
    address = f"127.0.0.1:{_free_port()}"
    daemon = run_daemon(script=script, args=["--metrics-listen", address])
    first = TWO_GPUS["devices"][0]
    key = ("0", first["uuid"], first["name"], socket.gethostname(), "31")
    labels = ("gpu", "UUID", "model_name", "Hostname", "xid")

    def xids() -> float:
        counted = _by(_scrape(address).get("gpuwatchd_xid_errors_total", {}), *labels)
        return counted.get(key, 0.0)

    daemon.wait_until(lambda: xids() == 25.0, timeout_s=30, what="25 Xid errors counted")
    assert len(daemon.status()["xid_events"]) == 20
    metrics = _scrape(address)
    assert _by(metrics["gpuwatchd_gpu_temperature_celsius"], "gpu") == {("0",): 61.0, ("1",): 35.0}
    assert _by(metrics["gpuwatchd_gpu_memory_total_bytes"], "gpu") == {
        ("0",): float(80 * 2**30),
        ("1",): float(80 * 2**30),
    }


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        line = next(x for x in status if x.startswith("Threads:"))
    return int(line.split()[1])


def test_a_flood_of_idle_connections_is_bounded_and_the_daemon_keeps_working(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    address = f"127.0.0.1:{_free_port()}"
    daemon = run_daemon(args=["--metrics-listen", address])
    host, port = address.split(":")
    assert "gpuwatchd_up" in _scrape(address)
    before = _threads(daemon.process.pid)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
    try:
        # Past MAX_CONNECTIONS the endpoint answers 503 at once instead of a thread each.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{address}/metrics", timeout=10)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        assert _threads(daemon.process.pid) <= before + MAX_CONNECTIONS
        # The control socket and the ticks go on.
        ticks = daemon.status()["ticks"]
        daemon.wait_until(lambda: daemon.status()["ticks"] > ticks, what="more ticks")
        # A client that starts a request and stalls is dropped, not waited for forever.
        stalled = idle[0]
        stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        stalled.settimeout(30)
        assert stalled.recv(4096) == b""
    finally:
        for conn in idle:
            conn.close()
    daemon.wait_until(lambda: "gpuwatchd_up" in _scrape_or_empty(address), what="a scrape")


def _scrape_or_empty(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    try:
        return _scrape(address)
    except (urllib.error.HTTPError, OSError):
        return {}


_ACTIVATION = """
import json, os, socket, sys
from gpuwatchd.metrics.sockets import ActivationError, activated_socket
kind = sys.argv[1]
if kind == "listening":
    sock = socket.create_server(("127.0.0.1", 0))
else:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
os.dup2(sock.fileno(), 3)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="2", LISTEN_FDNAMES="control:metrics")
os.dup2(sock.fileno(), 4)
os.environ["LISTEN_FDNAMES"] = "other:metrics"
try:
    got = activated_socket()
    result = {"fd": got.fileno(), "port": got.getsockname()[1] == sock.getsockname()[1]}
except ActivationError as exc:
    result = {"error": str(exc)}
result["env"] = sorted(k for k in os.environ if k.startswith("LISTEN_"))
result["inheritable"] = [os.get_inheritable(3), os.get_inheritable(4)]
print(json.dumps(result))
"""


@pytest.mark.parametrize("kind", ["listening", "datagram"])
def test_activated_socket_follows_sd_listen_fds(kind: str) -> None:
    """The fd named ``metrics`` (the second of two) is taken, both get FD_CLOEXEC, the
    variables are gone; a datagram socket under that name is refused."""
    ran = subprocess.run(
        [sys.executable, "-c", _ACTIVATION, kind],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["env"] == [] and result["inheritable"] == [False, False]
    if kind == "listening":
        assert result["fd"] == 4 and result["port"]
    else:
        assert result["error"] == "fd 4 (metrics) is not a listening stream socket"


def test_activated_socket_ignores_another_process_fds_and_unsets_them() -> None:
    from gpuwatchd.metrics.sockets import activated_socket

    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "metrics", "PATH": "/bin"}
    assert activated_socket(env) is None
    assert env == {"PATH": "/bin"}


# -- the account (pure) -----------------------------------------------------------------


def _snapshot(*events: JobEvent, jobs: tuple[JobInfo, ...] = ()) -> Snapshot:
    return Snapshot(timestamp_s=1.0, gpus=(), host=None, jobs=jobs, events=events)


def test_account_counts_each_trial_once_and_caps_label_sets() -> None:
    account = MetricsAccount({"hpo": "criteria"})
    account.observe_tick(
        _snapshot(
            JobEvent(1.0, "hpo", "trial", pid=7, trial_number=3, trial_state="COMPLETE"),
            JobEvent(1.0, "hpo", "trial", pid=7, trial_number=4, trial_state="FAIL"),
            JobEvent(1.0, "hpo", "crash", pid=7, crash_kind="cuda_assert", trial_number=4),
            JobEvent(1.0, "hpo", "crash", pid=8, crash_kind="cuda_oom", trial_number=5),
            JobEvent(1.0, "free", "trial", pid=9, trial_number=0, trial_state="PRUNED"),
            JobEvent(1.0, "free", "crash", pid=9, crash_kind="other", trial_number=1),
            jobs=(JobInfo("free", 9, 0.0, study="s"),),
        ),
        0.003,
    )
    copy = account.copy()
    assert copy.crashes == {("hpo", "cuda_assert"): 1, ("hpo", "cuda_oom"): 1, ("free", "other"): 1}
    # Trial 4: the hook's FAIL and its crash are one trial; an unmanaged job's crash
    # fails no trial (nobody marks it in its study).
    assert copy.trials == {
        ("hpo", "criteria", "COMPLETE"): 1,
        ("hpo", "criteria", "FAIL"): 2,
        ("free", "s", "PRUNED"): 1,
    }
    assert copy.tick_buckets[2] == 1 and sum(copy.tick_buckets) == 1
    for n in range(MAX_SERIES + 5):
        account.decided(f"policy-{n}", "log", "logged")
    decided = account.copy().decisions
    assert len(decided) == MAX_SERIES + 1
    assert decided[(OTHER, OTHER, OTHER)] == 5
