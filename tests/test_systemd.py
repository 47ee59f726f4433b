"""systemd integration: sd_notify messages on a real socket, the watchdog interval, and the
unit, sysusers.d and tmpfiles.d files checked by systemd's own tools."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from gpuwatchd.systemd import Notifier, strip_notify_env, watchdog_interval_s
from gpuwatchd.testing.notify import NotifyListener

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "gpuwatchd.service"
SYSUSERS = ROOT / "systemd" / "gpuwatchd.sysusers"
TMPFILES = ROOT / "systemd" / "gpuwatchd.tmpfiles"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # Short directory: Unix socket paths are limited to 107 bytes (unix(7)).
    with tempfile.TemporaryDirectory(prefix="gws", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# -- Notifier -------------------------------------------------------------------------------


def test_notifier_sends_every_message_to_the_notify_socket(
    sockdir: Path, clean_env: pytest.MonkeyPatch
) -> None:
    with NotifyListener(sockdir) as listener:
        clean_env.setenv("NOTIFY_SOCKET", listener.path)
        notifier = Notifier()
        assert notifier.enabled
        notifier.ready()
        notifier.status("watching 2 GPUs\n  3 jobs")
        notifier.watchdog()
        before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notifier.reloading()
        after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notifier.ready_after_reload()
        notifier.stopping()
        listener.wait_for("STOPPING=1")

        assert listener.messages[:3] == [
            {"READY": "1"},
            {"STATUS": "watching 2 GPUs 3 jobs"},  # one line, as sd_notify(3) wants
            {"WATCHDOG": "1"},
        ]
        reloading = listener.messages[3]
        assert reloading["RELOADING"] == "1"
        assert before_usec <= int(reloading["MONOTONIC_USEC"]) <= after_usec
        assert listener.messages[4:] == [{"READY": "1"}, {"STOPPING": "1"}]
        assert {n.pid for n in listener.notifications} == {os.getpid()}


def test_notifier_reaches_an_abstract_socket(clean_env: pytest.MonkeyPatch) -> None:
    name = f"gpuwatchd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(5)
        clean_env.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = Notifier()
        assert notifier.enabled
        notifier.ready()
        assert server.recv(4096) == b"READY=1"


def test_notifier_without_notify_socket_does_nothing(clean_env: pytest.MonkeyPatch) -> None:
    fds_before = _open_fds()
    notifier = Notifier()
    assert not notifier.enabled
    notifier.ready()
    notifier.status("x")
    notifier.watchdog()
    notifier.reloading()
    notifier.ready_after_reload()
    notifier.stopping()
    assert _open_fds() == fds_before  # not even a socket was created
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    assert notifier.watchdog_interval_s() is None


@pytest.mark.parametrize("value", ["", "vsock:2:1234", "relative/path"])
def test_notifier_ignores_unusable_notify_socket_values(
    value: str, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", value)
    notifier = Notifier()
    assert not notifier.enabled
    notifier.ready()


def test_notifier_with_a_dead_socket_never_raises(
    sockdir: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(sockdir / "nobody-listens.sock"))
    notifier = Notifier()
    assert notifier.enabled
    for _ in range(3):
        notifier.ready()
        notifier.watchdog()


def test_notifier_connects_again_after_the_listener_comes_back(
    sockdir: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(sockdir / "notify.sock"))
    notifier = Notifier()
    notifier.ready()  # nobody there yet: dropped
    with NotifyListener(sockdir) as listener:
        notifier.watchdog()
        assert listener.wait_for("WATCHDOG=1") == "WATCHDOG=1"


def test_strip_notify_env_keeps_everything_else() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert strip_notify_env(env) == {"PATH": "/bin"}


# -- watchdog interval (sd_watchdog_enabled(3)) ---------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected_s"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "{pid}"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another pid
        ({"WATCHDOG_USEC": "500000"}, 0.25),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "30s"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout(
    env: dict[str, str], expected_s: float | None, clean_env: pytest.MonkeyPatch
) -> None:
    for key, value in env.items():
        clean_env.setenv(key, value.format(pid=os.getpid()))
    assert watchdog_interval_s() == expected_s


def test_notifier_watchdog_interval_reads_the_environment(
    sockdir: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(sockdir / "notify.sock"))
    notifier = Notifier()
    assert notifier.watchdog_interval_s() is None
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notifier.watchdog_interval_s() == 15.0


def test_watchdog_interval_with_explicit_environment_and_pid() -> None:
    env = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4242"}
    assert watchdog_interval_s(env, pid=4242) == 5.0
    assert watchdog_interval_s(env, pid=4243) is None


def test_importing_the_module_touches_nothing(sockdir: Path) -> None:
    """Import in a fresh interpreter with NOTIFY_SOCKET set: no datagram may arrive."""
    with NotifyListener(sockdir) as listener:
        env = {**os.environ, "NOTIFY_SOCKET": listener.path}
        subprocess.run(
            [sys.executable, "-c", "import gpuwatchd.systemd, gpuwatchd.logs"],
            env=env,
            check=True,
            timeout=60,
        )
        with pytest.raises(TimeoutError):
            listener.wait_for(lambda m: True, timeout_s=0.2)


# -- the unit file --------------------------------------------------------------------------


def _tool(name: str) -> str:
    fallback = f"/usr/bin/{name}"
    path = shutil.which(name) or (fallback if os.path.exists(fallback) else None)
    assert path, f"{name} not found: these checks need systemd's tools (apt install systemd)"
    return path


def _directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for each directive; repeated keys (DeviceAllow=) all kept."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key, value))
    return out


def _verify(unit_text: str, workdir: Path) -> list[str]:
    """Run ``systemd-analyze verify`` on a copy of the unit; return the problems it reports.

    The copy's ExecStart= names this environment's gpuwatchd (the packaged path
    /usr/bin/gpuwatchd does not exist on a development machine, and verify checks that the
    binary is executable). Output lines of the form ``/some/other.unit:LINE: ...`` are about
    *other* unit files on this host that verify loads as dependencies (e.g. a distribution's
    broken unit pulled in by multi-user.target); they are dropped. Every other line, whether
    it names our file or not (some warnings name no file, e.g. about Group=), is a problem.
    """
    venv_gpuwatchd = Path(sys.executable).with_name("gpuwatchd")
    exe = str(venv_gpuwatchd) if venv_gpuwatchd.exists() else sys.executable
    copy = workdir / "gpuwatchd.service"
    copy.write_text(
        re.sub(r"^ExecStart=/usr/bin/gpuwatchd", f"ExecStart={exe}", unit_text, flags=re.M),
        encoding="utf-8",
    )
    proc = subprocess.run(
        [_tool("systemd-analyze"), "verify", "--man=no", "--recursive-errors=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workdir,
    )
    other_unit = re.compile(r"^(/\S+):\d+: ")
    problems = []
    for line in (proc.stdout + proc.stderr).splitlines():
        m = other_unit.match(line)
        if not line.strip() or (m and m.group(1) != str(copy)):
            continue
        problems.append(line)
    if proc.returncode != 0 and not problems:
        problems.append(f"systemd-analyze verify exited {proc.returncode}")
    return problems


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert _verify(UNIT.read_text(encoding="utf-8"), tmp_path) == []


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("WatchdogSec=30s", "WatchdogSec=thirty"),
        ("DeviceAllow=char-nvidia-caps r", "DeviceAllow=char-nvidia-caps q"),
        ("LockPersonality=yes", "LockPersonalty=yes"),
        ("Group=gpuwatch", "Group=-bad!"),
    ],
)
def test_verify_check_catches_a_broken_unit(good: str, bad: str, tmp_path: Path) -> None:
    """The filter in _verify must not hide real problems (guards the test above)."""
    text = UNIT.read_text(encoding="utf-8")
    assert good in text
    assert _verify(text.replace(good, bad), tmp_path) != []


def test_unit_has_the_promised_settings() -> None:
    directives = _directives(UNIT.read_text(encoding="utf-8"))
    service = {k: v for s, k, v in directives if s == "Service" and k != "DeviceAllow"}
    assert service["Type"] == "notify"
    assert service["ExecStart"] == "/usr/bin/gpuwatchd run"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["WatchdogSec"] == "30s"
    assert service["Restart"] == "on-failure"
    assert service["Group"] == "gpuwatch"
    assert "User" not in service  # root: NVML and workers as other users
    assert service["RuntimeDirectory"] == "gpuwatchd"
    assert service["RuntimeDirectoryMode"] == "0750"
    assert service["StateDirectory"] == "gpuwatchd"
    assert service["ConfigurationDirectory"] == "gpuwatchd"
    assert service["Environment"] == "GPUWATCHD_SOCKET=/run/gpuwatchd/control.sock"
    assert service["KillMode"] == "process"  # workers outlive a daemon crash: adopted
    assert service["TimeoutStopSec"] == "60s"
    assert service["DevicePolicy"] == "closed"
    assert service["RestrictAddressFamilies"] == "AF_UNIX AF_NETLINK"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
    }.items():
        assert service[key] == value, key
    allowed = {v for s, k, v in directives if k == "DeviceAllow"}
    assert {
        "/dev/nvidiactl rw",
        "/dev/nvidia-uvm rw",
        "/dev/nvidia-uvm-tools rw",
        "/dev/nvidia-modeset rw",
        "char-nvidia-frontend rw",
        "char-nvidia-uvm rw",
    } <= allowed


def test_every_unit_directive_is_commented() -> None:
    lines = UNIT.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if "=" in line and not line.startswith("#"):
            assert lines[number - 2].startswith("#"), f"line {number} has no comment: {line}"


# -- sysusers.d and tmpfiles.d --------------------------------------------------------------


def test_sysusers_file_is_accepted_and_creates_the_group(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [_tool("systemd-sysusers"), f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Creating group 'gpuwatch'" in proc.stdout + proc.stderr
    assert not (tmp_path / "etc" / "group").exists()  # dry run wrote nothing


def test_tmpfiles_create_the_directories_owned_by_the_group(tmp_path: Path) -> None:
    """sysusers then tmpfiles into a temporary root, as at first boot.

    ``systemd-tmpfiles`` here has no --dry-run; ``--root=`` confines it to the temporary
    root and resolves the group from the root's own /etc/group. As non-root the chown
    step fails (EPERM); the syntax, modes and group lookup are still checked.
    """
    (tmp_path / "etc").mkdir()
    subprocess.run(
        [_tool("systemd-sysusers"), f"--root={tmp_path}", str(SYSUSERS)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    groups = {
        line.split(":")[0]: line.split(":")[2]
        for line in (tmp_path / "etc" / "group").read_text(encoding="utf-8").splitlines()
    }
    assert set(groups) == {"gpuwatch", "gpuwatch-admin"}
    gid = groups["gpuwatch"]
    proc = subprocess.run(
        [_tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}", str(TMPFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = proc.stderr.splitlines()
    if os.geteuid() != 0:
        problems = [p for p in problems if not re.match(r"fchownat\(\) .* not permitted", p)]
    assert problems == []
    for directory in ("run/gpuwatchd", "var/lib/gpuwatchd"):
        st = (tmp_path / directory).stat()
        assert stat.S_ISDIR(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o750, directory
        if os.geteuid() == 0:
            assert st.st_uid == 0
            assert st.st_gid == int(gid), directory
    if os.geteuid() == 0:
        assert proc.returncode == 0


def test_tmpfiles_check_catches_a_broken_line(tmp_path: Path) -> None:
    """Guards the test above: a bad line is reported, an unknown group too."""
    bad = tmp_path / "bad.conf"
    bad.write_text("d /run/gpuwatchd 0750 root no-such-group-xyz -\nz\n", encoding="utf-8")
    proc = subprocess.run(
        [_tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "no-such-group-xyz" in proc.stderr


def test_tmpfiles_agree_with_the_unit() -> None:
    """The tmpfiles lines and the unit's *Directory= settings describe the same dirs."""
    rows = [
        line.split()
        for line in TMPFILES.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ["d", "/run/gpuwatchd", "0750", "root", "gpuwatch", "-"] in rows
    assert ["d", "/var/lib/gpuwatchd", "0750", "root", "gpuwatch", "-"] in rows
    service = {k: v for s, k, v in _directives(UNIT.read_text(encoding="utf-8"))}
    assert service["RuntimeDirectoryMode"] == "0750"
    assert service["StateDirectoryMode"] == "0750"
    assert service["Group"] == "gpuwatch"


def test_what_the_notifier_cannot_use_is_logged_under_systemd_event_names(
    sockdir: Path, clean_env: pytest.MonkeyPatch
) -> None:
    with structlog.testing.capture_logs() as logs:
        watchdog_interval_s({"WATCHDOG_USEC": "30s"})
        watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"})
        clean_env.setenv("NOTIFY_SOCKET", "vsock:2:1234")
        Notifier()
        clean_env.setenv("NOTIFY_SOCKET", str(sockdir / "nobody-listens.sock"))
        dead = Notifier()
        dead.ready()
        dead.ready()  # the first failure only is logged
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("systemd.watchdog_usec_invalid", "warning"),
        ("systemd.watchdog_pid_invalid", "warning"),
        ("systemd.notify_socket_unsupported", "warning"),
        ("systemd.notify_failed", "warning"),
    ]
    assert logs[0]["watchdog_usec"] == "30s"
    assert logs[2]["notify_socket"] == "vsock:2:1234"
    assert logs[3]["state"] == "READY=1"


def _slurm_drop_in() -> str:
    """The drop-in docs/slurm.md ("Permissions") tells a Slurm node to add."""
    text = (ROOT / "docs" / "slurm.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```ini\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if "IPAddressAllow=" in b]
    return block


def test_the_slurm_drop_in_is_accepted_with_the_unit(tmp_path: Path) -> None:
    """The drop-in that lets the daemon reach slurmctld and PostgreSQL passes
    ``systemd-analyze verify`` with the packaged unit (its [Service] merged in as systemd
    merges a drop-in); a mistyped address in it does not."""
    unit = UNIT.read_text(encoding="utf-8")
    drop_in = _slurm_drop_in()
    assert "RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6" in drop_in
    assert _verify(unit + "\n" + drop_in, tmp_path) == []
    broken = drop_in.replace("IPAddressAllow=10.20.0.5", "IPAddressAllow=10.20.0.500")
    assert _verify(unit + "\n" + broken, tmp_path) != []
