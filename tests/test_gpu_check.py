"""The GPU battery (`make gpu-check`, bench/gpu_check.py; docs/gpu-check.md) where there is no
GPU, and what it recorded on a real H100 (tests/data/gpu/) read back by the product.

Without an NVIDIA GPU the battery must say so, run its CPU-side part and exit 2; the trace
that `gpuwatchd record` wrote on real NVML must replay as any nvidia-smi log does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO
from gpuwatchd.sampling.replay import parse_trace

GPU_DATA = REPO / "tests" / "data" / "gpu"


def nvml_sees_a_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.skipif(nvml_sees_a_gpu(), reason="this machine has a GPU: run `make gpu-check`")
def test_without_a_gpu_the_battery_says_so_runs_its_cpu_part_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no NVIDIA GPU (" in done.stdout and "CPU-side parts only" in done.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["gpu"] is False and report["reason"]
    assert report["sections"]["cpu_parts"]["status"] == "pass"
    probe = json.loads((out / "nvml_probe_fake.json").read_text())
    # the probe asked FakeNvml what it asks real NVML; the sampler's reads were answered
    device = probe["devices"][0]
    assert device["nvmlDeviceGetName"]["value"] == "NVIDIA H100 80GB HBM3"
    assert device["nvmlDeviceGetMemoryInfo"]["value"]["total"] == 80 * 2**30


def test_the_trace_recorded_on_a_real_h100_replays_with_its_phases(tmp_path: Path) -> None:
    trace = GPU_DATA / "h100_record.csv"
    parsed = parse_trace(trace)
    samples = [gpu for frame in parsed.frames for gpu in frame.samples]
    assert len(samples) == 58 and {s.name for s in samples} == {"NVIDIA H100 80GB HBM3"}
    utilization = [s.utilization_gpu_pct for s in samples]
    # idle, then bf16 matrix products (100 %), then one-element kernels, then idle again
    assert utilization[0] == 0 and max(utilization) == 100 and utilization[-1] == 0
    done = subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", str(trace), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert (summary["gpus"], summary["gpu_samples"], summary["skipped_lines"]) == (1, 58, 0)


def test_the_dcgm_columns_recorded_on_a_real_h100_replay_as_sm_activity() -> None:
    """`gpuwatchd record --dcgm` on the H100: while one-element kernels ran, nvidia-smi's
    utilization.gpu read 32-42 % and SM activity under 0.05 %; under matrix products
    both were near 100 %."""
    parsed = parse_trace(GPU_DATA / "h100_record_dcgm.csv")
    samples = [gpu for frame in parsed.frames for gpu in frame.samples]
    assert len(samples) == 53
    busy = [s for s in samples if s.utilization_gpu_pct == 100]
    tiny = [
        s
        for s in samples
        if isinstance(s.utilization_gpu_pct, float) and 30 <= s.utilization_gpu_pct <= 45
    ]
    assert len(busy) >= 10 and len(tiny) >= 8
    assert all(isinstance(s.sm_active_pct, float) and s.sm_active_pct > 90 for s in busy)
    assert all(isinstance(s.sm_active_pct, float) and s.sm_active_pct < 0.05 for s in tiny)
    assert {s.health.ecc_dbe_volatile_total for s in samples} == {0}


@pytest.mark.parametrize(
    ("metric", "lasts_through_the_tiny_kernels"), [("sm_active", True), ("utilization_gpu", False)]
)
def test_a_backtest_on_the_h100_trace_finds_the_idle_sms_only_by_sm_activity(
    tmp_path: Path, metric: str, lasts_through_the_tiny_kernels: bool
) -> None:
    """Issue 22 item 4 on real data: from 17:50:16 one-element kernels kept
    utilization.gpu at 32-42 % with SM activity under 0.05 %; `low_utilization` judging
    SM activity finds the GPU underused until the kernels stop (17:50:22), judging
    utilization.gpu it clears as they start."""
    policies = tmp_path / "p.yaml"
    policies.write_text(
        "policies:\n"
        "  - name: underused\n"
        "    when:\n"
        f"      low_utilization: {{percent: 10, for: 3s, metric: {metric}}}\n"
        "    do:\n"
        "      - log: {}\n"
    )
    trace = GPU_DATA / "h100_record_dcgm.csv"
    done = subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", str(trace), "--policies", str(policies), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    cleared = [e["time"][11:19] for e in events if e["kind"] == "finding_cleared"]
    assert len(cleared) == 2, events  # after the first idle stretch, and the second
    if lasts_through_the_tiny_kernels:
        assert cleared[1] >= "17:50:22"
        assert "SM active" in next(e for e in events if e["kind"] == "finding_started")["message"]
    else:
        assert cleared[1] < "17:50:17"
