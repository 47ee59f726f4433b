"""`gpuwatchd replay` of the real 8 x H100 trace, run as a user runs it: the GPU that idles
beside seven busy ones is one finding over its idle stretch, not one per burst (issue 10).

Rank 0 of that DDP run computes only in 2-5 s bursts per ~25 s step (20 s mean 4-24 %)
while GPUs 1-7 sit at ~97 % from ~110 s to ~663 s. Judging every sample of the window
split that one condition into 16-18 findings; the window mean with hysteresis (open
below one level, close at another) gives one. docs/backtests.md tells the figures.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, REPO, TRACES

H100 = str(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv")
DEFAULT_POLICIES = str(REPO / "policies" / "default.yaml")
TRAINING_S = (110.0, 663.0)
"""Offsets (s from the trace's first sample) between which GPUs 1-7 train at ~97 %."""


def replay(*policies: str) -> list[dict[str, Any]]:
    """``gpuwatchd replay --json --policies P... H100`` as a user types it; its records."""
    args = [arg for path in policies for arg in ("--policies", path)]
    done = subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", "--json", *args, H100],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def findings(records: list[dict[str, Any]], detector: str) -> dict[int, list[tuple[float, float]]]:
    """GPU index -> [(started offset s, cleared offset s)] of ``detector``'s findings."""
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "finding_cleared" and r["detector"] == detector:
            out[r["gpu_index"]].append((r["started_offset_s"], r["offset_s"]))
    return out


def policy_file(tmp_path: Path, condition: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "policies:\n  - name: rule\n    when:\n"
        f"      {condition}\n    do:\n      - log: {{level: info}}\n"
    )
    return str(path)


def test_the_shipped_defaults_give_the_idle_rank_one_underuse_finding() -> None:
    records = replay(DEFAULT_POLICIES)
    underused = findings(records, "low_utilization")
    # GPU 0: below 20 % on the 20 s mean from the start-up idle through the training to
    # the end of the log, one finding (every-sample judging gave 16 here).
    ((start, clear),) = underused[0]
    assert start <= TRAINING_S[0] and clear >= TRAINING_S[1], underused[0]
    started = [r for r in records if r["kind"] == "finding_started" and r["gpu_index"] == 0]
    assert [r["detector"] for r in started] == ["low_utilization"]
    assert "GPU 0 utilization.gpu " in started[0]["message"]
    assert "(mean over 20s)" in started[0]["message"]
    for gpu in range(1, 8):
        # the busy GPUs: their start-up idle, then nothing until training ends
        assert all(not TRAINING_S[0] + 5 < s < TRAINING_S[1] for s, _ in underused[gpu]), gpu
        assert underused[gpu][0][0] < 105.0 and underused[gpu][-1][1] > TRAINING_S[1], gpu


def test_an_imbalance_rule_gives_one_finding_naming_the_idle_gpu_and_its_peers(
    tmp_path: Path,
) -> None:
    rule = "idle_gpu: {percent: 10, clear: 20, busy_percent: 50, statistic: mean, for: 1m}"
    records = replay(policy_file(tmp_path, rule))
    imbalance = findings(records, "idle_gpu")
    assert set(imbalance) == {0}, dict(imbalance)
    ((start, clear),) = imbalance[0]
    assert TRAINING_S[0] < start < 240.0 and clear >= TRAINING_S[1] - 10.0, imbalance[0]
    last = next(r for r in records if r["kind"] == "finding_cleared")
    assert last["message"].startswith("GPU 0 utilization.gpu ")
    assert "(mean over 1m00s) while 7 of its 7 peers are busy: mean " in last["message"]


@pytest.mark.parametrize(
    ("condition", "without_hysteresis"),
    [
        ("low_utilization: {percent: 20, statistic: mean, for: 20s}", 2),
        ("idle_gpu: {percent: 10, busy_percent: 50, statistic: mean, for: 1m}", 10),
    ],
)
def test_hysteresis_keeps_a_mean_wavering_at_the_threshold_one_finding(
    tmp_path: Path, condition: str, without_hysteresis: int
) -> None:
    # Rank 0's window mean crosses the threshold now and then (up to 24 % on the 20 s
    # mean, 9-11 % on the 1 min mean): without `clear` each crossing ends the finding.
    detector = condition.split(":")[0]
    plain = findings(replay(policy_file(tmp_path, condition)), detector)
    assert len(plain[0]) == without_hysteresis, plain[0]
    clear = "clear: 40, " if detector == "low_utilization" else "clear: 20, "
    held = findings(replay(policy_file(tmp_path, condition.replace("{", "{" + clear))), detector)
    assert len(held[0]) == 1, held[0]
