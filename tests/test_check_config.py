"""``gpuwatchd check-config FILE``: the real command on real files, a job written as a user
writes one (``python train.py`` from PATH, storage on the command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import BIN, RunningDaemon

TRAIN = """\
import argparse

import optuna

from gpuwatchd.hook import attach
"""

POLICY = """\
policies:
  - name: crashed-trials-restart
    when:
      job_crashed: {kind: cuda_assert}
    do:
      - restart_study: {max_retries: 3}
"""


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpuwatchd"), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_each_mistake_is_named_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    policies = tmp_path / "policies.yaml"
    policies.write_text(POLICY)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        f"""\
jobs:
  gone:
    command: [python, train.py]
    cwd: {tmp_path}/no-such-dir
  typo:
    command: [pythno, train.py]
    cwd: {tmp_path}
  system-python:
    command: [python3, train.py]
    cwd: {tmp_path}
    env: {{PATH: /usr/bin:/bin, PYTHONPATH: ""}}
  hpo:
    command: [{sys.executable}, train.py, --storage, "sqlite:///{tmp_path}/runs/o.db"]
    cwd: {tmp_path}
    optuna:
      storage: "sqlite:///{tmp_path}/runs/o.db"
      study: s
      max_retries: 2
"""
    )
    result = _run("check-config", str(config), "--policies", str(policies), cwd=tmp_path)
    assert result.returncode == 1, result.stdout
    lines = result.stderr.splitlines()
    assert f"error: {config}:4: job 'gone': cwd {tmp_path}/no-such-dir is not a directory" in lines
    assert any(
        line.startswith(f"error: {config}:6: job 'typo': command[0] 'pythno' is not found on PATH")
        for line in lines
    ), lines
    # /usr/bin/python3 (PATH of the job) has no Optuna and no gpuwatchd.
    (system,) = [line for line in lines if "'system-python'" in line]
    assert system.startswith(f"error: {config}:9: ")
    assert "cannot import" in system and "gpuwatchd" in system and "optuna" in system
    assert any(
        line.startswith(f"error: {config}:16: job 'hpo': optuna.storage")
        and f"{tmp_path}/runs does not exist" in line
        for line in lines
    ), lines
    (conflict,) = [line for line in lines if "max_retries" in line]  # said, not a mistake
    assert conflict.startswith(f"warning: {config}:18: job 'hpo': optuna.max_retries is 2")
    assert f"{policies}:6" in conflict and "2 applies" in conflict
    assert len(lines) == 5, lines


def test_a_good_file_says_ok_and_check_policy_points_at_check_config(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        f"""\
interval: 1s
jobs:
  hpo:
    command: [{sys.executable}, train.py]
    cwd: {tmp_path}
    optuna: {{storage: "sqlite:///{tmp_path}/runs/o.db", study: s}}
"""
    )
    result = _run("check-config", str(config), cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.strip() == f"{config}: OK (1 jobs: hpo)"

    wrong = _run("check-policy", str(config), cwd=tmp_path)
    assert wrong.returncode == 1
    assert f"use gpuwatchd check-config {config}" in wrong.stderr


def test_a_parse_error_is_one_mistake_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        "jobs:\n  hpo:\n    command: [python]\n    optuna: {storage: 'sqlite:///o.db', study: s}\n"
    )
    result = _run("check-config", str(config), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {config}:4: ") and "relative" in result.stderr


def test_the_daemon_says_the_same_mistakes_at_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """``gpuwatchd run --config``: a job whose script imports a module its interpreter
    lacks is named with file:line in the log before any worker dies of it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("import optuna_typo_not_installed\n")
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        f"""\
jobs:
  hpo:
    command: [{sys.executable}, train.py]
    cwd: {work}
"""
    )
    policies = tmp_path / "policies.yaml"
    policies.write_text("policies: []\n")
    daemon = run_daemon(args=["--config", str(config), "--policies", str(policies)])
    (said,) = [e for e in daemon.events() if e["event"] == "config.job_check_failed"]
    assert said["mistake"].startswith(f"{config}:3: job 'hpo': ")
    assert "cannot import optuna_typo_not_installed" in said["mistake"]
    assert daemon.stop() == 0


def test_every_bad_setting_and_job_is_named_and_good_jobs_are_still_checked(
    tmp_path: Path,
) -> None:
    """Not just the first error: a relative SQLite URL, a misspelt job key and a misspelt
    setting are three mistakes with their lines; a job that parses is checked too."""
    (tmp_path / "train.py").write_text(TRAIN)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        f"""\
intervall: 1s
jobs:
  relative:
    command: [{sys.executable}, train.py]
    optuna: {{storage: "sqlite:///runs/o.db", study: s}}
  typo:
    command: [{sys.executable}, train.py]
    worker: 3
  gone:
    command: [{sys.executable}, train.py]
    cwd: {tmp_path}/no-such-dir
"""
    )
    result = _run("check-config", str(config), cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"error: {config}:1: unknown setting 'intervall'"), lines
    assert lines[1].startswith(f"error: {config}:5: ") and "relative" in lines[1], lines
    assert lines[2].startswith(f"error: {config}:8: ") and "worker" in lines[2], lines
    assert (
        lines[3] == f"error: {config}:11: job 'gone': cwd {tmp_path}/no-such-dir is not a directory"
    )
    assert len(lines) == 4, lines


def test_a_max_retries_conflict_is_a_warning_and_the_file_is_ok(tmp_path: Path) -> None:
    """The smaller of a job's and a policy's ``max_retries`` applies (docs/managed-jobs.md,
    Retries): check-config says so and exits 0 (it exited 1 before)."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    policies = tmp_path / "policies.yaml"
    policies.write_text(POLICY)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        f"""\
jobs:
  hpo:
    command: [{sys.executable}, train.py]
    cwd: {tmp_path}
    optuna:
      storage: "sqlite:///{tmp_path}/runs/o.db"
      study: s
      max_retries: 1
"""
    )
    result = _run("check-config", str(config), "--policies", str(policies), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{config}: OK (1 jobs: hpo)"
    (warning,) = result.stderr.splitlines()
    assert warning.startswith(f"warning: {config}:8: job 'hpo': optuna.max_retries is 1 ")
    assert f"policy 'crashed-trials-restart' ({policies}:6)" in warning
    assert "max_retries 3: 1 applies" in warning

    as_json = _run("check-config", "--json", str(config), "--policies", str(policies), cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert (report["ok"], report["mistakes"]) == (True, [])
    assert [(w["path"], w["line"]) for w in report["warnings"]] == [(str(config), 8)]


def test_an_optuna_journal_storage_is_checked_like_an_sqlite_file(tmp_path: Path) -> None:
    """``journal:///ABS/PATH`` (Optuna's JournalStorage on a file) passes with an existing
    directory; a relative path, a missing directory, a bare path and a grace_period (no
    heartbeats in a journal) are mistakes with file:line, the paths shown as they are."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    config = tmp_path / "gpuwatchd.yaml"

    def job(name: str, optuna: str) -> str:
        return f"  {name}:\n    command: [{sys.executable}, train.py]\n    cwd: {tmp_path}\n" + (
            f"    optuna: {optuna}\n"
        )

    beats = f'{{storage: "journal://{tmp_path}/runs/b.log", study: s, grace_period: 1m}}'
    good = f'{{storage: "journal://{tmp_path}/runs/optuna.log", study: s}}'
    config.write_text("jobs:\n" + job("hpo", good))
    result = _run("check-config", str(config), cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.strip() == f"{config}: OK (1 jobs: hpo)"

    config.write_text(
        "jobs:\n"
        + job("relative", '{storage: "journal://optuna.log", study: s}')  # line 5
        + job("gone", f'{{storage: "journal://{tmp_path}/no-such-dir/optuna.log", study: s}}')
        + job("bare", f'{{storage: "{tmp_path}/runs/optuna.log", study: s}}')  # line 13
        + job("beats", beats)
    )
    result = _run("check-config", str(config), cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"error: {config}:5: job 'relative': optuna.storage: the journal path 'optuna.log' is "
        "relative (workers and the daemon resolve it in different directories); write "
        "journal:///absolute/path/optuna.log"
    )
    assert lines[1] == (
        f"error: {config}:9: job 'gone': optuna.storage: the journal file's directory "
        f"{tmp_path}/no-such-dir does not exist"
    )
    assert lines[2] == (
        f"error: {config}:13: job 'bare': optuna.storage: not a storage URL: "
        f"'{tmp_path}/runs/optuna.log'; for Optuna's JournalStorage on a file write "
        f"journal://{tmp_path}/runs/optuna.log, for an SQLite database "
        f"sqlite:///{tmp_path}/runs/optuna.log"
    )
    assert lines[3].startswith(
        f"error: {config}:17: job 'beats': optuna.grace_period needs Optuna trial heartbeats"
    )
    assert f"(journal://{tmp_path}/runs/b.log) has none" in lines[3]
    assert len(lines) == 4, lines
