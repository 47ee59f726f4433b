"""`gpuwatchd replay` on the command line: human and --json output, several traces, errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, TRACES
from gpuwatchd.cli.main import main

TITANX_DDP = str(TRACES / "titanx2_gpt_ddp_100ms.csv")
TITANX_BURN = str(TRACES / "titanx2_gpt_with_burn_100ms.csv")
TIMINGS = ("parse_s", "engine_s", "gpu_samples_per_s")

IDLE_10S = """\
policies:
  - name: gpu-idle
    when:
      low_utilization: {percent: 20, for: 10s}
    do:
      - log: {level: info, message: "GPU idle"}
    cooldown: 1m
"""


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "idle.yaml"
    path.write_text(IDLE_10S)
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_human_output_lists_starts_clears_decisions_and_a_summary(
    capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    status, out, err = run(capsys, "replay", TITANX_DDP, "--policies", policy)
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"== {TITANX_DDP}: 2 GPUs, 1127 samples from 2025/12/05 19:21:36.9")
    assert lines[1].split() == [
        "TIME", "OFFSET", "EVENT", "GPU", "DETECTOR", "/", "POLICY", "VALUE", "DETAIL"
    ]  # fmt: skip
    # The 14.5 s idle start-up: both GPUs found 10 s in (trace time 19:21:47.0), one decision.
    started = [line for line in lines if "  started  " in line]
    assert started[0].startswith("2025/12/05 19:21:47.0    +10.0s  started   0 ")
    assert "low_utilization" in started[0] and "< 20 % for 10s" in started[0]
    decision = next(line for line in lines if "  decision  " in line)
    assert "0,1" in decision and "gpu-idle/log" in decision and "info: GPU idle" in decision
    cleared = [line for line in lines if "  cleared  " in line]
    assert "held 4.5s" in cleared[0]
    assert cleared[-1].endswith("the trace ends while it holds")
    assert lines[-1].startswith("summary: 1127 samples x 2 GPUs = 2254 GPU-samples")
    # Start-up (both GPUs at once), then the idle end: GPU 0 first, GPU 1 0.3 s later.
    assert "4 findings started, 3 decisions" in lines[-1]


def test_json_lines_for_several_traces_in_order(
    capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    status, out, _ = run(capsys, "replay", "--json", "--policies", policy, TITANX_DDP, TITANX_BURN)
    assert status == 0
    got = records(out)
    summaries = [r for r in got if r["kind"] == "summary"]
    assert [s["trace"] for s in summaries] == [TITANX_DDP, TITANX_BURN]
    assert got[-1] == summaries[-1]
    first_burn = next(i for i, r in enumerate(got) if r["trace"] == TITANX_BURN)
    assert got[first_burn - 1]["kind"] == "summary"  # each trace ends with its summary
    assert {r["kind"] for r in got} == {
        "finding_started", "finding_cleared", "decision", "summary"
    }  # fmt: skip
    ddp_started = [r for r in got if r["kind"] == "finding_started" and r["trace"] == TITANX_DDP]
    assert [(r["gpu_index"], r["offset_s"] // 1) for r in ddp_started] == [
        (0, 10.0), (1, 10.0), (0, 92.0), (1, 93.0)
    ]  # fmt: skip
    # Each trace is replayed by a fresh engine: the burn trace's first finding is its own
    # start-up (10 s in), not cut short by the DDP trace's cooldown.
    burn_decisions = [r for r in got if r["kind"] == "decision" and r["trace"] == TITANX_BURN]
    assert burn_decisions[0]["offset_s"] == pytest.approx(10.0, abs=0.5)


def test_json_output_is_identical_twice_but_for_timings(
    capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    def stable() -> list[dict[str, Any]]:
        status, out, _ = run(capsys, "replay", "--json", "--policies", policy, TITANX_BURN)
        assert status == 0
        got = records(out)
        for record in got:
            for key in TIMINGS:
                record.pop(key, None)
        return got

    assert stable() == stable()


def test_default_policies_are_the_packaged_ones(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "replay", "--json", TITANX_DDP)
    assert status == 0
    policies = {r["policy"] for r in records(out) if r["kind"] == "decision"}
    assert "gpu-underused" in policies  # default.yaml's low-utilization rule


def test_a_bad_trace_is_reported_with_file_and_line_and_the_others_still_run(
    capsys: pytest.CaptureFixture[str], policy: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "timestamp, utilization.gpu [%]\n2025/01/01 00:00:00.000, 5 %\n2025/01/01 x, 5\n"
    )
    status, out, err = run(capsys, "replay", "--json", "--policies", policy, str(bad), TITANX_DDP)
    assert status == 1 and err == ""  # in JSON mode the error is a JSON line too
    errors = [r["error"] for r in records(out) if "error" in r]
    assert [e["code"] for e in errors] == ["replay"]
    assert errors[0]["message"].startswith(f"{bad}:3: bad timestamp")
    assert [r["trace"] for r in records(out) if r.get("kind") == "summary"] == [TITANX_DDP]
    status, _, err = run(capsys, "replay", "--policies", policy, str(bad))
    assert status == 1 and f"gpuwatchd: error: {bad}:3: bad timestamp" in err
    status, _, err = run(capsys, "replay", str(tmp_path / "missing.csv"))
    assert status == 1 and "missing.csv: cannot read trace" in err


def test_a_bad_policy_is_reported_with_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(IDLE_10S.replace("for: 10s", "for: 10 parsecs"))
    status, out, err = run(capsys, "replay", "--policies", str(bad), TITANX_DDP)
    assert status == 1 and out == ""
    assert err.startswith(f"gpuwatchd: error: {bad}:4: ")


def synthetic(tmp_path: Path, rows: list[tuple[float, int]]) -> str:
    """A one-column trace: (seconds after 00:00, utilization %) per row."""
    path = tmp_path / "synthetic.csv"
    lines = ["timestamp, utilization.gpu [%]"]
    lines += [f"2025/01/01 00:{int(t // 60):02d}:{t % 60:06.3f}, {u} %" for t, u in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_max_gap(capsys: pytest.CaptureFixture[str], policy: str, tmp_path: Path) -> None:
    # 0 % for 6 s, nothing logged for 30 s, 0 % for 6 s: 10 s of idle only across the hole.
    rows = [(float(t), 0) for t in range(7)] + [(36.0 + t, 0) for t in range(7)]
    trace = synthetic(tmp_path, rows)

    def starts(*extra: str) -> list[float]:
        status, out, _ = run(capsys, "replay", "--json", "--policies", policy, trace, *extra)
        assert status == 0
        return [r["offset_s"] for r in records(out) if r["kind"] == "finding_started"]

    assert starts() == []  # a 30 s hole is longer than the default 10 s: the streak resets
    assert starts("--max-gap", "0") == [36.0]  # off: the hole does not break it
    assert starts("--max-gap", "1m") == [36.0]


def test_gpus_option_for_rows_that_cannot_be_grouped(
    capsys: pytest.CaptureFixture[str], policy: str, tmp_path: Path
) -> None:
    # Two GPUs' rows logged 0.5 s apart each: no timestamps close enough to group, so
    # without --gpus every row is taken for a sample of one GPU.
    rows = [(0.5 * i, 0 if i % 2 else 90) for i in range(60)]
    trace = synthetic(tmp_path, rows)
    status, out, _ = run(capsys, "replay", "--json", "--policies", policy, trace)
    assert status == 0 and records(out)[-1]["gpus"] == 1
    status, out, _ = run(capsys, "replay", "--json", "--gpus", "2", "--policies", policy, trace)
    got = records(out)
    assert status == 0 and got[-1]["gpus"] == 2 and got[-1]["frames"] == 30
    # GPU 1 (odd rows) is at 0 %, GPU 0 at 90 %: only GPU 1 is idle.
    assert {r["gpu_index"] for r in got if r["kind"] == "finding_started"} == {1}


def test_replay_console_script(policy: str) -> None:
    done = subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", "--json", "--policies", policy, TITANX_DDP],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["kind"] == "summary"


def test_python_dash_m_gpuwatchd_is_the_gpuwatchd_command(policy: str) -> None:
    result = subprocess.run(
        [str(BIN / "python"), "-m", "gpuwatchd", "check-policy", policy],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    usage = subprocess.run(
        [str(BIN / "python"), "-m", "gpuwatchd", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert usage.returncode == 0
    assert "check-policy" in usage.stdout and "replay" in usage.stdout


def test_run_that_cannot_start_logs_why_and_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = subprocess.run(
        [str(BIN / "gpuwatchd"), "run", "--devices", "none", "--policies", str(missing),
         "--socket", str(tmp_path / "control.sock"), "--state-dir", str(tmp_path / "state"),
         "--log-format", "json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["event"] == "daemon.start_failed" and line["level"] == "error"
    assert line["error"] == f"{missing}: no such policy file or directory"
    assert not (tmp_path / "control.sock").exists()
