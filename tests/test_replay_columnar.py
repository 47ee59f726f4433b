"""Every trace format goes through the columnar reader and gives the per-sample engine's events.

``gpuwatchd replay`` reads a CSV log in blocks into arrays
(gpuwatchd/sampling/replay_arrow.py ``read_columns``) and backtests them over arrays; the
reference is the row parser and a PolicyEngine stepped through every frame. These tests
compare both, event for event, on every shipped trace (tests/data/traces, tests/data/gpu)
and on generated logs in each format a user has: ``gpuwatchd record``'s own (timestamp,
index, uuid, name, with ``[N/A]`` cells and a GPU missing from a sample), nvidia-smi's
without index, with uuid and name but no index, and the interleaved form with incomplete
samples.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TRACES
from gpuwatchd.backtest import backtest_file, run_backtest
from gpuwatchd.cli.main import main
from gpuwatchd.policy.schema import parse_policies
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.record import CSV_HEADER
from gpuwatchd.sampling.replay import parse_trace

pytest.importorskip("pyarrow")
from gpuwatchd.sampling.replay_arrow import read_columns

SHIPPED = sorted([*TRACES.glob("*.csv"), *(REPO / "tests" / "data" / "gpu").glob("*.csv")])
POLICIES = """\
policies:
  - name: underused
    when: {low_utilization: {percent: 20, clear: 40, statistic: mean, for: 20s}}
    do: [{log: {level: info}}]
  - name: idle-among-busy
    when: {idle_gpu: {percent: 15, busy_percent: 50, for: 10s}}
    cooldown: 1m
    do: [{log: {level: warning}}]
  - name: vram
    when: {vram_above: {percent: 90, for: 5s}}
    do: [{log: {level: info}}]
"""


def assert_same_events(path: Path, columnar: bool) -> int:
    """Backtest ``path`` as ``gpuwatchd replay`` does and with the per-sample engine on
    the row parser's trace; assert the same events; return how many."""
    policies = [load_policies([default_policy_path()]), parse_policies(POLICIES, "p.yaml")]
    total = 0
    for policy_set in policies:
        want = run_backtest(parse_trace(path), policy_set, engine="steps")
        # read in 8 MiB blocks (one here) and in blocks of 2 KiB (a few samples each)
        for block_bytes in (None, 2048):
            got = backtest_file(str(path), policy_set, block_bytes=block_bytes)
            assert got.summary.vectorized == columnar
            assert got.events == want.events
            assert got.summary.skipped_lines == want.summary.skipped_lines
            assert got.summary.gpu_samples == want.summary.gpu_samples
        total += len(got.events)
    return total


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_trace_through_the_columnar_reader(path: Path) -> None:
    dcgm = "DCGM_FI" in path.read_text().split("\n", 1)[0]
    # the DCGM columns (SM activity, health counters) are the per-sample engine's
    assert (read_columns(path, None) is None) == dcgm
    events = assert_same_events(path, columnar=not dcgm)
    assert events > 0 or path.parent != TRACES  # the short GPU checks' recordings find nothing


def _values(rng: random.Random, second: int, gpu: int) -> tuple[float, int, float, float]:
    """utilization %, memory MiB, temperature, power: GPU 1 idles from 60 s on, GPU 0's
    memory fills up from 100 s."""
    util = 0.0 if gpu == 1 and second >= 60 else 90.0 + rng.random() * 10
    mem = 80000 if gpu == 0 and second >= 100 else 20000 + rng.randrange(100)
    return util, mem, 40.0 + rng.random() * 20, 100 + rng.random() * 300


def generated(tmp_path: Path, form: str, seconds: int = 180, gpus: int = 4) -> Path:
    """A trace of ``gpus`` GPUs at 1 Hz in ``form``: record (index, uuid, name, [N/A]
    cells, one GPU row missing), smi (no index), named (uuid and name, no index),
    interleaved (no index, incomplete samples)."""
    rng = random.Random(form)
    if form == "record":
        lines = [CSV_HEADER]
    elif form == "named":
        lines = ["timestamp, name, uuid, utilization.gpu [%], memory.used [MiB], power.draw [W]"]
    else:
        lines = ["timestamp, utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
                 "temperature.gpu, power.draw [W]"]  # fmt: skip
    for second in range(seconds):
        minute, sec = divmod(second, 60)
        for gpu in range(gpus):
            stamp = f"2026/11/27 10:{minute:02d}:{sec:02d}.{3 * gpu + 120:03d}"
            util, mem, temp, power = _values(rng, second, gpu)
            util_text = f"{util:.0f} %"
            if form == "record":
                if second == 50 and gpu == 2:
                    continue  # this GPU has no row in this sample
                if second in (70, 71) and gpu == 3:
                    util_text = "[N/A]"
                lines.append(
                    f"{stamp}, {gpu}, GPU-{gpu:08x}-aaaa-bbbb-cccc-dddddddddddd, NVIDIA H100, "
                    f"{util_text}, {mem} MiB, 81559 MiB, {temp:.0f}, {power:.2f} W"
                )
            elif form == "named":
                lines.append(
                    f"{stamp}, Tesla V100, GPU-{gpu}, {util_text}, {mem} MiB, {power:.2f} W"
                )
            else:
                if form == "interleaved" and second in (30, 31, 90) and gpu >= gpus - 1:
                    continue  # an incomplete sample: its rows are skipped
                lines.append(
                    f"{stamp}, {util_text}, {mem} MiB, 81559 MiB, {temp:.0f}, {power:.2f} W"
                )
    path = tmp_path / f"{form}.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("form", ["record", "smi", "named", "interleaved"])
def test_generated_traces_in_each_format(tmp_path: Path, form: str) -> None:
    path = generated(tmp_path, form)
    columns = read_columns(path, None)
    assert columns is not None and columns.gpu_count == 4
    if form == "interleaved":
        # seconds 30 and 31 (3 rows each) make one mixed sample, as the row parser makes it
        assert columns.frame_count == 178 and len(columns.skipped_lines) == 5
    assert assert_same_events(path, columnar=True) > 0


def test_record_format_names_its_gpus(tmp_path: Path) -> None:
    """The uuids and names of record's own columns reach the findings."""
    path = generated(tmp_path, "record")
    result = backtest_file(str(path), parse_policies(POLICIES, "p.yaml"))
    uuids = {e.finding.gpu_uuid for e in result.events if hasattr(e, "finding")}
    assert "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd" in uuids
    assert result.summary.vectorized and result.summary.gpu_count == 4


def test_a_broken_log_still_fails_with_its_line(tmp_path: Path) -> None:
    """What the columnar reader does not take goes to the row parser, which names the line."""
    from gpuwatchd.errors import ReplayError

    path = generated(tmp_path, "record", seconds=5)
    lines = path.read_text().splitlines()
    lines[7] = lines[7].replace(" %", " %%x")
    path.write_text("\n".join(lines) + "\n")
    assert read_columns(path, None) is None
    with pytest.raises(ReplayError, match=r"record\.csv:8: utilization\.gpu value"):
        backtest_file(str(path), parse_policies(POLICIES, "p.yaml"))


def test_a_gpu_that_appears_later_is_named_by_its_own_uuid(tmp_path: Path) -> None:
    """uuid and name are parsed only until every GPU seen has one; a block that brings a
    new GPU (here GPU 3 from the 120th second, idle) is parsed again with them."""
    lines = [CSV_HEADER]
    for second in range(180):
        for gpu in range(4 if second >= 120 else 3):
            util = 5 if gpu == 3 else 90 + second % 7
            lines.append(
                f"2026/11/27 10:{second // 60:02d}:{second % 60:02d}.000, {gpu}, GPU-late-{gpu}, "
                f"NVIDIA H100, {util} %, 20000 MiB, 81559 MiB, 50, 300.00 W"
            )
    path = tmp_path / "late.csv"
    path.write_text("\n".join(lines) + "\n")
    columns = read_columns(path, None)
    assert columns is not None and columns.uuids == tuple(f"GPU-late-{g}" for g in range(4))
    assert assert_same_events(path, columnar=True) > 0  # blocks of 2 KiB: 30 rows or so
    result = backtest_file(str(path), parse_policies(POLICIES, "p.yaml"), block_bytes=2048)
    assert {e.finding.gpu_uuid for e in result.events if hasattr(e, "finding")} == {"GPU-late-3"}


def test_streamed_replay_reads_only_the_columns_its_engine_uses(tmp_path: Path) -> None:
    """Temperature and power are not parsed by ``gpuwatchd replay`` (the array backtest
    does not read them); the row parser's trace still has them."""
    from gpuwatchd.backtest_arrays import ARRAY_METRICS
    from gpuwatchd.sampling.replay_arrow import csv_blocks

    path = generated(tmp_path, "smi")
    blocks = csv_blocks(path, metrics=ARRAY_METRICS)
    assert blocks is not None
    block = next(iter(blocks))
    utilization, used, total, temperature, power = block.metrics
    assert temperature is None and power is None
    assert used[0] == 2**20 * int(path.read_text().splitlines()[1].split(",")[2].split()[0])
    assert total[0] == 81559 * 2**20 and 90 <= utilization[0] <= 100
    full = read_columns(path, None)
    assert full is not None and 40 <= full.temperature_gpu_c[0, 0] <= 60


def test_blocks_smaller_than_a_line_and_blank_lines(tmp_path: Path) -> None:
    """Blocks of 64 bytes (each record line is longer: read on until its end), blank
    lines inside and at the end, no newline after the last line: the per-sample
    engine's events, read as columns."""
    from gpuwatchd.sampling.replay_arrow import csv_blocks

    path = generated(tmp_path, "record", seconds=90)
    lines = path.read_text().splitlines()
    lines[40:40] = ["", ""]
    policies = parse_policies(POLICIES, "p.yaml")
    for text in ("\n".join(lines) + "\n\n\n", "\n".join(lines)):
        path.write_text(text)
        want = run_backtest(parse_trace(path), policies, engine="steps")
        blocks = csv_blocks(path, block_bytes=64)
        assert blocks is not None and sum(b.timestamps_s.shape[0] for b in blocks) == 359
        got = backtest_file(str(path), policies, block_bytes=64)
        assert got.summary.vectorized and len(want.events) > 0 and got.events == want.events


def test_without_the_replay_extra_the_row_parser_replays_the_log(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An install without the ``replay`` extra (numpy and pyarrow not importable) still
    replays a CSV log, through the row parser: the events of the columnar replay."""
    code = (
        "import sys; sys.modules['numpy'] = None; sys.modules['pyarrow'] = None\n"
        "from gpuwatchd.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    args = _replay_args()
    bare = _python(code, args)
    assert bare.returncode == 0, bare.stderr
    *events, summary = [json.loads(line) for line in bare.stdout.splitlines()]
    assert main(args) == 0
    *columnar_events, columnar = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary["vectorized"] is False and columnar["vectorized"] is True
    assert events and events == columnar_events


def test_replay_imports_neither_the_event_loop_nor_tls() -> None:
    """``gpuwatchd replay`` loads what a backtest needs: not asyncio, ssl or the Slurm
    client's event loop, which only the daemon runs (every run's start-up pays for
    what it imports)."""
    code = (
        "import sys, io, contextlib\n"
        "from gpuwatchd.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    status = main(sys.argv[1:])\n"
        "print(status, sorted(m for m in ('asyncio', 'ssl') if m in sys.modules))"
    )
    done = _python(code, _replay_args())
    assert done.stdout.split() == ["0", "[]"], done.stderr


def _replay_args() -> list[str]:
    """``gpuwatchd``'s arguments for a JSON replay of a shipped log with the default
    policies."""
    trace = str(TRACES / "titanx2_gpt_ddp_100ms.csv")
    return ["replay", trace, "--json", "--policies", str(default_policy_path())]


def _python(code: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter with ``args`` as its ``sys.argv[1:]``."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
