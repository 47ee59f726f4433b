"""Parquet traces: ``gpuwatchd record --out FILE.parquet`` and ``gpuwatchd replay`` of a
file, a directory or a glob of many hosts' files (gpuwatchd/sampling/parquet.py)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from conftest import TRACES
from gpuwatchd.backtest import backtest_file, backtest_parquet
from gpuwatchd.cli.main import main
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.record import Recorder
from gpuwatchd.sampling.nvml import NvmlSampler
from gpuwatchd.sampling.replay import parse_trace
from gpuwatchd.testing import FakeClock, FakeDevice, FakeNvml, install_fake_nvml

pytest.importorskip("pyarrow")
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpuwatchd.sampling.parquet import ParquetTraceWriter, read_parquet

UUIDS = [f"GPU-{k}1111111-2222-3333-4444-555555555555" for k in range(3)]
POLICY = (
    "policies:\n  - name: idle\n    when: {low_utilization: {percent: 20, for: 10s}}\n"
    "    do: [{log: {}}]\n    cooldown: 1h\n"
)


def fleet() -> FakeNvml:
    """GPU 0 idle at 2 %, GPU 1 busy, GPU 2 NVML cannot read its power."""
    return FakeNvml(
        [
            FakeDevice(UUIDS[0], series={"utilization.gpu": [2.0], "power.draw": [70.123]}),
            FakeDevice(UUIDS[1], series={"utilization.gpu": [90.0, 95.0]}),
            FakeDevice(UUIDS[2], series={"utilization.gpu": [50.0]}, unsupported=["power.draw"]),
        ]
    )


def record_both(tmp_path: Path, count: int, host: str = "gpu-01") -> tuple[Path, Path]:
    """Record the same samples of :func:`fleet` to CSV and to Parquet (fake clocks)."""
    csv_text = io.StringIO()
    parquet_path = tmp_path / f"{host}.parquet"
    writer = ParquetTraceWriter(str(parquet_path), host, row_group_rows=16)
    with install_fake_nvml(fleet()):
        for out in (csv_text, writer):
            sampler = NvmlSampler()
            sampler.open()
            wall, mono = FakeClock(1_753_574_010.945), FakeClock()
            recorder = Recorder(sampler, out, interval_s=1.0, wall=wall, monotonic=mono)
            for _ in range(count):
                recorder.record_once()
                mono.advance(1.0)
            sampler.close()
    writer.close()
    csv_path = tmp_path / f"{host}.csv"
    csv_path.write_text(csv_text.getvalue())
    return csv_path, parquet_path


def test_parquet_recording_replays_as_its_csv_twin(tmp_path: Path) -> None:
    csv_path, parquet_path = record_both(tmp_path, count=40)
    meta = pq.ParquetFile(parquet_path).metadata
    # a row group once 16 rows are buffered: 6 samples of 3 GPUs, 6 x 18 + 12 rows
    assert meta.num_rows == 120 and meta.num_row_groups == 7
    table = pq.read_table(parquet_path)
    assert table.column("host").to_pylist()[:3] == ["gpu-01"] * 3
    power = table.column("power.draw [W]").to_pylist()
    assert power[0] == 70.12 and power[2] is None  # 0.01 W as in the CSV; [N/A] is null
    policies = load_policies([default_policy_path()])
    (got,) = backtest_parquet([str(parquet_path)], policies)
    want = backtest_file(str(csv_path), policies)
    assert got.summary.vectorized and got.summary.gpu_samples == 120
    assert len(got.events) > 0
    assert [(type(e), e.timestamp_s) for e in got.events] == [
        (type(e), e.timestamp_s) for e in want.events
    ]
    assert [getattr(e, "finding", None) for e in got.events] == [
        getattr(e, "finding", None) for e in want.events
    ]


def test_a_directory_of_hosts_is_one_backtest_with_gpus_named_host_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet_dir = tmp_path / "fleet"
    fleet_dir.mkdir()
    for host in ("gpu-01", "gpu-02"):
        record_both(fleet_dir, count=30, host=host)
        (fleet_dir / f"{host}.csv").unlink()
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    for source in (str(fleet_dir), str(fleet_dir / "gpu-*.parquet")):
        assert main(["replay", source, "--policies", str(policy), "--json"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        started = [r for r in records if r["kind"] == "finding_started"]
        assert [(r["trace"], r["gpu_index"], r["gpu_uuid"]) for r in started] == [
            ("gpu-01", 0, UUIDS[0]),
            ("gpu-02", 0, UUIDS[0]),
        ]
        summaries = [r for r in records if r["kind"] == "summary"]
        assert [(s["trace"], s["gpus"], s["frames"]) for s in summaries] == [
            ("gpu-01", 3, 30),
            ("gpu-02", 3, 30),
        ]
    traces = read_parquet(sorted(str(p) for p in fleet_dir.glob("*.parquet")))
    assert [t.names for t in traces] == [
        ("gpu-01/0", "gpu-01/1", "gpu-01/2"),
        ("gpu-02/0", "gpu-02/1", "gpu-02/2"),
    ]


def test_a_shipped_trace_converted_to_parquet_gives_its_events(tmp_path: Path) -> None:
    """The H100 trace written to Parquet row by row (as record would) replays alike,
    streamed row group by row group (4,000 rows each) through the array backtest."""
    from gpuwatchd.sampling.parquet import host_row_groups

    trace = parse_trace(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv")
    path = tmp_path / "h100.parquet"
    writer = ParquetTraceWriter(str(path), "h100", row_group_rows=4000)
    for frame in trace.frames:
        writer.write(frame.samples, frame.timestamp_s)
    writer.close()
    assert pq.ParquetFile(path).metadata.num_row_groups == 11
    assert host_row_groups([str(path)]) == {"h100": [(str(path), list(range(11)))]}
    policies = load_policies([default_policy_path()])
    (got,) = backtest_parquet([str(path)], policies)
    want = backtest_file(str(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"), policies)
    assert got.summary.frames == 5449 and got.summary.vectorized
    assert [e.kind for e in got.events] == [e.kind for e in want.events]
    assert [round(e.timestamp_s, 3) for e in got.events] == [
        round(e.timestamp_s, 3) for e in want.events
    ]


def test_replay_of_a_missing_parquet_glob_fails_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path / "none-*.parquet")]) == 1
    assert "no Parquet file" in capsys.readouterr().err
    (tmp_path / "text.parquet").write_text("timestamp, index\n")
    assert main(["replay", str(tmp_path / "text.parquet")]) == 1
    assert "text.parquet: not a readable Parquet file" in capsys.readouterr().err


def test_record_subprocess_to_parquet_and_replay(tmp_path: Path) -> None:
    """`gpuwatchd record --out FILE.parquet` on the fake NVML, then `gpuwatchd replay`."""
    import socket
    import subprocess
    import sys

    nvml = tmp_path / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "devices": [
                    {"uuid": UUIDS[0], "series": {"utilization.gpu": [97, 3]}},
                    {"uuid": UUIDS[1], "unsupported": ["power.draw"]},
                ]
            }
        )
    )
    out = tmp_path / "rec.parquet"
    command = [sys.executable, "-m", "gpuwatchd.testing.fakerun", str(nvml), "record"]
    done = subprocess.run(
        [*command, "--count", "4", "--interval", "50ms", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "recorded 4 samples (8 rows)" in done.stderr
    table = pq.read_table(out)
    assert table.num_rows == 8 and table.column("index").to_pylist() == [0, 1] * 4
    assert table.column("host").to_pylist() == [socket.gethostname()] * 8
    assert table.column("utilization.gpu [%]").to_pylist()[:4] == [97.0, 0.0, 3.0, 0.0]
    assert table.column("power.draw [W]").to_pylist()[1] is None
    again = subprocess.run(
        [*command, "--count", "1", "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1 and "already exists" in again.stderr
    dcgm = subprocess.run(
        [*command, "--count", "1", "--dcgm", "--out", str(tmp_path / "d.parquet")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert dcgm.returncode == 1 and "CSV only" in dcgm.stderr
    (result,) = backtest_parquet([str(out)], load_policies([default_policy_path()]))
    assert result.summary.gpu_count == 2 and result.summary.frames == 4


def write_parquet(path: Path, frames: list, row_group_rows: int) -> None:  # type: ignore[type-arg]
    writer = ParquetTraceWriter(str(path), "h100", row_group_rows=row_group_rows)
    for frame in frames:
        writer.write(frame.samples, frame.timestamp_s)
    writer.close()


def test_many_row_groups_replay_in_bounded_batches_as_the_whole_file(tmp_path: Path) -> None:
    """Streamed 1,000 rows at a time (125 samples of 8 GPUs) across 11 row groups of
    4,000 rows, reading only the engine's columns: the per-sample engine's events on
    the file read whole."""
    from gpuwatchd.backtest import backtest_stream, run_backtest
    from gpuwatchd.backtest_arrays import ARRAY_METRICS
    from gpuwatchd.sampling.parquet import stream_parquet

    trace = parse_trace(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv")
    path = tmp_path / "h100.parquet"
    write_parquet(path, list(trace.frames), row_group_rows=4000)
    files = [str(path)]
    chunks = list(stream_parquet(files, "h100", metrics=ARRAY_METRICS, batch_rows=1000))
    assert len(chunks) >= 43 and max(c.frame_count for c in chunks) <= 1000 // 8 + 1
    assert sum(c.frame_count for c in chunks) == 5449
    policies = load_policies([default_policy_path()])
    got = backtest_stream("h100", iter(chunks), policies)
    (whole,) = read_parquet(files)
    want = run_backtest(whole, policies, engine="steps")
    assert got is not None and got.summary.vectorized and len(want.events) > 0
    assert got.events == want.events


def test_a_gpu_first_seen_in_a_later_row_group_keeps_its_uuid(tmp_path: Path) -> None:
    """uuid and name are read until every GPU seen has one; GPU 7, first in the third row
    group (read without them), is read again for its own."""
    trace = parse_trace(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv")
    frames = [
        type(f)(f.timestamp_s, f.samples[:7] if k < 1200 else f.samples)
        for k, f in enumerate(trace.frames)
    ]
    path = tmp_path / "h100.parquet"
    write_parquet(path, frames, row_group_rows=4000)
    assert pq.ParquetFile(path).metadata.num_row_groups > 3
    uuids = tuple(s.uuid for s in trace.frames[0].samples)
    (columns,) = read_parquet([str(path)])
    assert columns.uuids == uuids and columns.frame_count == 5449
    (result,) = backtest_parquet([str(path)], load_policies([default_policy_path()]))
    assert result.summary.vectorized and result.summary.gpu_count == 8
    found = {e.finding.gpu_uuid for e in result.events if hasattr(e, "finding")}
    assert uuids[7] in found


def write_fleet(path: Path, hosts: tuple[str, ...], hours: int) -> None:
    """``hours`` at 1 Hz of 8 GPUs per host in ``hosts``, rows of the hosts interleaved in
    one Parquet file (row groups of 65,536 rows): :func:`fleet_table`."""
    pq.write_table(fleet_table(hosts, 3600 * hours), path, row_group_size=1 << 16)


def fleet_table(hosts: tuple[str, ...], seconds: int) -> pa.Table:
    """``seconds`` at 1 Hz of 8 GPUs per host in ``hosts``, each second's rows host by
    host: the H100 trace's every 10th frame, cycled (one cycle every ~9 minutes), host
    ``k`` ``7 k`` frames ahead in the cycle."""
    import numpy as np

    from gpuwatchd.sampling.columns import TraceColumns
    from gpuwatchd.sampling.parquet import parquet_schema

    columns = TraceColumns.from_trace(parse_trace(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"))
    assert columns is not None
    util = columns.utilization_gpu_pct[::10]
    used = np.floor(columns.memory_used_bytes[::10] / 2**20)
    power = columns.power_draw_w[::10]
    gpus = columns.gpu_count
    second = np.repeat(np.arange(seconds), gpus * len(hosts))
    host = np.tile(np.repeat(np.arange(len(hosts)), gpus), seconds)
    gpu = np.tile(np.arange(gpus), seconds * len(hosts))
    row = (second + 7 * host) % util.shape[0]
    names = np.asarray(hosts)[host]
    table = pa.table(
        {
            "host": pa.array(names),
            "timestamp": pa.array((1_753_574_400 + second) * 1000),
            "index": pa.array(gpu.astype(np.int32)),
            "uuid": pa.array([f"GPU-{h}-{g}" for h, g in zip(names, gpu.tolist(), strict=True)]),
            "name": pa.array(["NVIDIA H100 80GB HBM3"] * second.shape[0]),
            "utilization.gpu [%]": util[row, gpu],
            "memory.used [MiB]": used[row, gpu].astype(np.int64),
            "memory.total [MiB]": np.full(second.shape[0], 81559, dtype=np.int64),
            "temperature.gpu": np.full(second.shape[0], 60.0),
            "power.draw [W]": power[row, gpu],
        }
    )
    return table.cast(parquet_schema())


def test_a_long_multi_host_backtest_keeps_a_bounded_event_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four hours of two hosts' 8 GPUs at 1 Hz (230,400 GPU-samples, ~450 events a
    host): ``--events 100`` prints each host's first 100 events, the same as those of
    ``--events all``, and the same summary counts, with the rest counted."""
    path = tmp_path / "fleet.parquet"
    write_fleet(path, ("gpu-a", "gpu-b"), hours=4)

    def replay(*options: str) -> list[dict[str, object]]:
        assert main(["replay", str(path), "--json", *options]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    every, capped = replay("--events", "all"), replay("--events", "100")
    for host in ("gpu-a", "gpu-b"):
        full = [r for r in every if r["trace"] == host]
        bounded = [r for r in capped if r["trace"] == host]
        *events, summary = full
        *kept, bounded_summary = bounded
        assert summary["kind"] == bounded_summary["kind"] == "summary"
        assert summary["frames"] == 14_400 and summary["gpus"] == 8
        assert len(events) > 300 and summary["events_omitted"] == 0
        assert kept == events[:100]
        assert bounded_summary["events_omitted"] == len(events) - 100
        starts = sum(1 for e in events if e["kind"] == "finding_started")
        decisions = sum(1 for e in events if e["kind"] == "decision")
        for counts in (summary, bounded_summary):
            assert (counts["findings_started"], counts["decisions"]) == (starts, decisions)
    # the human report says how many more there are
    assert main(["replay", str(path), "--events", "3"]) == 0
    report = capsys.readouterr().out
    omitted = [r["events_omitted"] for r in capped if r["kind"] == "summary"]
    for more in omitted:
        assert f"... {int(more) + 97} more events not shown (--events all prints them)" in report


def test_a_streamed_host_keeps_a_bounded_event_list(tmp_path: Path) -> None:
    """One host's Parquet, streamed a record batch at a time: the first ``max_events``
    events of the unbounded backtest, and the same counts."""
    path = tmp_path / "gpu-a.parquet"
    write_fleet(path, ("gpu-a",), hours=2)
    policies = load_policies([default_policy_path()])
    (every,) = backtest_parquet([str(path)], policies)
    (bounded,) = backtest_parquet([str(path)], policies, max_events=10)
    assert every.summary.vectorized and bounded.summary.vectorized  # streamed
    assert len(every.events) > 100 and every.summary.events_omitted == 0
    assert bounded.events == every.events[:10]
    assert bounded.summary.events_omitted == len(every.events) - 10
    assert dataclasses.replace(bounded.summary, events_omitted=0, engine_s=0, parse_s=0) == (
        dataclasses.replace(every.summary, engine_s=0, parse_s=0)
    )


def write_hosts(folder: Path, mixed: bool) -> list[str]:
    """Half an hour of hosts a-d (:func:`fleet_table`) as a fleet collects it: host a
    split over two files, b and c in one file (``mixed``: rows of both in every row
    group of 9,999 rows, c without GPU 7 for 10 minutes; else a row group of b's then
    one of c's), d in a file without ``host`` and ``uuid`` columns (host ``d.parquet``)."""
    folder.mkdir()
    table = fleet_table(("a", "b", "c", "d"), 1800)
    host, second = table.column("host"), pc.cast(table.column("timestamp"), "int64")

    def rows(*names: str) -> pa.Table:
        return table.filter(pc.is_in(host, pa.array(names)))

    a = rows("a")
    pq.write_table(a.slice(0, a.num_rows // 2), folder / "a-1.parquet")  # the first 15 min
    pq.write_table(a.slice(a.num_rows // 2), folder / "a-2.parquet")
    if mixed:
        late = pc.or_(pc.greater_equal(second, 1_753_574_400_000 + 600_000),
                      pc.not_equal(table.column("index"), 7))  # fmt: skip
        kept = pc.and_(pc.is_in(host, pa.array(["b", "c"])), pc.or_(pc.equal(host, "b"), late))
        pq.write_table(table.filter(kept), folder / "bc.parquet", row_group_size=9_999)
    else:
        with pq.ParquetWriter(folder / "bc.parquet", table.schema) as writer:
            for name in ("b", "c"):
                part = rows(name)
                writer.write_table(part, row_group_size=part.num_rows)
    pq.write_table(
        rows("d").drop_columns(["host", "uuid"]), folder / "d.parquet", row_group_size=5000
    )
    return sorted(str(path) for path in folder.iterdir())


@pytest.mark.parametrize("mixed", [True, False], ids=["hosts-mixed", "a-row-group-per-host"])
def test_many_hosts_in_several_files_give_the_whole_read_events(
    tmp_path: Path, mixed: bool
) -> None:
    """Streamed host by host (each row group one host's) or read once and routed per
    host (row groups mixing hosts): every host's events and summary are those of the
    whole read (each host's trace read whole, then backtested), event for event."""
    from gpuwatchd.backtest import run_backtest
    from gpuwatchd.sampling.parquet import host_row_groups

    files = write_hosts(tmp_path / "fleet", mixed)
    assert (host_row_groups(files) is None) == mixed
    policies = load_policies([default_policy_path()])
    want = [run_backtest(trace, policies) for trace in read_parquet(files)]
    got = list(backtest_parquet(files, policies))
    assert [r.summary.path for r in got] == ["a", "b", "c", "d.parquet"]
    assert [r.summary.gpu_count for r in got] == [8, 8, 8, 8]
    for mine, whole in zip(got, want, strict=True):
        assert mine.summary.frames == 1800 and len(mine.events) > 30
        assert mine.events == whole.events
        timings = {"engine_s": 0.0, "parse_s": 0.0}
        assert dataclasses.replace(mine.summary, **timings) == (
            dataclasses.replace(whole.summary, **timings)
        )
    uuids = {e.finding.gpu_uuid for r in got for e in r.events if hasattr(e, "finding")}
    assert "GPU-replay-d.parquet-0" in uuids and "GPU-c-7" in uuids


def test_hosts_mixed_in_row_groups_are_framed_in_bounded_chunks(tmp_path: Path) -> None:
    """Read 1,000 rows at a time, each host's chunks hold at most a batch's frames and
    together the host's whole trace; c, whose GPU 7 comes after the first batch, is
    handed back (None) once it does, to be read whole."""
    import numpy as np

    from gpuwatchd.sampling.parquet import HostStreams

    files = write_hosts(tmp_path / "fleet", mixed=True)
    chunks: dict[str, list[object]] = {}
    for host, chunk in HostStreams(files, batch_rows=1000):
        chunks.setdefault(host, []).append(chunk)
    assert sorted(chunks) == ["a", "b", "c", "d.parquet"]
    assert chunks["c"][-1] is None and None not in chunks["c"][:-1]  # framed until GPU 7
    for whole in read_parquet(files, hosts={"a", "b", "d.parquet"}):
        parts = chunks[whole.path]
        assert len(parts) > 10 and max(c.frame_count for c in parts) <= 1000 // 8 + 1  # type: ignore[attr-defined]
        assert {(c.uuids, c.names) for c in parts} == {(whole.uuids, whole.names)}  # type: ignore[attr-defined]
        for field in ("timestamps_s", "utilization_gpu_pct", "memory_used_bytes"):
            joined = np.concatenate([getattr(c, field) for c in parts])
            np.testing.assert_array_equal(joined, getattr(whole, field))
