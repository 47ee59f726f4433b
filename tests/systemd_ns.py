"""A real systemd (252 here) booted as PID 1 of a private PID and mount namespace.

The tests marked ``systemd`` use :func:`boot_systemd`: it runs, exactly as issue 11 says,

    unshare -p -f -m --mount-proc --propagation private sh -c \\
      'mount -t tmpfs tmpfs /tmp && exec env container=docker /lib/systemd/systemd \\
       --system --unit=basic.target'

and commands run inside with ``nsenter -t <pid> -p -m ...``. It needs root and
/lib/systemd/systemd; elsewhere the tests skip and say why.

What the namespace shares with the machine: everything but /tmp (its own tmpfs; without it
systemd-tmpfiles at boot empties the machine's /tmp) and /proc. Files written to /etc,
/opt, /srv, /var/lib land on the real file system, so the fixture:

* refuses to start (fails the test) when one of the paths it owns (:data:`OWNED_PATHS`)
  already exists, so that it never removes something it did not create;
* at the end, even when a test failed or the boot did: SIGKILLs the namespace's systemd
  (which ends every process of the namespace: the kernel kills a PID namespace with its
  init), waits for it, then removes every owned path, the directories /etc/sysusers.d and
  /etc/tmpfiles.d if it saw them absent, and every user and group that appeared in
  /etc/passwd and /etc/group while it ran (userdel/groupdel);
* asserts that no process of the namespace is left (``pgrep -x systemd`` finds none of it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

SYSTEMD = Path("/lib/systemd/systemd")
BOOT = (
    "unshare -p -f -m --mount-proc --propagation private sh -c "
    "'mount -t tmpfs tmpfs /tmp && exec env container=docker /lib/systemd/systemd "
    "--system --unit=basic.target'"
)

#: Paths on the real file system that the systemd tests create and the fixture removes.
OWNED_PATHS = (
    "/etc/systemd/system/gpuwatchd.service",
    "/etc/systemd/system/gpuwatchd.service.d",
    "/etc/systemd/system/multi-user.target.wants/gpuwatchd.service",
    "/etc/systemd/system/gpuwatchd-jobs.slice",
    "/etc/systemd/system/gpuwatchd-metrics.socket",
    "/etc/systemd/system/sockets.target.wants/gpuwatchd-metrics.socket",
    "/etc/gpuwatchd",
    "/var/lib/gpuwatchd",
    "/etc/sysusers.d/gpuwatchd.conf",
    "/etc/tmpfiles.d/gpuwatchd.conf",
    "/opt/gpuwatchd",
    "/srv/gpuwatchd-test",
    "/srv/gwtest-hpo",
    "/srv/gwtest-keep",
    "/srv/gwtest-pg",
    "/srv/gwtest-chaos",
    "/run/gpuwatchd",
)
_CREATED_DIRS = ("/etc/sysusers.d", "/etc/tmpfiles.d")


def why_not() -> str | None:
    """Why a systemd cannot be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "the systemd tests boot systemd in a namespace: they need root"
    if not SYSTEMD.is_file():
        return f"the systemd tests need {SYSTEMD} (Debian's systemd package)"
    for tool in ("unshare", "nsenter", "sh", "mount"):
        if shutil.which(tool) is None:
            return f"the systemd tests need {tool} (util-linux)"
    return None


def clean_env() -> dict[str, str]:
    """This environment without what would leak the test run into the namespace's commands
    (PYTHONPATH naming a checkout, the shared venv, pip settings, a notify socket)."""
    drop = ("PYTHON", "PIP_", "VIRTUAL_ENV", "NOTIFY_SOCKET", "INVOCATION_ID", "GPUWATCHD_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def _names(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {line.split(":", 1)[0] for line in f if ":" in line}


@dataclass
class SystemdNamespace:
    """A booted systemd: its PID (on the machine) and a way to run commands inside."""

    pid: int
    _unshare: subprocess.Popen[bytes] = field(repr=False)
    booted_at_s: int = field(default_factory=lambda: int(time.time()))

    def argv(self, *argv: str | Path) -> list[str]:
        """The argv that runs ``argv`` inside the namespace (as root)."""
        return ["nsenter", "-t", str(self.pid), "-p", "-m", *(str(a) for a in argv)]

    def run(
        self, *argv: str | Path, check: bool = True, timeout_s: float = 120.0,
        input: str | None = None, env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``argv`` inside the namespace; with ``check`` assert it exited 0."""
        result = subprocess.run(
            self.argv(*argv), capture_output=True, text=True, timeout=timeout_s,
            input=input, env=clean_env() if env is None else env, cwd="/", check=False,
        )  # fmt: skip
        if check:
            assert result.returncode == 0, (
                f"{list(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def as_user(
        self, user: str, *argv: str | Path, check: bool = False, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace as ``user`` with that user's groups."""
        return self.run("runuser", "-u", user, "--", *argv, check=check, timeout_s=timeout_s)

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, *args: str) -> str:
        """The unit's journal (message text) since this boot, through journalctl inside.

        Since this boot: the namespace shares /var/log/journal (and the kernel's boot id)
        with the machine, so earlier boots' entries are there too.
        """
        return self.run(
            "journalctl", "--no-pager", "-o", "cat", f"--since=@{self.booted_at_s}",
            "-u", unit, *args, check=False,
        ).stdout  # fmt: skip

    def wait_for(
        self, what: str, predicate: object, timeout_s: float = 30.0, interval_s: float = 0.5,
        unit: str = "gpuwatchd",
    ) -> None:
        """Poll ``predicate()`` until true; fail naming ``what`` after ``timeout_s``."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, (
                f"timed out waiting for {what}; journal of {unit}:\n"
                + "\n".join(self.journal(unit).splitlines()[-30:])
            )
            time.sleep(interval_s)


def _child_of(pid: int, timeout_s: float = 30.0) -> int:
    """The PID of ``pid``'s only child once it has exec'd systemd."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            for child in children:
                comm = Path(f"/proc/{child}/comm").read_text().strip()
                if comm == "systemd":
                    return int(child)
        time.sleep(0.05)
    raise AssertionError("systemd did not start in the namespace")


def _remove(paths: Sequence[str]) -> list[str]:
    removed = []
    for p in paths:
        path = Path(p)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        removed.append(p)
    return removed


@contextlib.contextmanager
def boot_systemd() -> Iterator[SystemdNamespace]:
    """Boot systemd in a private PID+mount namespace; clean up everything after.

    Raises :class:`pytest.skip.Exception` where :func:`why_not` says no, and fails when a
    path of :data:`OWNED_PATHS` exists before the boot (it is not ours to remove).
    """
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    under_tmp = [
        str(p) for p in (Path(__file__).resolve(), Path(sys.prefix).resolve())
        if p.is_relative_to("/tmp")
    ]  # fmt: skip
    if under_tmp:
        pytest.fail(
            f"{under_tmp} under /tmp, which the namespace replaces with its own (PrivateTmp): "
            "the tests' files and venv would not be seen there; clone the repository elsewhere"
        )
    with _booting_alone():
        yield from _boot()


#: One namespace at a time on this machine: the namespaces share OWNED_PATHS, the users
#: they add and the real /etc (pytest-xdist workers, or two checkouts, would clobber each
#: other's). Outside /tmp, which each namespace replaces.
LOCK_PATH: Final = "/var/lock/gpuwatchd-systemd-tests.lock"


@contextlib.contextmanager
def _booting_alone() -> Iterator[None]:
    """Hold the machine-wide lock on :data:`LOCK_PATH` (flock(2); waits for the holder)."""
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _boot() -> Iterator[SystemdNamespace]:
    present = [p for p in OWNED_PATHS if os.path.lexists(p)]
    if present:
        pytest.fail(f"refusing to boot: {present} exist and the teardown would remove them")
    dirs_absent = [d for d in _CREATED_DIRS if not os.path.lexists(d)]
    users, groups = _names("/etc/passwd"), _names("/etc/group")
    unshare = subprocess.Popen(
        ["sh", "-c", f"exec {BOOT}"], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    pid = None
    try:
        pid = _child_of(unshare.pid)
        ns = SystemdNamespace(pid, unshare)
        # The manager's bus comes up a moment after the exec: ask until it answers.
        deadline = time.monotonic() + 90
        while True:
            state = ns.run("systemctl", "is-system-running", "--wait", check=False)
            if state.stdout.strip() in ("running", "degraded"):
                break
            assert time.monotonic() < deadline, f"systemd did not boot: {state}"
            time.sleep(0.2)
        yield ns
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(unshare.pid, signal.SIGKILL)
        unshare.wait(timeout=30)
        if pid is not None:
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
        for name in sorted(_names("/etc/passwd") - users):
            subprocess.run(["userdel", name], capture_output=True, check=False)
        for name in sorted(_names("/etc/group") - groups):
            subprocess.run(["groupdel", name], capture_output=True, check=False)
        _remove(OWNED_PATHS)
        for d in dirs_absent:
            with contextlib.suppress(OSError):
                shutil.rmtree(d)
        left = subprocess.run(["pgrep", "-x", "systemd"], capture_output=True, text=True)
        assert str(pid) not in left.stdout.split(), "the namespace's systemd outlived the tests"
