"""The ``exec`` action (gpuwatchd/policy/actions/exec.py): the firing's fields put into
the argv, run as a real process without a shell."""

from __future__ import annotations

import sys
from pathlib import Path

from action_fakes import carry, firing, gpu_group
from gpuwatchd.policy.actions import exec as exec_action


def test_exec_fills_in_the_fields_and_its_exit_status_is_the_outcome(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = f"import sys; open({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))"
    argv = f'[{sys.executable}, -c, "{script}", "{{policy}}", "{{gpu_index}}", "{{gpu_uuid}};x"]'
    fired, params = firing(f"exec: {{argv: {argv}, timeout: 20s}}")
    (decision,) = exec_action.decide(fired, params, [gpu_group(1)])
    assert decision.params["argv"][3:] == ["p", "1", "GPU-0001;x"]
    assert decision.params["timeout_s"] == 20.0
    record = carry(decision)
    assert record.outcome == "applied"
    assert out.read_text() == "p 1 GPU-0001;x"

    fails, params = firing(f'exec: {{argv: [{sys.executable}, -c, "raise SystemExit(3)"]}}')
    (bad,) = exec_action.decide(fails, params, [gpu_group(0)])
    assert (carry(bad).outcome, carry(bad).detail) == ("failed", "exit status 3")
