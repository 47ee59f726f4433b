"""Parsing real nvidia-smi logs and replaying them on a caller's clock."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from conftest import TRACES
from gpuwatchd.errors import ReplayError
from gpuwatchd.model import NA, GpuSample, MaybeFloat, NaType
from gpuwatchd.sampling import GpuSampler
from gpuwatchd.sampling.replay import ReplaySampler, iter_samples, parse_trace
from gpuwatchd.testing.clock import FakeClock

MIB = 2**20
H100 = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"
TITANX_DDP = TRACES / "titanx2_gpt_ddp_100ms.csv"
TITANX_BURN = TRACES / "titanx2_gpt_with_burn_100ms.csv"
HEADER = "timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]\n"


def known(value: MaybeFloat) -> float:
    """The value of a metric the trace recorded (fails on NA)."""
    assert not isinstance(value, NaType), "NA where the trace has a value"
    return value


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_h100_trace_parses_into_eight_gpus() -> None:
    # (Parse speed is measured by bench/replay.py, not asserted here.)
    trace = parse_trace(H100)
    assert trace.gpu_count == 8
    assert trace.path == str(H100)
    # 43,600 rows; nvidia-smi left 3 samples incomplete near the end and the log stops
    # one row into a sample: those 8 rows are skipped, every other row is one GPU's.
    assert trace.skipped_lines == (43242, 43243, 43244, 43245, 43246, 43335, 43424, 43601)
    assert len(trace.frames) == 5449
    assert 8 * len(trace.frames) + len(trace.skipped_lines) == 43600
    assert trace.duration_s == pytest.approx(694.5, abs=0.1)

    first = trace.frames[0]
    assert [s.index for s in first.samples] == list(range(8))
    assert [s.uuid for s in first.samples] == [f"GPU-replay-{i}" for i in range(8)]
    assert all(s.name == "replay" and s.timestamp_s == first.timestamp_s for s in first.samples)
    assert first.samples[0].power_draw_w == 116.51
    assert first.samples[0].memory_used_bytes == 124 * MIB  # MiB -> bytes
    assert first.samples[1].memory_used_bytes == 17 * MIB
    assert first.samples[0].memory_total_bytes is NA  # not recorded
    assert first.samples[0].temperature_gpu_c is NA
    # GPU 0 keeps its identity to the very end (its 124 MiB display context).
    assert trace.frames[-1].samples[0].memory_used_bytes == 124 * MIB
    assert [s.memory_used_bytes for s in trace.frames[-1].samples[1:]] == [17 * MIB] * 7


def test_h100_trace_idle_start_then_training() -> None:
    trace = parse_trace(H100)
    start_s = trace.start_s

    def utilization(lo_s: float, hi_s: float, gpu: int) -> list[float]:
        return [
            known(f.samples[gpu].utilization_gpu_pct)
            for f in trace.frames
            if lo_s <= f.timestamp_s - start_s < hi_s
        ]

    for gpu in range(8):
        idle = utilization(0.0, 95.0, gpu)
        assert len(idle) > 800
        assert statistics.median(idle) == 0.0 and max(idle) <= 3.0  # blips of 1-3 % only
    for gpu in range(1, 8):  # DDP ranks 1..7 run flat out once training starts
        assert statistics.mean(utilization(150.0, 600.0, gpu)) > 95.0
    assert statistics.mean(utilization(150.0, 600.0, 0)) < 10.0  # rank 0 mostly waits


def test_titanx_traces_have_two_gpus_and_burn_power_has_no_unit() -> None:
    ddp = parse_trace(TITANX_DDP)
    assert ddp.gpu_count == 2 and len(ddp.frames) == 1127 and ddp.skipped_lines == ()
    assert [s.power_draw_w for s in ddp.frames[0].samples] == [18.03, 16.70]

    burn = parse_trace(TITANX_BURN)
    assert burn.gpu_count == 2 and len(burn.frames) == 2362 and burn.skipped_lines == ()
    assert [s.power_draw_w for s in burn.frames[0].samples] == [17.36, 16.28]
    assert max(known(f.samples[1].utilization_gpu_pct) for f in burn.frames) > 90.0


def test_na_values_and_extra_columns(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "timestamp, name, pci.bus_id, temperature.gpu, utilization.gpu [%], memory.used [MiB], "
        "memory.total [MiB], power.draw [W]\n"
        "2025/01/02 03:04:05.100, NVIDIA A100, 00000000:07:00.0, 41, 5 %, 100 MiB, 40960 MiB, "
        "[N/A]\n"
        "2025/01/02 03:04:05.200, NVIDIA A100, 00000000:07:00.0, N/A, [Not Supported], 200 MiB, "
        "40960 MiB, 61.5 W\n"
        "\n",
    )
    trace = parse_trace(path)
    assert trace.gpu_count == 1 and len(trace.frames) == 2
    a, b = (f.samples[0] for f in trace.frames)
    assert (a.name, a.temperature_gpu_c, a.utilization_gpu_pct) == ("NVIDIA A100", 41.0, 5.0)
    assert a.power_draw_w is NA and b.power_draw_w == 61.5
    assert b.temperature_gpu_c is NA and b.utilization_gpu_pct is NA
    assert (a.memory_used_bytes, a.memory_total_bytes) == (100 * MIB, 40960 * MIB)
    assert b.timestamp_s - a.timestamp_s == pytest.approx(0.1, abs=1e-6)


def test_index_column_orders_gpus_and_marks_missing_rows_na(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "timestamp, index, uuid, utilization.gpu [%], memory.used [MiB]\n"
        "2025/01/02 03:04:05.100, 1, GPU-bbb, 10 %, 1 MiB\n"
        "2025/01/02 03:04:05.101, 0, GPU-aaa, 90 %, 2 MiB\n"
        "2025/01/02 03:04:06.100, 0, GPU-aaa, 80 %, 3 MiB\n"
        "2025/01/02 03:04:07.100, 0, GPU-aaa, 70 %, 4 MiB\n"
        "2025/01/02 03:04:07.101, 1, GPU-bbb, 20 %, 5 MiB\n",
    )
    trace = parse_trace(path)
    assert trace.gpu_count == 2 and len(trace.frames) == 3
    assert [[s.uuid for s in f.samples] for f in trace.frames] == [["GPU-aaa", "GPU-bbb"]] * 3
    assert [[s.utilization_gpu_pct for s in f.samples] for f in trace.frames] == [
        [90.0, 10.0],
        [80.0, NA],  # GPU 1 has no row in this sample: not sampled, not idle
        [70.0, 20.0],
    ]
    with pytest.raises(ReplayError, match=r"--gpus 3 given but the index column names 2 GPUs"):
        parse_trace(path, gpus=3)


def test_interleaved_rows_without_index(tmp_path: Path) -> None:
    rows = []
    for k in range(4):
        for gpu in range(3):
            stamp = f"2025/01/02 03:04:{5 + k:02d}.{100 + gpu}"
            rows.append(f"{stamp}, {gpu}.5 W, {10 * gpu} %, 1 MiB\n")
    path = write(tmp_path, HEADER + "".join(rows))
    trace = parse_trace(path)
    assert trace.gpu_count == 3 and len(trace.frames) == 4
    assert [s.power_draw_w for s in trace.frames[2].samples] == [0.5, 1.5, 2.5]
    assert [s.utilization_gpu_pct for s in trace.frames[3].samples] == [0.0, 10.0, 20.0]
    assert parse_trace(path, gpus=3).frames == trace.frames


def test_incomplete_sample_does_not_shift_later_rows(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        HEADER + "2025/01/02 03:04:05.100, 100 W, 90 %, 5000 MiB\n"  # line 2: GPU 0
        "2025/01/02 03:04:05.101, 50 W, 10 %, 100 MiB\n"  # line 3: GPU 1
        "2025/01/02 03:04:05.200, 100 W, 91 %, 5000 MiB\n"  # line 4: GPU 0, sample cut off
        "2025/01/02 03:04:09.000, 101 W, 92 %, 5000 MiB\n"  # a whole sample, seconds later
        "2025/01/02 03:04:09.001, 51 W, 11 %, 100 MiB\n"
        "2025/01/02 03:04:09.100, 102 W, 93 %, 5000 MiB\n"
        "2025/01/02 03:04:09.101, 52 W, 12 %, 100 MiB\n",
    )
    trace = parse_trace(path)
    assert trace.gpu_count == 2 and trace.skipped_lines == (4,)
    assert [[s.utilization_gpu_pct for s in f.samples] for f in trace.frames] == [
        [90.0, 10.0],
        [92.0, 11.0],
        [93.0, 12.0],
    ]


def test_gpu_count_that_cannot_be_inferred_asks_for_gpus(tmp_path: Path) -> None:
    # Rows 30 ms apart all the time: no sign of where one sample ends.
    rows = "".join(f"2025/01/02 03:04:05.{100 + 30 * i:03d}, 1 W, {i} %, 1 MiB\n" for i in range(6))
    rows += "2025/01/02 03:04:07.000, 1 W, 6 %, 1 MiB\n2025/01/02 03:04:08.000, 1 W, 7 %, 1 MiB\n"
    path = write(tmp_path, HEADER + rows)
    with pytest.raises(ReplayError, match=r"pass the number of GPUs \(--gpus N\)"):
        parse_trace(path)
    trace = parse_trace(path, gpus=2)
    assert trace.gpu_count == 2 and len(trace.frames) == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEADER + "2025/01/02 03:04:05.100, 1 W, 1 %, 1 MiB\n2025/01/02 03:04:05.200, 1 W, "
         "lots %, 1 MiB\n", r"trace\.csv:3: utilization\.gpu value 'lots %' is not a number"),
        (HEADER + "2025/01/02 03:04:05.100, 1 W, 1 %\n", r"trace\.csv:2: expected 4 "),
        (HEADER + "yesterday, 1 W, 1 %, 1 MiB\n", r"trace\.csv:2: bad timestamp 'yesterday'"),
        (HEADER + "2025/01/02 03:04:05.100, 1 MiB, 1 %, 1 MiB\n",
         r"trace\.csv:2: power\.draw value '1 MiB' has unit 'MiB', expected W"),
        (HEADER + "2025/01/02 03:04:05.100, 1 W, 1 %, 1 MiB\n"
         "2025/01/02 03:04:04.100, 1 W, 1 %, 1 MiB\n", r"trace\.csv:3: timestamp goes backwards"),
        ("power.draw [W], utilization.gpu [%]\n1 W, 2 %\n", r"trace\.csv:1: no 'timestamp' column"),
        ("timestamp, power.draw [furlongs]\n", r"trace\.csv:1: unknown unit \[furlongs\]"),
        ("", r"trace\.csv: empty trace"),
        (HEADER, r"trace\.csv: the trace has a header but no rows"),
    ],
)  # fmt: skip
def test_bad_trace_raises_replay_error_with_file_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ReplayError, match=message):
        parse_trace(path)


def test_missing_file_is_a_replay_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match=r"missing\.csv: cannot read trace"):
        parse_trace(tmp_path / "missing.csv")


def test_replay_sampler_plays_on_the_callers_clock() -> None:
    trace = parse_trace(TITANX_DDP)
    clock = FakeClock()
    sampler = ReplaySampler(trace)
    assert isinstance(sampler, GpuSampler)
    assert sampler.status == f"replay: {TITANX_DDP}"

    first = sampler.sample(clock())  # the first call anchors the trace's start
    assert [s.power_draw_w for s in first] == [18.03, 16.70]
    assert all(s.timestamp_s == clock() for s in first)  # re-stamped on the caller's clock

    clock.advance(60.0)
    at_60s = sampler.sample(clock())
    expected = [f for f in trace.frames if f.timestamp_s <= trace.start_s + 60.0][-1]
    assert [s.power_draw_w for s in at_60s] == [s.power_draw_w for s in expected.samples]
    assert at_60s[1].timestamp_s == clock() and not sampler.finished

    clock.advance(trace.duration_s)  # past the end: the last frame, again and again
    assert [s.memory_used_bytes for s in sampler.sample(clock())] == [
        s.memory_used_bytes for s in trace.frames[-1].samples
    ]
    assert sampler.finished
    clock.advance(10.0)
    assert sampler.sample(clock())[0].power_draw_w == trace.frames[-1].samples[0].power_draw_w


def test_replay_sampler_speed_and_as_fast_as_possible() -> None:
    trace = parse_trace(TITANX_BURN)
    clock = FakeClock()
    fast = ReplaySampler(trace, speed=10.0)
    fast.sample(clock())
    clock.advance(10.0)  # 100 s of trace
    fast.sample(clock())
    assert trace.frames[fast.position].timestamp_s <= trace.start_s + 100.0
    assert trace.frames[fast.position + 1].timestamp_s > trace.start_s + 100.0

    flat_out = ReplaySampler(trace, speed=math.inf)
    played = [flat_out.sample(1.0) for _ in range(len(trace.frames))]
    assert flat_out.finished
    assert [p[1].power_draw_w for p in played] == [f.samples[1].power_draw_w for f in trace.frames]
    assert flat_out.sample(2.0)[1].power_draw_w == trace.frames[-1].samples[1].power_draw_w
    with pytest.raises(ReplayError, match="speed must be > 0"):
        ReplaySampler(trace, speed=0.0)


def test_iter_samples_yields_frames_on_trace_time() -> None:
    trace = parse_trace(TITANX_DDP)
    frames = list(iter_samples(trace))
    assert frames == list(trace.frames)
    times = [f.timestamp_s for f in frames]
    assert times == sorted(times)


@pytest.mark.parametrize(
    "name",
    ["h100x8_gpt350m_ckpt10_100ms.csv", "titanx2_gpt_ddp_100ms.csv",
     "titanx2_gpt_with_burn_100ms.csv"],
)  # fmt: skip
def test_columnar_parsing_gives_the_same_trace(name: str) -> None:
    path = TRACES / name
    assert parse_trace(path, columnar=True) == parse_trace(path)


def test_columnar_parsing_of_a_regular_log_and_its_fallbacks(tmp_path: Path) -> None:
    """A regular interleaved log is read as columns, and so are one with [N/A] and one
    with an incomplete sample; one with mixed units falls back to the row parser, with
    the same result."""
    pytest.importorskip("pyarrow")
    from gpuwatchd.sampling.replay_arrow import parse_fast

    lines = ["timestamp, utilization.gpu [%], memory.used [MiB], power.draw [W]"]
    for s in range(50):
        for gpu in range(2):
            lines.append(f"2025/07/26 23:59:{s:02d}.{gpu:03d}, {s % 7} %, {100 + s} MiB, 70.5 W")
    regular = tmp_path / "regular.csv"
    regular.write_text("\n".join(lines) + "\n")
    fast = parse_fast(regular, None)
    assert fast is not None and fast == parse_trace(regular)
    assert fast.gpu_count == 2 and fast.frames[3].samples[1].memory_used_bytes == 103 * 2**20
    for change, columnar in (("[N/A]", True), ("0.0715 kW", False)):  # a second unit
        odd = tmp_path / "odd.csv"
        odd.write_text("\n".join([*lines[:9], lines[9].replace("70.5 W", change), *lines[10:]]))
        assert (parse_fast(odd, None) is not None) == columnar
        assert parse_trace(odd, columnar=True) == parse_trace(odd)
    cut = tmp_path / "cut.csv"
    cut.write_text("\n".join(lines[:8] + lines[9:]) + "\n")  # one GPU row missing
    cut_fast = parse_fast(cut, None)
    assert cut_fast is not None and cut_fast.skipped_lines == (8,)
    assert cut_fast == parse_trace(cut)


def _restamp(sample: GpuSample, now_s: float) -> GpuSample:
    return dataclasses.replace(sample, timestamp_s=float(now_s))


def test_replay_sampler_plays_every_frame_as_parsed_and_keeps_not_the_trace() -> None:
    # The daemon replaying the H100 trace held 18 MiB of GpuSample objects
    # (bench/control.py); the sampler keeps the changing numbers as doubles and plays
    # back exactly the parsed samples, NA, ints and names included.
    import gc
    import tracemalloc

    trace = parse_trace(H100)
    tracemalloc.start()
    try:
        sampler = ReplaySampler(trace, speed=math.inf)
        gc.collect()
        kept_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    played = [sampler.sample(float(n)) for n in range(len(trace.frames))]
    assert sampler.finished
    for n, (frame, samples) in enumerate(zip(trace.frames, played, strict=True)):
        assert samples == tuple(_restamp(s, n) for s in frame.samples)
    assert type(played[-1][0].memory_used_bytes) is int
    assert kept_bytes < 4 * MIB  # 43,600 samples as objects: about 18 MiB


def test_replay_sampler_keeps_whole_the_frames_a_template_cannot_give(tmp_path: Path) -> None:
    # a DCGM health counter that changes (outside the numeric columns) and NA cells
    text = (
        "timestamp, index, power.draw [W], utilization.gpu [%], DCGM_FI_DEV_ECC_DBE_VOL_TOTAL\n"
        "2025/07/26 23:53:30.000, 0, 100.5 W, 10 %, 0\n"
        "2025/07/26 23:53:30.000, 1, [N/A], 20 %, 0\n"
        "2025/07/26 23:53:31.000, 0, 101.5 W, [N/A], 0\n"
        "2025/07/26 23:53:31.000, 1, 99.0 W, 30 %, 2\n"
        "2025/07/26 23:53:32.000, 0, 102.5 W, 12 %, 0\n"
        "2025/07/26 23:53:32.000, 1, 98.0 W, 31 %, 2\n"
    )
    trace = parse_trace(write(tmp_path, text))
    sampler = ReplaySampler(trace, speed=math.inf)
    played = [sampler.sample(7.0) for _ in trace.frames]
    assert played == [tuple(_restamp(s, 7) for s in frame.samples) for frame in trace.frames]
    assert [s.health.ecc_dbe_volatile_total for s in played[1]] == [0, 2]
    assert played[0][1].power_draw_w is NA and played[1][0].utilization_gpu_pct is NA
