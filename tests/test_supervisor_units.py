"""The supervisor tests again with the systemd launcher: each worker a transient unit.

Issue 11 asks that both launchers pass the same supervisor tests. This module boots a
real systemd (tests/systemd_ns.py) and runs tests/test_supervisor.py and
tests/test_supervisor_held.py inside its namespace with ``GPUWATCHD_TEST_LAUNCHER=systemd``
(so ``make()`` builds every Supervisor with ``launcher="systemd"``), then checks that the
same tests exist there as here (collected here: ``make test`` runs those modules with the
subprocess launcher itself), that they passed there, and that the workers really were units.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO
from systemd_ns import SystemdNamespace, boot_systemd

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

MODULES = (
    "tests/test_supervisor.py",
    "tests/test_supervisor_held.py",
    "tests/supervisor_unit_cases.py",
)
"""Run inside systemd; the last one there only (it fails elsewhere)."""


@pytest.fixture(scope="module")
def ns() -> Iterator[SystemdNamespace]:
    with boot_systemd() as booted:
        yield booted


def _outcomes(report: Path) -> dict[str, str]:
    """test id -> passed | failed | error | skipped: <reason>, from a JUnit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        out[name] = outcome
    return out


def _collected(output: str) -> dict[str, str]:
    """test id (as :func:`_outcomes` names it) -> "collected", from ``--collect-only -q``."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        path, sep, rest = line.strip().partition(".py::")
        if sep and path.startswith("tests/"):
            *classes, name = rest.split("::")
            out[f"{'.'.join([path.replace('/', '.'), *classes])}::{name}"] = "collected"
    return out


def _run_modules(
    ns: SystemdNamespace | None,
    launcher: str,
    report: Path,
    modules: tuple[str, ...],
    *pytest_args: str,
) -> str:
    """Run ``modules`` with ``launcher`` (inside ``ns`` when given); their output."""
    argv = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        f"--rootdir={REPO}", f"--junitxml={report}", "-o", "addopts=", *pytest_args,
        *(str(REPO / m) for m in modules),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPUWATCHD_"))}
    env["GPUWATCHD_TEST_LAUNCHER"] = launcher
    done = subprocess.run(
        argv if ns is None else ns.argv(*argv), env=env, cwd="/", capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    return done.stdout + done.stderr


def test_the_supervisor_tests_pass_with_workers_as_units(
    ns: SystemdNamespace, tmp_path: Path
) -> None:
    # The same modules collected here (not run: the suite runs them with this launcher).
    here = _run_modules(None, "subprocess", tmp_path / "here.xml", MODULES[:-1], "--collect-only")
    # The report path is on the machine's file system (/work...), not the namespace's /tmp.
    units_report = REPO / ".pytest-units.xml"
    try:
        inside = _run_modules(ns, "systemd", units_report, MODULES)
        with_units = _outcomes(units_report)
    finally:
        units_report.unlink(missing_ok=True)
    with_subprocess = _collected(here)
    only_units = {t for t in with_units if t.startswith("tests.supervisor_unit_cases::")}
    cases = (REPO / MODULES[-1]).read_text().count("\ndef test_")
    assert cases >= 3 and len(only_units) == cases, inside[-3000:]
    assert with_subprocess, here[-3000:]
    assert set(with_units) - only_units == set(with_subprocess), inside[-3000:]
    not_passed = {t: o for t, o in with_units.items() if o != "passed"}
    assert not not_passed, f"{not_passed}\n{inside[-6000:]}"
