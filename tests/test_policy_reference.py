"""Tests of the policy reference: docs/policy-reference.md holds the tables from the registries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd.detectors import DETECTORS
from gpuwatchd.policy.reference import END, START, main, render, splice
from gpuwatchd.policy.schema import ACTIONS, POLICY_KEYS

DOCS = Path(__file__).resolve().parent.parent / "docs"
REFERENCE = DOCS / "policy-reference.md"


def test_docs_reference_is_current() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    assert splice(text, render()) == text, (
        "docs/policy-reference.md is stale: run "
        "python -m gpuwatchd.policy.reference --write docs/policy-reference.md"
    )
    assert text.startswith("# Policy reference\n")
    assert "(policy-reference.md)" in (DOCS / "policies.md").read_text(encoding="utf-8")


def test_render_names_every_key_detector_action_and_param() -> None:
    text = render()
    for spec in POLICY_KEYS:
        assert f"| `{spec.name}` |" in text
    for name, cls in DETECTORS.items():
        assert f"| `{name}` |" in text
        for param in cls.params:
            assert f"| `{param.name}` | {param.unit.replace('|', chr(92) + '|')} |" in text
    for name in ACTIONS:
        assert f"| `{name}` |" in text
    assert "| `for` | duration | `30s` |" in text  # defaults as written in YAML
    assert "| `knob` | name | required |" in text
    assert "| `mode` | drain\\|now | `drain` |" in text  # a | inside a cell is escaped


def test_splice_replaces_only_between_the_markers() -> None:
    doc = f"# T\n\nbefore\n{START}\nold\n{END}\nafter\n"
    assert splice(doc, "new\n") == f"# T\n\nbefore\n{START}\nnew\n{END}\nafter\n"
    with pytest.raises(ValueError, match="expected one"):
        splice("no markers\n", "x\n")
    with pytest.raises(ValueError, match="comes before"):
        splice(f"{END}\n{START}\n", "x\n")


def test_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text(f"intro\n{START}\nold table\n{END}\nrest\n", encoding="utf-8")
    assert main(["--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
    written = stale.read_text(encoding="utf-8")
    assert written.startswith("intro\n") and written.endswith(f"{END}\nrest\n")
    assert render() in written
    missing = tmp_path / "plain.md"
    missing.write_text("no markers\n", encoding="utf-8")
    assert main(["--check", str(missing)]) == 2
    assert main(["--check", str(tmp_path / "nope.md")]) == 2


def test_module_runs_as_a_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatchd.policy.reference", "--check", str(REFERENCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    printed = subprocess.run(
        [sys.executable, "-m", "gpuwatchd.policy.reference"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert printed.stdout == render()
