"""The shipped policy files (policies/default.yaml and policies/examples/*.yaml) validate."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import BIN, REPO
from gpuwatchd.policyfiles import default_policy_path, load_policies

SHIPPED = sorted((REPO / "policies").rglob("*.yaml"))


def test_the_default_and_at_least_three_examples_are_shipped() -> None:
    names = [p.relative_to(REPO / "policies").as_posix() for p in SHIPPED]
    assert "default.yaml" in names
    assert len([n for n in names if n.startswith("examples/")]) >= 3
    assert default_policy_path() == REPO / "policies" / "default.yaml"  # a source checkout


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_check_policy_accepts_every_shipped_file(path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "gpuwatchd"), "check-policy", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"{path}: OK (" in result.stdout
    policies = load_policies([path]).policies
    assert policies, "a shipped file without policies"
    # Commented: every example explains itself before its first policy.
    assert path.read_text(encoding="utf-8").startswith("# ")


def test_the_examples_load_together_with_the_default() -> None:
    # Names are unique across files, so an example can sit next to a copy of default.yaml.
    merged = load_policies(SHIPPED)
    assert len(merged.policies) == sum(len(load_policies([p]).policies) for p in SHIPPED)
