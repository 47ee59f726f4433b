"""``gpuwatchd install-unit --root DIR``: the files it writes, without touching the system.

The install under a real systemd (with systemd-sysusers, tmpfiles, daemon-reload) is in
tests/test_systemd_service.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import BIN
from gpuwatchd.install import entry_point, unit_text


def test_install_unit_writes_the_unit_for_this_installation(tmp_path: Path) -> None:
    result = subprocess.run(
        [BIN / "gpuwatchd", "install-unit", "--root", tmp_path],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    unit = (tmp_path / "etc/systemd/system/gpuwatchd.service").read_text()
    (exec_start,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    script, command = exec_start.removeprefix("ExecStart=").split(" ")
    assert Path(script).samefile(BIN / "gpuwatchd") and command == "run", exec_start
    assert "ExecStart=/usr/bin/gpuwatchd" not in unit
    assert "g       gpuwatch       -" in (tmp_path / "etc/sysusers.d/gpuwatchd.conf").read_text()
    tmpfiles = (tmp_path / "etc/tmpfiles.d/gpuwatchd.conf").read_text()
    assert "d      /run/gpuwatchd   0750 root gpuwatch -" in tmpfiles
    for path in tmp_path.rglob("*.conf"):
        assert path.stat().st_mode & 0o777 == 0o644
    assert "ran " not in result.stdout  # --root runs no tool

    removed = subprocess.run(
        [BIN / "gpuwatchd", "install-unit", "--uninstall", "--root", tmp_path],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert removed.returncode == 0, removed.stderr
    assert not list(tmp_path.rglob("gpuwatchd*")), list(tmp_path.rglob("*"))


def test_entry_point_without_a_script_runs_the_module(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python3"
    assert entry_point(str(python)) == [str(python), "-m", "gpuwatchd"]
    assert Path(entry_point(sys.executable)[0]).samefile(BIN / "gpuwatchd")


def test_exec_start_quotes_a_path_with_spaces() -> None:
    unit = unit_text(["/opt/my venv/bin/python", "-m", "gpuwatchd"])
    assert '\nExecStart="/opt/my venv/bin/python" -m gpuwatchd run\n' in unit


def test_the_jobs_sandbox_needs_become_a_generated_dropin(tmp_path: Path) -> None:
    # Workers run inside the daemon's sandbox (ProtectSystem=strict, no IP, issue 11):
    # their SQLite directory and cwd must be writable, a PostgreSQL host reachable.
    config = tmp_path / "site.yaml"
    config.write_text(
        "jobs:\n"
        "  local:\n"
        '    command: ["python", "tune.py"]\n'
        "    cwd: /srv/hpo\n"
        '    optuna: {storage: "sqlite:////srv/hpo-db/optuna.db", study: s}\n'
        "  remote:\n"
        '    command: ["python", "tune.py"]\n'
        '    optuna: {storage: "postgresql://optuna@127.0.0.1:5432/optuna", study: s}\n'
    )
    root = tmp_path / "root"
    result = subprocess.run(
        [BIN / "gpuwatchd", "install-unit", "--root", root, "--config", config],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    dropin = root / "etc/systemd/system/gpuwatchd.service.d/50-gpuwatchd-jobs.conf"
    lines = dropin.read_text().splitlines()
    assert "ReadWritePaths=-/srv/hpo" in lines and "ReadWritePaths=-/srv/hpo-db" in lines
    assert "RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6" in lines
    assert "IPAddressAllow=127.0.0.1" in lines
    unit = (root / "etc/systemd/system/gpuwatchd.service").read_text()
    assert f" run --config {config}\n" in unit

    # Without those jobs the next install removes the stale drop-in.
    config.write_text("interval: 1s\n")
    subprocess.run(
        [BIN / "gpuwatchd", "install-unit", "--root", root, "--config", config],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert not dropin.exists()


def _install(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BIN / "gpuwatchd", "install-unit", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_notify_urls_become_the_notifications_dropin(tmp_path: Path) -> None:
    """docs/systemd.md#notifications: the drop-in that lets `notify` reach its receivers,
    from --notify and from the notify actions of the config's policies."""
    root = tmp_path / "root"
    dropin = root / "etc/systemd/system/gpuwatchd.service.d/50-gpuwatchd-notify.conf"
    result = _install("--root", root, "--notify", "json://10.20.0.15:8080/gpuwatchd")
    assert result.returncode == 0, result.stderr
    lines = dropin.read_text().splitlines()
    assert "[Service]" in lines
    assert "RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6" in lines
    assert "IPAddressAllow=10.20.0.15" in lines  # an address: no resolver needed
    assert not any(ln.startswith("IPAddressDeny=") for ln in lines)  # the unit's `any` stays
    assert f"wrote {dropin}" in result.stdout
    assert dropin.stat().st_mode & 0o777 == 0o644

    # From the config: the policies' notify URLs (a host name: its addresses now).
    policy = tmp_path / "notify.yaml"
    policy.write_text(
        "policies:\n"
        "  - name: idle-to-relay\n"
        "    when:\n"
        "      low_utilization: {percent: 20, for: 10m}\n"
        "    do:\n"
        "      - notify: {urls: ['jsons://localhost:8443/hook', 'json://127.0.0.1/x']}\n"
    )
    config = tmp_path / "site.yaml"
    config.write_text(f"policies: ['{policy}']\n")
    result = _install("--root", root, "--config", config)
    assert result.returncode == 0, result.stderr
    (allow,) = [ln for ln in dropin.read_text().splitlines() if ln.startswith("IPAddressAllow=")]
    assert "127.0.0.1" in allow.split("=", 1)[1].split()
    assert "10.20.0.15" not in allow  # rewritten: only what is asked now

    # A URL that names tokens, not a host (Slack): refused, the token never printed.
    bad = _install("--root", root, "--notify", "slack://T000SECRET/B000/XXXX")
    assert bad.returncode == 1
    assert "slack://" in bad.stderr and "relay" in bad.stderr
    assert "notify URL 1 (slack://…)" in bad.stderr
    assert not any(t in bad.stderr.upper() for t in ("T000SECRET", "B000", "XXXX"))

    # No notify URL any more: the drop-in goes; --uninstall removes everything.
    again = _install("--root", root)
    assert again.returncode == 0, again.stderr
    assert not dropin.exists() and f"removed {dropin}" in again.stdout
    assert _install("--root", root, "--notify", "json://10.20.0.15/x").returncode == 0
    assert dropin.exists()
    assert _install("--root", root, "--uninstall").returncode == 0
    assert not list(root.rglob("gpuwatchd*")), list(root.rglob("*"))
