"""``gpuwatchd replay --prometheus``: the real 8 x H100 trace backfilled into Debian's
Prometheus as dcgm-exporter series (``promtool tsdb create-blocks-from openmetrics``) gives
the same findings as the CSV resampled at the same step; docs/backtests.md's recording
rules pass ``promtool check rules``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from gpuwatchd.errors import ReplayError
from gpuwatchd.sampling import prometheus
from gpuwatchd.sampling.replay_arrow import read_columns
from gpuwatchd.sampling.trace import Trace
from tests.conftest import BIN, REPO, TRACES
from tests.pg import free_port
from tests.prometheus_tsdb import prometheus_serving, prometheus_tool

TRACE = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"
STEPS_MS = (1000, 15000)  # the default --max-gap (10 s) would cut a 15 s step's streaks
HOSTS = ("gpu-a", "gpu-b")  # the trace as two hosts; "login-0" (one GPU) is left out by --match
MATCH = '{Hostname=~"gpu-.*"}'


def _stamp(ms: int) -> str:
    return f"{ms // 1000}.{ms % 1000:03d}"


def _openmetrics(columns: Any) -> str:
    """The trace's frames as dcgm-exporter's series, each value at its frame's time, for
    each of HOSTS, plus one GPU of a host --match leaves out."""
    stamps_ms = np.round(columns.timestamps_s * 1000).astype(np.int64)
    series = (
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", columns.utilization_gpu_pct, 1.0),
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", columns.memory_used_bytes,
         2.0**-20),
        ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", columns.power_draw_w, 1.0),
    )  # fmt: skip
    lines: list[str] = []
    for metric, help_text, values, factor in series:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        hosts = [(h, columns.gpu_count) for h in HOSTS] + [("login-0", 1)]
        for host, gpus in hosts:
            for k in range(gpus):
                labels = (
                    f'gpu="{k}",UUID="GPU-{host}-{k:04d}",device="nvidia{k}",'
                    f'modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",'
                    f'instance="{host}:9400",job="dcgm-exporter"'
                )
                for stamp, value in zip(stamps_ms.tolist(), values[:, k].tolist(), strict=True):
                    if value == value:  # NaN: no sample, as a scrape without the field
                        lines.append(f"{metric}{{{labels}}} {value * factor:g} {_stamp(stamp)}")
    # gpu-a's GPUs also through gpuwatchd's own series (as contrib/prometheus/scrape.yml
    # stores them: dcgm-exporter's labels)
    own = (
        ("gpuwatchd_gpu_utilization_ratio", columns.utilization_gpu_pct, 0.01),
        ("gpuwatchd_gpu_memory_used_bytes", columns.memory_used_bytes, 1.0),
        ("gpuwatchd_gpu_power_draw_watts", columns.power_draw_w, 1.0),
    )
    for metric, values, factor in own:
        lines += [f"# HELP {metric} gpuwatchd's.", f"# TYPE {metric} gauge"]
        for k in range(columns.gpu_count):
            labels = f'gpu="{k}",UUID="GPU-gpu-a-{k:04d}",modelName="H100",Hostname="gpu-a"'
            for stamp, value in zip(stamps_ms.tolist(), values[:, k].tolist(), strict=True):
                lines.append(f"{metric}{{{labels}}} {value * factor!r} {_stamp(stamp)}")
    # login-0 also has SM activity (a ratio, as DCGM gives it): half its utilization
    lines += [
        "# HELP DCGM_FI_PROF_SM_ACTIVE SM active ratio.",
        "# TYPE DCGM_FI_PROF_SM_ACTIVE gauge",
    ]
    labels = 'gpu="0",UUID="GPU-login-0-0000",modelName="NVIDIA H100 80GB HBM3",Hostname="login-0"'
    for stamp, value in zip(
        stamps_ms.tolist(), columns.utilization_gpu_pct[:, 0].tolist(), strict=True
    ):
        lines.append(f"DCGM_FI_PROF_SM_ACTIVE{{{labels}}} {value / 200:g} {_stamp(stamp)}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _resampled_csv(columns: Any, path: Path, step_ms: int) -> tuple[int, int]:
    """The trace as Prometheus answers query_range at ``step_ms`` from its first frame: at
    each step, the last value at or before it (within the 5 min lookback: the trace's
    longest gap is 8.8 s), written as record's CSV; returns (start_ms, end_ms)."""
    stamps_ms = np.round(columns.timestamps_s * 1000).astype(np.int64)
    start, end = int(stamps_ms[0]), int(stamps_ms[-1])
    steps = np.arange(start, end + 1, step_ms, dtype=np.int64)
    rows = np.searchsorted(stamps_ms, steps, side="right") - 1
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB], power.draw [W]"]
    for step, row in zip(steps.tolist(), rows.tolist(), strict=True):
        when = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(step // 1000))
        for k in range(columns.gpu_count):
            util = columns.utilization_gpu_pct[row, k]
            used = columns.memory_used_bytes[row, k] / 2**20
            power = columns.power_draw_w[row, k]
            lines.append(f"{when}.{step % 1000:03d}, {k}, {util:g} %, {used:g} MiB, {power:g} W")
    path.write_text("\n".join(lines) + "\n")
    return start, end


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int, int]]:
    """(URL, the folder of the CSVs resampled at STEPS_MS, start ms, end ms) of a private
    Prometheus on 127.0.0.1 whose TSDB holds the trace as dcgm-exporter series of HOSTS."""
    work = tmp_path_factory.mktemp("prometheus")
    columns = read_columns(TRACE, None)
    assert columns is not None
    (work / "dcgm.om").write_text(_openmetrics(columns))
    data = work / "tsdb"
    made = subprocess.run(
        [prometheus_tool("promtool"), "tsdb", "create-blocks-from", "openmetrics",
         str(work / "dcgm.om"), str(data)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    for step_ms in STEPS_MS:
        start, end = _resampled_csv(columns, work / f"resampled-{step_ms}ms.csv", step_ms)
    with prometheus_serving(data, work) as (url, _):
        yield url, work, start, end


def _replay(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", "--json", *argv],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip


def _findings(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a user compares: each finding's start and clear (detector, GPU index, trace
    time, value, end of trace) and each decision (policy, action, GPUs, time)."""
    out: list[tuple[Any, ...]] = []
    for line in lines:
        if line["kind"] in ("finding_started", "finding_cleared"):
            out.append((line["kind"], line["detector"], line["gpu_index"], line["timestamp_s"],
                        round(line["value"], 6), line.get("end_of_trace")))  # fmt: skip
        elif line["kind"] == "decision":
            out.append(("decision", line["policy"], line["action"], line["gpu_indexes"],
                        line["timestamp_s"]))  # fmt: skip
    return out


@pytest.mark.parametrize("step_ms", STEPS_MS)
def test_prometheus_backtest_gives_the_csv_findings_at_the_same_step(
    backfilled: tuple[str, Path, int, int], step_ms: int
) -> None:
    url, work, start_ms, end_ms = backfilled
    # the CSV's frames are a step apart too: its --max-gap as --prometheus's default
    gap = f"{max(10.0, 1.5 * step_ms / 1000)}s"
    from_csv = _replay(str(work / f"resampled-{step_ms}ms.csv"), "--max-gap", gap)
    assert from_csv.returncode == 0, from_csv.stderr
    expected = [json.loads(line) for line in from_csv.stdout.splitlines()]
    window = ("--prometheus", url, "--start", _stamp(start_ms), "--end", _stamp(end_ms),
              "--step", f"{step_ms}ms")  # fmt: skip
    from_prometheus = _replay(*window, "--match", MATCH)
    assert from_prometheus.returncode == 0, from_prometheus.stderr
    lines = [json.loads(line) for line in from_prometheus.stdout.splitlines()]

    summaries = [line for line in lines if line["kind"] == "summary"]
    assert [s["trace"] for s in summaries] == list(HOSTS)  # login-0 is not matched
    frames = (end_ms - start_ms) // step_ms + 1
    assert all(s["gpus"] == 8 and s["frames"] == frames for s in summaries)
    want = _findings(expected)
    # the shipped policies find GPU 0 (the idle rank) underused, as docs/backtests.md says
    assert ("finding_started", "low_utilization", 0) in [w[:3] for w in want]
    for host in HOSTS:
        got = [line for line in lines if line["trace"] == host]
        assert _findings(got) == want, host
        started = [g for g in got if g["kind"] == "finding_started"]
        assert started and all(g["gpu_uuid"].startswith(f"GPU-{host}-") for g in started)

    # gpuwatchd's own series of gpu-a: the same findings
    own = _replay(*window, "--series", "gpuwatchd", "--match", '{Hostname="gpu-a"}')
    assert own.returncode == 0, own.stderr
    own_lines = [json.loads(line) for line in own.stdout.splitlines()]
    assert [s["trace"] for s in own_lines if s["kind"] == "summary"] == ["gpu-a"]
    assert _findings(own_lines) == want


class _CountingSession(requests.Session):
    """A requests session that counts its POSTs (query_range requests)."""

    posts = 0

    def post(self, *args: Any, **kwargs: Any) -> requests.Response:
        self.posts += 1
        return super().post(*args, **kwargs)


def test_chunks_under_the_point_limit_join_into_the_same_trace(
    backfilled: tuple[str, Path, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _, start_ms, end_ms = backfilled
    query = prometheus.PrometheusRange(url, start_ms / 1000, end_ms / 1000, 1.0)
    with _CountingSession() as whole_session:
        whole_session.trust_env = False
        whole = prometheus.read_prometheus(query, whole_session)
        assert whole_session.posts == 2  # the series count, then one query_range
    # 52 series (2 hosts x 8 GPUs x 3 metrics, login-0's 3 and its SM activity): 96 steps
    # per request for 5,000 points
    monkeypatch.setattr(prometheus, "POINTS_PER_REQUEST", 5000)
    with _CountingSession() as chunked_session:
        chunked_session.trust_env = False
        chunked = prometheus.read_prometheus(query, chunked_session)
        steps = (end_ms - start_ms) // 1000 + 1
        assert chunked_session.posts == 1 + -(-steps // (5000 // 52))
    assert [t.path for t in chunked] == [*HOSTS, "login-0"]  # no --match: every host
    for a, b in zip(whole[:2], chunked[:2], strict=True):
        assert a.frame_count == b.frame_count == steps
        assert a.names == b.names == tuple(f"{a.path}/{k}" for k in range(8))
        for metric in ("timestamps_s", "utilization_gpu_pct", "memory_used_bytes", "power_draw_w"):
            np.testing.assert_array_equal(getattr(a, metric), getattr(b, metric))
        assert np.isnan(a.temperature_gpu_c).all()  # no DCGM_FI_DEV_GPU_TEMP series: NA
    # login-0's 4 series at 50 ms: 13,881 steps, over Prometheus's 11,000 points per series
    # in one query: CHUNK_STEPS (10,000) per request
    monkeypatch.undo()
    fine = prometheus.PrometheusRange(
        url, start_ms / 1000, end_ms / 1000, 0.05, '{Hostname="login-0"}'
    )
    with _CountingSession() as fine_session:
        fine_session.trust_env = False
        (login_fine,) = prometheus.read_prometheus(fine, fine_session)
        assert fine_session.posts == 1 + 2
    assert len(login_fine.frames) == (end_ms - start_ms) // 50 + 1
    # SM activity makes login-0 a trace of samples for the per-sample engine, in percent
    login = chunked[2]
    assert isinstance(login, Trace) and login.gpu_count == 1
    util = [f.samples[0].utilization_gpu_pct for f in login.frames]
    assert [f.samples[0].sm_active_pct for f in login.frames] == pytest.approx(
        [u / 2 for u in util]
    )


def test_streamed_chunks_are_the_whole_read_cut_by_request(
    backfilled: tuple[str, Path, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stream_prometheus gives each query_range answer's frames of each host, which join
    into the whole read; the backtest fed those chunks gives the whole read's events,
    past the whole read's point cap."""
    from gpuwatchd.backtest import backtest_prometheus, run_backtest
    from gpuwatchd.policyfiles import default_policy_path, load_policies

    url, _, start_ms, end_ms = backfilled
    query = prometheus.PrometheusRange(url, start_ms / 1000, end_ms / 1000, 1.0, MATCH)
    with requests.Session() as session:
        session.trust_env = False
        whole = prometheus.read_prometheus(query, session)
    # 48 series (2 hosts x 8 GPUs x 3 metrics): 104 steps per request for 5,000 points
    monkeypatch.setattr(prometheus, "POINTS_PER_REQUEST", 5000)
    monkeypatch.setattr(prometheus, "MAX_REPLAY_POINTS", 1000)  # a whole read is refused
    with _CountingSession() as counting:
        counting.trust_env = False
        chunks = list(prometheus.stream_prometheus(query, counting))
        assert counting.posts == 1 + len(chunks)
    steps = (end_ms - start_ms) // 1000 + 1
    assert len(chunks) == -(-steps // (5000 // 48))
    for host, trace in zip(HOSTS, whole, strict=True):
        parts = [chunk[host] for chunk in chunks]
        assert all(0 < part.frame_count <= 5000 // 48 for part in parts)
        assert {(part.names, part.uuids) for part in parts} == {(trace.names, trace.uuids)}
        for metric in ("timestamps_s", "utilization_gpu_pct", "memory_used_bytes", "power_draw_w"):
            np.testing.assert_array_equal(
                np.concatenate([getattr(part, metric) for part in parts]), getattr(trace, metric)
            )
    with pytest.raises(ReplayError, match="more than 1,000 points"):
        prometheus.read_prometheus(query)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    policies = load_policies([default_policy_path()])
    streamed = backtest_prometheus(query, policies, max_gap_s=10.0)
    assert [r.summary.path for r in streamed] == list(HOSTS)
    for result, trace in zip(streamed, whole, strict=True):
        assert result.summary.vectorized and result.summary.frames == steps
        assert result.events == run_backtest(trace, policies, max_gap_s=10.0).events


def test_plot_draws_one_host(backfilled: tuple[str, Path, int, int], tmp_path: Path) -> None:
    url, _, start_ms, end_ms = backfilled
    window = ("--prometheus", url, "--start", _stamp(start_ms), "--end", _stamp(end_ms))
    png = tmp_path / "gpu-a.png"
    done = _replay(*window, "--match", '{Hostname="gpu-a"}', "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [json.loads(line)["trace"] for line in done.stdout.splitlines()][-1] == "gpu-a"
    both = _replay(*window, "--match", MATCH, "--plot", str(tmp_path / "both.png"))
    assert both.returncode == 1 and "--plot draws one host; 2 here" in both.stdout
    assert not (tmp_path / "both.png").exists()


def test_prometheus_errors_are_one_clear_line(backfilled: tuple[str, Path, int, int]) -> None:
    url, _, start_ms, end_ms = backfilled
    window = ("--start", _stamp(start_ms), "--end", _stamp(end_ms), "--step", "1s")
    cases = [
        (("--prometheus", "ftp://127.0.0.1/", *window), "not an http:// or https:// URL"),
        (("--prometheus", url, *window, "--match", 'Hostname="x"'), "label matchers in braces"),
        (("--prometheus", url, *window, "--match", '{Hostname=~"("}'), "HTTP 400: bad_data"),
        (("--prometheus", url, *window, "--match", '{Hostname="none"}'), "no dcgm-exporter series"),
        (("--prometheus", url, "--start", "yesterday", "--end", "1"), "--start 'yesterday'"),
        (("--prometheus", url, "--start", _stamp(end_ms), "--end", _stamp(start_ms)),
         "--end is before --start"),
        (("--prometheus", f"http://127.0.0.1:{free_port()}", *window), "ConnectionError"),
        (("--prometheus", f"http://alice:s3cret@127.0.0.1:{free_port()}", *window),
         "http://***@127.0.0.1:"),
        (("--prometheus", "ftp://alice:s3cret@127.0.0.1/", *window), "'ftp://***@127.0.0.1/'"),
        # a read past the memory cap is refused before any point is fetched
        (("--prometheus", url, "--start", _stamp(start_ms), "--end", _stamp(end_ms), "--step",
          f"{max(1, (end_ms - start_ms) // 10_000_000)}ms"), "more than 20,000,000 points"),
    ]  # fmt: skip
    for argv, message in cases:
        done = _replay(*argv)
        assert done.returncode != 0, argv
        assert message in done.stdout + done.stderr, (argv, done.stdout, done.stderr)
        assert "s3cret" not in done.stdout + done.stderr


def test_gpu_labels_become_distinct_nvml_indexes() -> None:
    # numbered GPUs keep their index; a label naming none (a UUID, a superscript digit)
    # comes after them and never takes a numbered GPU's index
    assert prometheus.gpu_indexes("h", ["x", "1", "²", "0"]) == (
        ("0", "1", "x", "²"),
        (0, 1, 2, 3),
    )
    assert prometheus.gpu_indexes("h", ["GPU-abc", "3"]) == (("3", "GPU-abc"), (3, 4))
    with pytest.raises(ReplayError, match="h: two GPUs with one index"):
        prometheus.gpu_indexes("h", ["1", "01"])


def test_recording_rules_in_the_docs_pass_promtool(tmp_path: Path) -> None:
    docs = (REPO / "docs" / "backtests.md").read_text()
    block = re.search(r"<!-- recording rules -->\n```yaml\n(.*?)```", docs, re.S)
    assert block, "docs/backtests.md: the recording rules block is missing"
    rules = tmp_path / "gpu-idle.rules.yml"
    rules.write_text(block.group(1))
    checked = subprocess.run(
        [prometheus_tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout, checked.stdout


class _MemorySession(requests.Session):
    """A requests session that notes the memory Python has allocated (tracemalloc) as
    each ``query_range`` is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.trust_env = False
        self.traced: list[int] = []

    def post(self, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        if str(url).endswith("/query_range"):
            self.traced.append(tracemalloc.get_traced_memory()[0])
        return super().post(url, *args, **kwargs)


def test_a_streamed_read_holds_one_answer_at_a_time(
    backfilled: tuple[str, Path, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the next query_range is sent, the previous answer's parsed JSON (a list, an
    int and a str per point: ~180 bytes) is gone: what a streamed read holds does not
    grow with the range (bench/prometheus.py measures the process's peak RSS)."""
    url, _, start_ms, end_ms = backfilled
    # 48 series at 200 ms: 2,726 steps, 1,250 per request of 60,000 points: 3 requests
    monkeypatch.setattr(prometheus, "POINTS_PER_REQUEST", 60_000)
    query = prometheus.PrometheusRange(url, start_ms / 1000, end_ms / 1000, 0.2, MATCH)
    frames = 0
    tracemalloc.start()
    try:
        with _MemorySession() as session:
            for chunk in prometheus.stream_prometheus(query, session):
                frames += sum(trace.frame_count for trace in chunk.values()) // len(HOSTS)
                del chunk
    finally:
        tracemalloc.stop()
    assert frames == (end_ms - start_ms) // 200 + 1
    assert len(session.traced) == 3
    grown = [traced - session.traced[0] for traced in session.traced[1:]]
    # one answer's JSON held: 1,250 steps x 48 series x ~180 bytes, 10.8 MB (its frames
    # as arrays, 16 GPUs x 8 arrays of 8 bytes, 1.3 MB: gone too, the loop let them go)
    assert max(grown) < 1_000_000, grown


def test_malformed_points_are_refused_with_what_is_wrong() -> None:
    """A server (not Prometheus, or a broken proxy) answering query_range with points
    that are not ``[time, "value"]``: one clear error, no trace."""
    answer: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            labels = {"__name__": "DCGM_FI_DEV_GPU_UTIL", "gpu": "0", "Hostname": "h"}
            if self.path.endswith("/series"):
                doc: Any = {"status": "success", "data": [labels]}
            else:
                doc = {"status": "success", "data": {"resultType": "matrix", "result": [
                    {"metric": labels, "values": answer["values"]}]}}  # fmt: skip
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    query = prometheus.PrometheusRange(url, 100.0, 130.0, 15.0)
    shape = 'a point that is not [time, "value"]'
    cases = [
        ([[100, "5"], [115, 7]], shape),  # a number as the value
        ([[100, "5"], [True, "7"]], shape),  # a bool as the time
        ([[100, "5"], ["115", "7"]], shape),  # a string as the time
        ([[100, "5"], [115]], shape),
        ([[100, "5"], {"t": 115}], shape),
        ([[100, "5"], [115, "lots"]], "a point whose value is not a number"),
        ([[100, "5"], [-115, "7"]], "a point whose time is not within 1970-2100"),
        ([[100, "5"], [10**400, "7"]], "a point whose time is not within 1970-2100"),
    ]
    try:
        with requests.Session() as session:
            session.trust_env = False
            answer["values"] = [[100, "5"], [115.0, "7"], [130, "NaN"]]
            (trace,) = prometheus.read_prometheus(query, session)
            assert trace.timestamps_s.tolist() == [100.0, 115.0, 130.0]
            assert trace.utilization_gpu_pct[:2, 0].tolist() == [5.0, 7.0]
            for values, message in cases:
                answer["values"] = values
                with pytest.raises(ReplayError, match=re.escape(message)):
                    prometheus.read_prometheus(query, session)
                with pytest.raises(ReplayError, match=re.escape(message)):
                    list(prometheus.stream_prometheus(query, session))
    finally:
        server.shutdown()
        server.server_close()
