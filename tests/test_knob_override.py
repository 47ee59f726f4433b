"""An operator's knob change holds against policies (issue 21: "a policy silently
overrides an operator"), with the REAL daemon (``run_daemon``), a job attached with the
real hook and the real ``gpuwatchctl``.

The job applies knob changes only when the test opens a gate (``watch.apply_knobs()``
at a file's appearance), so what is pending in the job when a policy fires is decided
by the test, not by the machine's speed. The policy ``pin-one`` sets ``num_workers`` to
1 whenever the host uses any CPU, at most once a second.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon, restart_on_same_state

POLICY = """\
policies:
  - name: pin-one
    when:
      # always true: a host's used memory is never 0 % (host CPU can read 0.0 % on an
      # idle machine, which cleared the finding and stopped the policy: a flake)
      host_memory_above: {percent: 0, for: 0.2s}
    do:
      - set_knob: {knob: num_workers, value: 1}
    cooldown: 1s
"""

JOB = """\
import sys, time
from pathlib import Path
from gpuwatchd.hook import attach

gates = Path(sys.argv[1])
with attach(job="held", knobs={"num_workers": 2}) as watch:
    opened = 0
    while not (gates / "stop").exists():
        if (gates / f"apply-{opened}").exists():
            values = watch.apply_knobs()
            (gates / f"applied-{opened}").write_text(str(values["num_workers"]))
            opened += 1
        time.sleep(0.05)
"""


def journal(daemon: RunningDaemon) -> list[dict[str, Any]]:
    result = daemon.ctl("--json", "events", "--since", "1h")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def policy_moves(daemon: RunningDaemon) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """The policy's set_knob decisions with their outcome events (None: none yet)."""
    rows = journal(daemon)
    outcomes = {e["decision_id"]: e for e in rows if e["kind"] == "outcome"}
    return [
        (d, outcomes.get(d["decision_id"]))
        for d in rows
        if d["kind"] == "decision" and d["policy"] == "pin-one"
    ]


def knob(daemon: RunningDaemon) -> dict[str, Any] | None:
    for entry in daemon.status()["jobs"]:
        if entry["name"] == "held":
            return dict(entry["knobs"]["num_workers"])
    return None


class Gates:
    """The job's gates: :meth:`open` lets it apply what is pending, once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opened = 0

    def open(self, daemon: RunningDaemon) -> int:
        """Let the job apply its pending changes; returns the value it then has."""
        n = self.opened
        (self.path / f"apply-{n}").touch()
        self.opened += 1
        applied = self.path / f"applied-{n}"
        daemon.wait_until(applied.exists, what=f"the job applied (gate {n})")
        return int(applied.read_text())


@pytest.mark.slow
def test_an_operators_knob_holds_against_a_policy_that_names_itself(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "pin.yaml"
    policy.write_text(POLICY)
    daemon = run_daemon(args=["--policies", str(policy), "--devices", "none"])
    gates = Gates(tmp_path)
    job_script = tmp_path / "job.py"
    job_script.write_text(JOB)
    with (tmp_path / "job.log").open("wb") as log:
        job = subprocess.Popen(
            [sys.executable, str(job_script), str(tmp_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=daemon.env,
        )
    uid = os.getuid()
    try:
        daemon.wait_until(lambda: policy_moves(daemon), what="the policy's first move")

        # 1. Without a hold, the policy supersedes the operator's pending change (its
        # next move, a second later): the operator's error names the policy, not an id.
        asked = daemon.ctl("knob", "held", "num_workers", "3", "--hold", "0", "--wait", "30")
        assert asked.returncode == 1
        assert asked.stderr.strip() == (
            "gpuwatchctl: conflict: superseded by policy pin-one (num_workers=1) "
            "before it was applied"
        )
        # and the policy's own move the operator superseded says so in the journal
        outcomes = [o for _, o in policy_moves(daemon) if o is not None]
        assert any(
            o["outcome"] == "refused"
            and o["detail"].endswith(
                "conflict: superseded by operator (num_workers=3) before it was applied"
            )
            for o in outcomes
        ), outcomes

        # 2. With --hold, the change holds: the job applies it, and the policy's later
        # moves are refused, naming the operator.
        asked = daemon.ctl("knob", "held", "num_workers", "3", "--hold", "1m", "--wait", "0")
        assert asked.returncode == 0, asked.stderr
        assert re.fullmatch(
            r"held: num_workers=3 pending, held against policies until "
            r"\d\d:\d\d:\d\d UTC\n",
            asked.stdout,
        ), asked.stdout
        asked_at = len(policy_moves(daemon))
        assert gates.open(daemon) == 3

        def refused_since() -> list[dict[str, Any]]:
            moves = policy_moves(daemon)[asked_at:]
            return [o for _, o in moves if o is not None and o["outcome"] == "refused"]

        refused = daemon.wait_until(refused_since, what="a policy move refused")
        assert re.fullmatch(
            rf"operator override: num_workers=3 by uid {uid} \(gpuwatchctl knob\) "
            r"until \d\d:\d\d:\d\d UTC",
            refused[0]["detail"],
        ), refused[0]
        assert all(o["outcome"] == "refused" for _, o in policy_moves(daemon)[asked_at:] if o)
        assert (knob(daemon) or {})["value"] == 3
        assert gates.open(daemon) == 3  # nothing of the policy's was pending in the job

        # status shows the hold, by whom and until when
        (held,) = daemon.status()["holds"]
        assert {k: held[k] for k in ("job", "knob", "value", "by_uid")} == {
            "job": "held",
            "knob": "num_workers",
            "value": 3,
            "by_uid": uid,
        }
        assert "Operator override: job held knob num_workers=3 by uid" in (
            daemon.ctl("status").stdout
        )

        # 3. The hold survives a daemon restart (it is journaled with the request).
        daemon.stop()
        later = restart_on_same_state(
            run_daemon, daemon, ["--policies", str(policy), "--devices", "none"]
        )
        assert [h["until_s"] for h in later.status()["holds"]] == [held["until_s"]]

        # 4. --hold 0 ends it: the policy moves the knob again.
        later.wait_until(lambda: knob(later), timeout_s=30, what="the job attached again")
        cleared_at = len(policy_moves(later))
        asked = later.ctl("knob", "held", "num_workers", "3", "--hold", "0", "--wait", "5")
        assert asked.returncode == 0, asked.stderr
        assert asked.stdout == "held: num_workers=3 applied\n"
        assert later.status()["holds"] == []
        later.wait_until(
            lambda: [
                d
                for d, o in policy_moves(later)[cleared_at:]
                if d["params"]["value"] == 1 and (o is None or o["outcome"] != "refused")
            ],
            what="the policy moves the knob again",
        )
        assert gates.open(later) == 1
    finally:
        (tmp_path / "stop").touch()
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
