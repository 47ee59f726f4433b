"""``tune_loader`` end to end: the real daemon tunes the real PyTorch CPU training job
(examples/train_digits.py) and journals every step with its measured samples/s.

No timing is asserted: the test checks that the knob ends where the job's own measured
throughput says it is best, whatever this (shared) machine's speed is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon

REPO = Path(__file__).resolve().parents[1]

POLICY = """\
policies:
  - name: starved-tune
    when:
      data_starved: {fraction: 0.05, for: 1s}
    do:
      - tune_loader: {knob: num_workers, direction: up, max: 2, measure: 2s, noise: 0.05}
"""


def events(daemon: RunningDaemon) -> list[dict[str, Any]]:
    result = daemon.ctl("events", "--json", "--since", "1h")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def tuner_decisions(daemon: RunningDaemon) -> list[dict[str, Any]]:
    return [e for e in events(daemon) if e["kind"] == "decision" and e["action"] == "tune_loader"]


def knob_value(daemon: RunningDaemon) -> int | None:
    status = json.loads(daemon.ctl("--json", "status").stdout)
    for entry in status["jobs"]:
        if entry["name"] == "digits":
            return int(entry["knobs"]["num_workers"]["value"])
    return None


def held(daemon: RunningDaemon) -> list[dict[str, Any]] | None:
    """The tuner's decisions once it holds (its last decision is not a 'start'/'better'
    move) and the job runs with the value it holds."""
    found = tuner_decisions(daemon)
    holds = found and found[-1]["params"]["verdict"] in ("worse", "plateau", "bound")
    return found if holds and knob_value(daemon) == found[-1]["params"]["value"] else None


def brief(decisions: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keys = ("previous", "value", "verdict", "samples_per_s_before", "samples_per_s_after")
    return [tuple(d["params"][k] for k in keys) for d in decisions]


@pytest.mark.slow
def test_the_daemon_tunes_num_workers_of_a_live_job_to_its_measured_best(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "tune.yaml"
    policy.write_text(POLICY)
    daemon = run_daemon(args=["--policies", str(policy), "--devices", "none"])
    log_path = tmp_path / "digits.log"
    with log_path.open("wb") as log:
        job = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "examples" / "train_digits.py"),
                "--job",
                "digits",
                "--num-workers",
                "0",
                "--views",
                "1",
                "--duration-s",
                "240",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=daemon.env,
        )
    try:
        decisions = daemon.wait_until(lambda: held(daemon), timeout_s=200, what="tuner holds")
        outcomes = {
            e["decision_id"]: e["outcome"] for e in events(daemon) if e["kind"] == "outcome"
        }
    finally:
        job.terminate()
        job.wait(timeout=30)
    # it moved up from 0 workers (loading in the training process) at least once
    first = decisions[0]["params"]
    assert (first["previous"], first["value"], first["verdict"]) == (0, 1, "start")
    assert first["samples_per_s_before"] > 0, brief(decisions)  # the baseline at 0 workers
    # every comparison holds the two measured throughputs, and the held value is the best
    # measured one (or, within the 5 % noise margin, the cheaper one)
    measured: dict[int, float] = {}
    for decision in decisions[1:]:
        params = decision["params"]
        assert params["samples_per_s_before"] > 0 and params["samples_per_s_after"] > 0
        measured[params["previous"]] = params["samples_per_s_after"]
    measured[0] = first["samples_per_s_before"]
    final = decisions[-1]["params"]["value"]
    assert measured[final] >= 0.95 * max(measured.values()), (measured, brief(decisions))
    # moves were carried out and acknowledged by the job; the journal says so
    moves = [d for d in decisions if d["params"]["value"] != d["params"]["previous"]]
    assert moves and all(outcomes.get(d["decision_id"]) == "applied" for d in moves), outcomes
    assert f"num_workers={final}" in log_path.read_text()
    print(brief(decisions))
