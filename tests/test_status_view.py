"""``status`` answered from the daemon's status view (gpuwatchd/daemon/statusview.py):
jobs' reports show at once, the tick's parts agree with the tick, ``--full`` gives the
policies' definitions, a reply too big for a line leaves out the last jobs, and a GPU
process's Slurm job reads the same in ``status`` and on the metrics endpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TWO_GPUS, RunningDaemon
from gpuwatchd.cli.commands import Output
from gpuwatchd.cli.commands.status import render
from gpuwatchd.config import Settings
from gpuwatchd.control.protocol import MAX_LINE_BYTES, json_text
from gpuwatchd.daemon import Daemon
from gpuwatchd.daemon.statusview import TRUNCATED_PARTS
from pg import free_port

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "h100x8_gpt350m_ckpt10_100ms.csv"
POLICIES = ROOT / "policies" / "default.yaml"

REPORT = {
    "epoch": 1,
    "step_time_s": 0.25,
    "data_wait_s": 0.05,
    "data_wait_fraction": 0.2,
    "samples_per_s": 512.0,
}


class RawClient:
    """A blocking raw-socket client of the control socket (one JSON line per message)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.lines = self.sock.makefile("rb")
        self.next_id = 0

    def call(self, op: str, **params: Any) -> tuple[dict[str, Any], int]:
        """Send ``op``; return its reply and the reply line's size in bytes."""
        self.next_id += 1
        self.sock.sendall(json.dumps({"id": self.next_id, "op": op, **params}).encode() + b"\n")
        line = self.lines.readline()
        reply: dict[str, Any] = json.loads(line)
        assert reply["id"] == self.next_id, reply
        return reply, len(line)

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def attach(path: str, job: str, knobs: dict[str, Any] | None = None) -> RawClient:
    client = RawClient(path)
    knobs = knobs or {"num_workers": {"value": 4, "min": 0, "max": 16}}
    reply, _ = client.call(
        "hello", role="job", job=job, pid=os.getpid(), cuda_devices=["0"], knobs=knobs
    )
    assert reply["ok"], reply
    return client


def test_reports_show_at_once_and_the_tick_parts_agree_with_the_tick(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon(args=["--interval", "5"])  # reports land between ticks
    job = attach(str(daemon.socket), "digits")
    asker = RawClient(str(daemon.socket))
    try:
        for steps in (1, 2, 3):
            reply, _ = job.call("report", report=REPORT | {"steps": steps})
            assert reply["ok"], reply
            status, _ = asker.call("status")
            (entry,) = status["result"]["jobs"]
            assert entry["last_report"]["steps"] == steps
        # the user's view: gpuwatchctl shows the last report too
        (shown,) = daemon.status()["jobs"]
        assert shown["last_report"]["steps"] == 3 and shown["knobs"]["num_workers"]["value"] == 4
        # the GPUs shown are the last tick's: stamped with its time, across ticks
        ticks = set()
        daemon.wait_until(
            lambda: (
                (s := asker.call("status")[0]["result"])
                and ticks.add(s["ticks"]) is None
                and all(g["timestamp_s"] == s["last_tick_at_s"] for g in s["gpus"])
                and len(ticks) >= 2
            ),
            timeout_s=30,
            what="a status after the next tick, its GPUs stamped with that tick",
        )
    finally:
        job.close()
        asker.close()
    # a detached job leaves the reply
    daemon.wait_until(lambda: daemon.status()["jobs"] == [], what="the job gone from status")


def test_full_gives_the_policies_definitions(run_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = run_daemon()
    short = daemon.status()["policies"]
    names = [p["name"] for p in short["policies"]]
    assert "host-oversubscribed" in names  # the packaged default policies
    assert all(set(p) == {"name"} for p in short["policies"])
    result = daemon.ctl("--json", "status", "--full")
    assert result.returncode == 0, result.stderr
    full = json.loads(result.stdout)["policies"]
    shown = daemon.ctl("--json", "policy", "show")
    assert shown.returncode == 0, shown.stderr
    assert full["policies"] == json.loads(shown.stdout)["policies"]
    assert [p["name"] for p in full["policies"]] == names
    assert all("when" in p and "do" in p for p in full["policies"])
    bad = RawClient(str(daemon.socket))
    try:
        reply, _ = bad.call("status", full="yes")
    finally:
        bad.close()
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    bad = RawClient(str(daemon.socket))
    try:
        both, _ = bad.call("status", full=True, brief=True)
        not_bool, _ = bad.call("status", brief=1)
    finally:
        bad.close()
    for reply in (both, not_bool):
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply


def test_a_status_too_big_for_a_line_leaves_out_the_last_attached_jobs(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon()
    # 64 knobs with 64-character names: about 14 KiB per job in the reply
    knobs = {f"{i:02d}".ljust(64, "k"): {"value": i, "min": 0, "max": 1000} for i in range(64)}
    jobs = [attach(str(daemon.socket), f"big-{n}", knobs) for n in range(8)]
    asker = RawClient(str(daemon.socket))
    try:
        reply, size = asker.call("status")
    finally:
        asker.close()
    assert reply["ok"], reply
    assert size <= MAX_LINE_BYTES
    status = reply["result"]
    kept = [job["name"] for job in status["jobs"]]
    assert 0 < len(kept) < 8
    assert kept == [f"big-{n}" for n in range(len(kept))]  # the first attached stay
    assert status["truncated"]["jobs"] == 8 - len(kept)
    table = daemon.ctl("status")  # and the table still prints, and says what it leaves out
    assert table.returncode == 0, table.stderr
    shown = set(re.findall(r"big-\d+", table.stdout))
    assert "big-0" in shown and len(shown) < 8
    assert f"Not shown (the reply fits one 64 KiB line): jobs {8 - len(shown)}" in table.stdout
    for job in jobs:
        job.close()


def test_status_and_the_metrics_name_the_same_slurm_job_for_a_gpu_process(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    # this process runs on GPU 0 and attaches with a hello naming Slurm job 4242, which its
    # environment does not: status's GPU process and the process's series on the metrics
    # endpoint both name the hello's job
    script = json.loads(json.dumps(TWO_GPUS))
    script["devices"][0]["processes"] = [[os.getpid(), 2**30, 80.0]]
    address = f"127.0.0.1:{free_port()}"
    daemon = run_daemon(script=script, args=["--metrics-listen", address])
    client = RawClient(str(daemon.socket))
    try:
        reply, _ = client.call(
            "hello", role="job", job="train", pid=os.getpid(), slurm={"job_id": "4242"}
        )
        assert reply["ok"], reply
        ticks = daemon.status()["ticks"]
        status = daemon.wait_until(
            lambda: (s := daemon.status())["ticks"] > ticks + 1 and s, what="two ticks"
        )
        (process,) = status["gpus"][0]["processes"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as scraped:
            families = text_string_to_metric_families(scraped.read().decode())
        (series,) = [
            sample.labels
            for family in families
            for sample in family.samples
            if sample.name == "gpuwatchd_gpu_process_sm_active_ratio"
        ]
    finally:
        client.close()
    assert series["pid"] == str(process["pid"]) == str(os.getpid())
    assert series["slurm_job_id"] == (process["slurm"] or {}).get("job_id") == "4242"


def test_the_table_shows_every_job_where_the_whole_status_leaves_some_out(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    # 80 jobs that report, each with the three knobs of bench/control.py: the whole
    # reply (--json) leaves the last out; the table asks for the brief one and shows all
    daemon = run_daemon()
    knobs = {
        "num_workers": {"value": 4, "min": 0, "max": 16},
        "prefetch_factor": {"value": 2, "min": 1, "max": 8},
        "persistent_workers": {"value": True},
    }
    jobs = [attach(str(daemon.socket), f"job-{n:02d}", knobs) for n in range(80)]
    try:
        for job in jobs:
            reply, _ = job.call("report", report=REPORT | {"steps": 10})
            assert reply["ok"], reply
        assert daemon.status()["truncated"]["jobs"] > 0
        table = daemon.ctl("status")
    finally:
        for job in jobs:
            job.close()
    assert table.returncode == 0, table.stderr
    assert set(re.findall(r"job-\d\d", table.stdout)) == {f"job-{n:02d}" for n in range(80)}
    assert "Not shown" not in table.stdout


def test_the_table_of_the_brief_status_is_the_table_of_the_whole_one(
    run_daemon: Callable[..., RunningDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = run_daemon(args=["--interval", "5"])  # no tick between the two requests
    jobs = [attach(str(daemon.socket), f"job-{n}") for n in range(3)]
    asker = RawClient(str(daemon.socket))
    try:
        for steps, job in enumerate(jobs):
            reply, _ = job.call("report", report=REPORT | {"steps": steps})
            assert reply["ok"], reply
        for _ in range(5):  # the whole reply, the brief one, and the whole one unchanged
            whole = asker.call("status")[0]["result"]
            brief, brief_size = asker.call("status", brief=True)
            again = asker.call("status")[0]["result"]
            if again["last_tick_at_s"] == whole["last_tick_at_s"]:
                break
        _, whole_size = asker.call("status")
    finally:
        asker.close()
        for client in jobs:
            client.close()
    brief = brief["result"]
    assert brief_size < whole_size
    assert [j["name"] for j in brief["jobs"]] == [j["name"] for j in whole["jobs"]]
    brief["uptime_s"] = whole["uptime_s"]  # the header's clock, read apart
    tables = []
    with monkeypatch.context() as patched:  # the same "ago"s in both
        patched.setattr(time, "time", lambda: whole["last_tick_at_s"] + 1.0)
        for status in (whole, brief):
            stream = io.StringIO()
            render(status, Output(json_mode=False, stream=stream))
            tables.append(stream.getvalue())
    assert tables[0] == tables[1]
    assert "job-2" in tables[0]


@contextlib.contextmanager
def _replay_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """The daemon's parts on a replayed trace (no hardware), its journal open."""
    settings = Settings(
        devices=f"replay:{TRACE}",
        state_dir=str(tmp_path / "state"),
        socket=str(tmp_path / "c.sock"),
        policies=(str(POLICIES),),
    )
    (tmp_path / "state").mkdir()
    daemon = Daemon(settings)
    daemon.open_samplers()
    daemon.open_journal()
    try:
        yield daemon
    finally:
        daemon.close_journal()


def test_the_view_is_the_status_built_whole_tick_after_tick(tmp_path: Path) -> None:
    # the daemon's parts on a replayed trace (no hardware), ticked by hand: after every tick
    # the reply from the kept parts is the object built whole (gpuwatchd/daemon/report.py)
    with _replay_daemon(tmp_path) as daemon:
        seen = set()
        for _ in range(4):
            daemon.tick()
            view = json.loads(daemon.status_reply(full=True).json_text)
            whole = json.loads(json_text(daemon.status()))
            for status in (view, whole):
                del status["uptime_s"]
                for part in TRUNCATED_PARTS:
                    status["truncated"].setdefault(part, 0)
            assert view == whole
            seen.add(json.dumps(view["gpus"]))
        assert len(seen) == 4  # the GPUs changed every tick and the view followed


def test_a_full_status_or_long_lists_fit_by_names_then_the_last_entries(tmp_path: Path) -> None:
    # past the budget, after the history (decisions, findings) and jobs: the policies'
    # definitions (their names stay), then the live lists from their end, managed jobs last
    with _replay_daemon(tmp_path) as daemon:
        daemon.tick()
        names = [{"name": name} for name in daemon.engine.policies.names]
        short = len(daemon.status_reply().json_text)
        managed = [{"job": f"job-{n:03d}", "note": "m" * 100} for n in range(200)]
        cordons = [{"gpu": n, "by": "c" * 100} for n in range(200)]
        for lists, budget in [(False, short + 20), (True, short + 10_000)]:
            text = daemon.status_view.reply(
                jobs=(),
                managed=managed if lists else [],
                policies=daemon.engine.policies,
                policies_loaded_at_s=0.0,
                paused=False,
                cordons=cordons if lists else [],
                holds=(),
                full=True,
                budget_bytes=budget,
            ).json_text
            assert len(text) <= budget
            reply = json.loads(text)
            assert reply["policies"]["policies"] == names
            assert reply["truncated"]["policies"] == len(names)
            assert reply["decisions"] == reply["findings"] == []
        kept = [entry["job"] for entry in reply["managed"]]
        assert 0 < len(kept) < 200 and kept == [f"job-{n:03d}" for n in range(len(kept))]
        assert reply["cordons"] == []
        assert (reply["truncated"]["cordons"], reply["truncated"]["managed"]) == (
            200,
            200 - len(kept),
        )
