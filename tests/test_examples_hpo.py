"""The shipped HPO example (``examples/hpo/``) as its header tells users to start it: the
config and the policies pass ``gpuwatchd check-config`` / ``check-policy`` (a config the
daemon would refuse, e.g. a relative SQLite URL, fails here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import BIN, REPO

EXAMPLE = REPO / "examples" / "hpo"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpuwatchd"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,  # "run from the repository root"
        env=env,
    )


def test_the_example_config_and_policies_pass_their_checks(tmp_path: Path) -> None:
    # The header's `mkdir -p /tmp/gw`, in the test's own directory (the machine's /tmp/gw
    # is not the test's to create); `python` on PATH is the activated environment's.
    text = (EXAMPLE / "gpuwatchd.yaml").read_text()
    assert "/tmp/gw/hpo.db" in text
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(text.replace("/tmp/gw", str(tmp_path / "gw")))
    (tmp_path / "gw").mkdir()
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    result = _run("check-config", str(config), env={**os.environ, "PATH": path})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.strip() == f"{config}: OK (1 jobs: demo)"

    policies = _run("check-policy", str(EXAMPLE / "policies.yaml"))
    assert policies.returncode == 0, policies.stderr
    assert "OK (3 policies" in policies.stdout
