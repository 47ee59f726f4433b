"""gpuwatchd.record and `gpuwatchd record`: nvidia-smi CSV from NVML, replayable.

Only NVML is faked (gpuwatchd.testing.FakeNvml at the pynvml boundary); the sampler,
the recorder, the parser and the subprocesses are real.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.cli.main import main
from gpuwatchd.model import NA, GpuSample
from gpuwatchd.record import CSV_HEADER, DCGM_HEADER_CELLS, Recorder, format_row, format_timestamp
from gpuwatchd.sampling.nvml import NvmlSampler
from gpuwatchd.sampling.replay import parse_trace
from gpuwatchd.testing import FakeClock, FakeDevice, FakeNvml, install_fake_nvml

MIB = 2**20
GIB = 2**30
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"

# nvidia-smi --query-gpu=timestamp,index,uuid,name,utilization.gpu,memory.used,memory.total,
# temperature.gpu,power.draw --format=csv prints this header (temperature.gpu has no unit).
NVIDIA_SMI_HEADER = (
    "timestamp, index, uuid, name, utilization.gpu [%], memory.used [MiB], "
    "memory.total [MiB], temperature.gpu, power.draw [W]"
)

SERIES0: dict[str, list[float | None]] = {
    "utilization.gpu": [97, 3, 50, 100],
    "memory.used": [60 * GIB, 1 * GIB, 1 * GIB + 3 * MIB + 12345, 0],  # 3rd: not whole MiB
    "temperature.gpu": [61, 35, 40, 84],
    "power.draw": [412.5, 70.123, 99.999, 700.0],
}
SERIES1: dict[str, list[float | None]] = {
    "utilization.gpu": [3, 4, 5, 6],
    "memory.used": [2 * GIB, 2 * GIB, 2 * GIB, 2 * GIB],
    "power.draw": [None, 80.0, 81.0, 82.0],  # None: NVML answers NOT_SUPPORTED
}


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice(UUID0, memory_total_bytes=80 * GIB, series=SERIES0),
            FakeDevice(
                UUID1,
                "NVIDIA A100-SXM4-40GB",
                memory_total_bytes=40 * GIB,
                series=SERIES1,
                unsupported=["temperature.gpu"],
                lost_from=3,  # the 4th sample: GPU is lost
            ),
        ]
    )


class AdvancingStop(threading.Event):
    """A stop event whose wait() advances a fake monotonic clock instead of sleeping."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        self.clock.advance(timeout or 0.0)
        return self.is_set()


def record(fake: FakeNvml, count: int, interval_s: float = 0.1) -> str:
    """Record ``count`` samples of ``fake`` with fake clocks; return the CSV text."""
    wall = FakeClock(1_753_574_010.945)  # 2025/07/26 23:53:30.945 UTC
    mono = FakeClock()
    stop = AdvancingStop(mono)
    out = io.StringIO()
    with install_fake_nvml(fake):
        sampler = NvmlSampler()
        sampler.open()
        recorder = Recorder(sampler, out, interval_s=interval_s, wall=wall, monotonic=mono)
        assert recorder.run(count=count, stop=stop) == count
        sampler.close()
    return out.getvalue()


def test_header_is_nvidia_smis() -> None:
    assert CSV_HEADER == NVIDIA_SMI_HEADER


def test_rows_print_values_as_nvidia_smi() -> None:
    sample = GpuSample(
        UUID0, 0, "NVIDIA H100 80GB HBM3", 0.0, 97.0, 60 * GIB, 80 * GIB, 61.0, 412.5
    )
    stamp = format_timestamp(1_753_574_117.245)
    assert stamp == "2025/07/26 23:55:17.245"
    assert format_row(sample, stamp) == (
        "2025/07/26 23:55:17.245, 0, GPU-00000000-0000-0000-0000-000000000000, "
        "NVIDIA H100 80GB HBM3, 97 %, 61440 MiB, 81920 MiB, 61, 412.50 W"
    )
    lost = GpuSample(UUID1, 1, "NVIDIA H100 80GB HBM3", 0.0, error="GPU is lost")
    assert format_row(lost, stamp).endswith(", 1, " + UUID1 + ", NVIDIA H100 80GB HBM3, "
                                            "[N/A], [N/A], [N/A], [N/A], [N/A]")  # fmt: skip
    odd = GpuSample("GPU-x", 2, 'a "weird", name', 0.0, NA, MIB - 1, NA, NA, 0.004)
    assert format_row(odd, stamp) == (
        '2025/07/26 23:55:17.245, 2, GPU-x, "a ""weird"", name", [N/A], 0 MiB, [N/A], [N/A], 0.00 W'
    )


def test_timestamps_are_utc_milliseconds_rounded_down() -> None:
    assert format_timestamp(0.0) == "1970/01/01 00:00:00.000"
    assert format_timestamp(59.9999) == "1970/01/01 00:00:59.999"


def test_round_trip_through_parse_trace(tmp_path: Path) -> None:
    text = record(two_gpus(), count=4)
    lines = text.splitlines()
    assert lines[0] == NVIDIA_SMI_HEADER
    assert len(lines) == 1 + 4 * 2  # one row per GPU per sample
    assert lines[1].startswith("2025/07/26 23:53:30.945, 0, " + UUID0)
    assert lines[2].startswith("2025/07/26 23:53:30.945, 1, " + UUID1 + ", NVIDIA A100-SXM4-40GB")
    path = tmp_path / "rec.csv"
    path.write_text(text)

    trace = parse_trace(path)
    assert trace.gpu_count == 2 and len(trace.frames) == 4 and trace.skipped_lines == ()
    assert [f.timestamp_s for f in trace.frames] == pytest.approx(
        [1_753_574_010.945 + 0.1 * k for k in range(4)], abs=1e-3
    )
    for k, frame in enumerate(trace.frames):
        g0, g1 = frame.samples
        assert (g0.uuid, g0.index, g0.name) == (UUID0, 0, "NVIDIA H100 80GB HBM3")
        assert (g1.uuid, g1.index, g1.name) == (UUID1, 1, "NVIDIA A100-SXM4-40GB")
        assert g0.utilization_gpu_pct == SERIES0["utilization.gpu"][k]
        # memory.used in whole MiB, rounded down: exact for whole MiB, else < 1 MiB less.
        used = SERIES0["memory.used"][k]
        assert used is not None
        assert g0.memory_used_bytes == used // MIB * MIB
        assert g0.memory_total_bytes == 80 * GIB
        assert g1.memory_total_bytes == (40 * GIB if k < 3 else NA)  # lost at k == 3
        assert g0.temperature_gpu_c == SERIES0["temperature.gpu"][k]
        power = SERIES0["power.draw"][k]
        assert power is not None
        assert g0.power_draw_w == pytest.approx(power, abs=0.005)  # two decimals, as nvidia-smi
        assert g1.temperature_gpu_c is NA  # unsupported -> [N/A] -> NA, never 0
    assert trace.frames[2].samples[0].memory_used_bytes == GIB + 3 * MIB
    assert trace.frames[0].samples[1].power_draw_w is NA
    assert trace.frames[1].samples[1].power_draw_w == 80.0
    lost = trace.frames[3].samples[1]  # GPU 1 lost at its 4th sample: every metric [N/A]
    assert (lost.utilization_gpu_pct, lost.memory_used_bytes, lost.power_draw_w) == (NA, NA, NA)


def test_recorded_file_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 30 samples, GPU 0 at 2 % and GPU 1 at 90 %: a low-utilization finding on GPU 0 only.
    fake = FakeNvml(
        [
            FakeDevice(UUID0, series={"utilization.gpu": [2.0]}),
            FakeDevice(UUID1, series={"utilization.gpu": [90.0]}),
        ]
    )
    path = tmp_path / "rec.csv"
    path.write_text(record(fake, count=30, interval_s=1.0))
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "policies:\n  - name: idle\n    when: {low_utilization: {percent: 20, for: 10s}}\n"
        "    do: [{log: {}}]\n    cooldown: 1h\n"
    )
    assert main(["replay", str(path), "--policies", str(policy), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    started = [r for r in records if r["kind"] == "finding_started"]
    assert [(r["gpu_index"], r["gpu_uuid"], r["offset_s"]) for r in started] == [(0, UUID0, 10.0)]
    assert started[0]["time"] == "2025/07/26 23:53:40.945"
    assert records[-1]["kind"] == "summary" and records[-1]["frames"] == 30


def test_duration_stops_before_the_due_time_and_late_samples_are_skipped() -> None:
    fake = FakeNvml([FakeDevice(UUID0)])
    mono = FakeClock()
    stop = AdvancingStop(mono)
    out = io.StringIO()
    with install_fake_nvml(fake):
        sampler = NvmlSampler()
        sampler.open()
        recorder = Recorder(sampler, out, interval_s=1.0, wall=lambda: 0.0, monotonic=mono)
        # Samples due at 0, 1, ..., 9: ten before 10 s.
        assert recorder.run(duration_s=10.0, stop=stop) == 10
        assert stop.waits == pytest.approx([1.0] * 9)

        class SlowSampler:
            def sample(self, now_s: float) -> tuple[GpuSample, ...]:
                mono.advance(2.5)  # NVML took 2.5 s: the samples due meanwhile are skipped
                return sampler.sample(now_s)

        slow = Recorder(SlowSampler(), io.StringIO(), interval_s=1.0, monotonic=mono)
        stop.waits.clear()
        assert slow.run(duration_s=10.0, stop=stop) == 4  # at 0, 3, 6, 9
        assert stop.waits == pytest.approx([0.5, 0.5, 0.5])
        sampler.close()
    assert out.getvalue().count("\n") == 1 + 10


def test_a_wall_clock_step_back_does_not_make_timestamps_go_backwards(tmp_path: Path) -> None:
    wall = FakeClock(1_753_574_010.0)
    mono = FakeClock()
    out = io.StringIO()
    with install_fake_nvml(FakeNvml([FakeDevice(UUID0)])):
        sampler = NvmlSampler()
        sampler.open()
        recorder = Recorder(sampler, out, interval_s=1.0, wall=wall, monotonic=mono)
        recorder.record_once()
        wall.now_s -= 3600.0  # NTP (or someone) sets the clock back an hour
        mono.advance(1.0)
        recorder.record_once()
        sampler.close()
    path = tmp_path / "rec.csv"
    path.write_text(out.getvalue())
    frames = parse_trace(path).frames  # would raise "timestamp goes backwards"
    assert frames[1].timestamp_s - frames[0].timestamp_s == pytest.approx(1.0, abs=1e-3)


def test_stop_event_ends_a_recording_and_count_zero_writes_the_header() -> None:
    fake = FakeNvml([FakeDevice(UUID0)])
    with install_fake_nvml(fake):
        sampler = NvmlSampler()
        sampler.open()
        out = io.StringIO()
        stop = threading.Event()
        stop.set()
        assert Recorder(sampler, out).run(stop=stop) == 0
        assert out.getvalue() == CSV_HEADER + "\n"
        out = io.StringIO()
        assert Recorder(sampler, out).run(count=0) == 0
        assert out.getvalue() == CSV_HEADER + "\n"
        with pytest.raises(ValueError, match="interval"):
            Recorder(sampler, out, interval_s=0)
        sampler.close()


# -- `gpuwatchd record` as a real subprocess on the fake NVML -------------------------


def script(tmp_path: Path, content: dict[str, Any]) -> Path:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(content))
    return path


TWO_DEVICES: dict[str, Any] = {
    "devices": [
        {"uuid": UUID0, "memory_total_bytes": 80 * GIB,
         "series": {"utilization.gpu": [97, 3], "memory.used": [60 * GIB],
                    "power.draw": [412.5]}},
        {"uuid": UUID1, "memory_total_bytes": 80 * GIB, "unsupported": ["power.draw"],
         "series": {"utilization.gpu": [3]}},
    ]
}  # fmt: skip


def fakerun(script_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatchd.testing.fakerun", str(script_path), "record", *args]


def test_record_subprocess_to_file_replays(tmp_path: Path) -> None:
    out = tmp_path / "rec.csv"
    done = subprocess.run(
        fakerun(script(tmp_path, TWO_DEVICES), "--count", "3", "--interval", "50ms",
                "--out", str(out)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "recorded 3 samples (6 rows)" in done.stderr and done.stdout == ""
    lines = out.read_text().splitlines()
    assert lines[0] == NVIDIA_SMI_HEADER and len(lines) == 7
    assert lines[1].endswith(", 97 %, 61440 MiB, 81920 MiB, 30, 412.50 W")
    assert lines[2].endswith(", 3 %, 0 MiB, 81920 MiB, 30, [N/A]")
    trace = parse_trace(out)
    assert trace.gpu_count == 2 and len(trace.frames) == 3
    assert [f.samples[0].utilization_gpu_pct for f in trace.frames] == [97.0, 3.0, 3.0]
    steps = [
        b.timestamp_s - a.timestamp_s for a, b in zip(trace.frames, trace.frames[1:], strict=False)
    ]
    # --interval 50ms is kept (not rounded to seconds); samples are taken at a fixed rate, so
    # one late sample shortens the next step: the mean is what the interval fixes.
    assert all(0.0 < step < 10.0 for step in steps), steps
    assert 0.045 <= sum(steps) / len(steps) < 1.0, steps


def test_record_subprocess_to_stdout(tmp_path: Path) -> None:
    done = subprocess.run(
        fakerun(script(tmp_path, TWO_DEVICES), "--count", "2", "--interval", "10ms"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == NVIDIA_SMI_HEADER and len(lines) == 5


def test_record_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "precious.csv"
    out.write_text("do not lose me\n")
    done = subprocess.run(
        fakerun(script(tmp_path, TWO_DEVICES), "--count", "1", "--out", str(out)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "already exists" in done.stderr and str(out) in done.stderr
    assert out.read_text() == "do not lose me\n"


def test_record_without_nvml_exits_1_with_the_reason(tmp_path: Path) -> None:
    done = subprocess.run(
        fakerun(script(tmp_path, {"init_error": "DRIVER_NOT_LOADED"}), "--count", "1",
                "--out", str(tmp_path / "x.csv")),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no NVIDIA driver (NVML: Driver Not Loaded)" in done.stderr
    assert not (tmp_path / "x.csv").exists()  # nothing created for a recording that never began


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_record_stops_cleanly_on_a_signal(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "rec.csv"
    process = subprocess.Popen(
        fakerun(script(tmp_path, TWO_DEVICES), "--interval", "20ms", "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if out.exists() and out.read_text().count("\n") >= 1 + 2 * 3:
                break
            assert process.poll() is None, process.communicate()
            time.sleep(0.02)
        else:
            raise AssertionError("no samples recorded within 30 s")
        os.kill(process.pid, sig)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "recorded" in stderr
    text = out.read_text()
    assert text.endswith("\n")  # flushed: no half-written row
    trace = parse_trace(out)
    assert trace.skipped_lines == () and len(trace.frames) >= 3
    assert text.count("\n") == 1 + 2 * len(trace.frames)


def test_record_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in (
        (["--interval", "0"], "--interval: must be positive"),
        (["--count", "-1"], "--count: must not be negative"),
        (["--duration", "soon"], "--duration: cannot parse 'soon'"),
    ):
        assert main(["record", *args]) == 2  # bad usage: exit status 2, usage on stderr
        err = capsys.readouterr().err
        assert message in err and "usage: gpuwatchd record" in err


def test_dcgm_columns_round_trip_and_old_readers_keep_their_columns(tmp_path: Path) -> None:
    """``record --dcgm`` appends DCGM-named columns; replay reads them back and the nine
    nvidia-smi columns are unchanged, so a file without them still replays (NA)."""
    device = FakeDevice(
        UUID0,
        series={
            "utilization.gpu": [36.0],
            "sm_active_pct": [0.0352],
            "tensor_active_pct": [12.5],
            "ecc_dbe_volatile_total": [0, 0, 2],
            "row_remap_pending": [0, 1],
            "clocks_event_reasons": [0x44],
        },
        unsupported=["sm_occupancy_pct"],
    )
    wall, mono = FakeClock(1_753_574_010.945), FakeClock()
    out = io.StringIO()
    with install_fake_nvml(FakeNvml([device])):
        sampler = NvmlSampler(slow_interval_s=0.0)
        sampler.open()
        recorder = Recorder(sampler, out, interval_s=0.1, wall=wall, monotonic=mono, dcgm=True)
        assert recorder.run(count=3, stop=AdvancingStop(mono)) == 3
        sampler.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == NVIDIA_SMI_HEADER + ", " + ", ".join(DCGM_HEADER_CELLS)
    assert lines[1].startswith("2025/07/26 23:53:30.945, 0, " + UUID0)
    assert lines[1].endswith(", [N/A], [N/A], [N/A], [N/A], 0, 0, 0, 0, 0, 0, 68")  # GPM warms up
    path = tmp_path / "dcgm.csv"
    path.write_text(out.getvalue())
    frames = parse_trace(path).frames
    last = frames[2].samples[0]
    assert last.utilization_gpu_pct == 36.0
    assert last.sm_active_pct == pytest.approx(0.0352, abs=1e-6)
    assert last.tensor_active_pct == pytest.approx(12.5) and last.sm_occupancy_pct is NA
    assert [f.samples[0].health.ecc_dbe_volatile_total for f in frames] == [0, 0, 2]
    assert [f.samples[0].health.row_remap_pending for f in frames] == [0, 1, 1]
    assert last.health.clocks_event_reasons == 0x44
    # the same rows without the DCGM columns: what an nvidia-smi reader sees
    plain = tmp_path / "plain.csv"
    plain.write_text(
        "\n".join(line.split(", DCGM_FI")[0] if i == 0 else ", ".join(line.split(", ")[:9])
                  for i, line in enumerate(lines)) + "\n"
    )  # fmt: skip
    old = parse_trace(plain).frames[2].samples[0]
    assert old.utilization_gpu_pct == 36.0 and old.sm_active_pct is NA
    assert old.health.ecc_dbe_volatile_total is NA


def test_record_subprocess_with_dcgm_columns(tmp_path: Path) -> None:
    devices = {"devices": [{"uuid": UUID0, "series": {"ecc_dbe_volatile_total": [0, 1, 5]}}]}
    out = tmp_path / "rec.csv"
    done = subprocess.run(
        fakerun(script(tmp_path, devices), "--count", "3", "--interval", "50ms", "--dcgm",
                "--out", str(out)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    frames = parse_trace(out).frames
    assert [f.samples[0].health.ecc_dbe_volatile_total for f in frames] == [0, 1, 5]
