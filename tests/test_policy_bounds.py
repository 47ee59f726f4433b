"""Hostile policy files: an alias bomb, a 50 MB file, a FIFO, a symlink to /dev/zero and
20,000-deep nesting are policy errors with file and line (never a hang, a RecursionError
or a traceback) in check-policy, at start-up, on SIGHUP and on ``gpuwatchctl policy
reload``; a reload parses off the event loop, so ``status`` answers meanwhile."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BIN, RunningDaemon
from gpuwatchd.errors import PolicyError
from gpuwatchd.policyfiles import MAX_POLICY_FILE_BYTES, load_policies

_LOL = '&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
_LAUGHS = ", ".join(
    [_LOL]
    + [f"&{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
)
BILLION_LAUGHS = (
    "policies:\n  - name: laughs\n    when:\n      idle_gpu:\n"
    f"        for: [{_LAUGHS}]\n    do:\n      - log: {{message: lol}}\n"
)
"""427 bytes expanding to 9**9 strings: on the code before the bounds it ran past 60 s
and 8 GiB (quoting the expanded value in the error)."""
GOOD = """\
policies:
  - name: gpu-idle
    when:
      idle_gpu: {for: 5m}
    do:
      - log: {message: idle}
"""


def _attack(tmp_path: Path, kind: str) -> Path:
    """Create the attack file ``kind`` in ``tmp_path`` and return its path."""
    path = tmp_path / f"{kind}.yaml"
    if kind == "laughs":
        path.write_text(BILLION_LAUGHS)
    elif kind == "deep":
        path.write_text("policies: " + "[" * 20_000 + "\n")
    elif kind == "big":
        line = "# " + "x" * 1021 + "\n"  # 1 KiB of comment: valid YAML, an empty document
        with path.open("w") as out:
            out.write(GOOD)
            for _ in range(50 * 1024):
                out.write(line)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    return path


ATTACKS = ["laughs", "deep", "big", "fifo", "zero"]
EXPECTED = {
    "laughs": "expands to more than",
    "deep": "nested more than",
    "big": "over the limit",
    "fifo": "not a regular file",
    "zero": "not a regular file",
}


@pytest.mark.parametrize("kind", ATTACKS)
def test_check_policy_refuses_the_attack_with_file_and_line(tmp_path: Path, kind: str) -> None:
    path = _attack(tmp_path, kind)
    done = subprocess.run(
        [str(BIN / "gpuwatchd"), "check-policy", str(path)],
        capture_output=True,
        text=True,
        timeout=120,  # a safety net against a hang (the FIFO blocked forever), not a measure
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr
    assert done.stderr.startswith(f"error: {path}"), done.stderr[:500]
    assert EXPECTED[kind] in done.stderr
    assert len(done.stderr) < 1200  # a short excerpt, never the expanded value


def test_a_file_at_the_limit_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD + "#" * (MAX_POLICY_FILE_BYTES - len(GOOD) - 1) + "\n")
    assert [p.name for p in load_policies([path]).policies] == ["gpu-idle"]
    with path.open("a") as out:
        out.write("#")
    with pytest.raises(PolicyError, match="over the limit"):
        load_policies([path])


def test_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "policies:\n"
        "  - &idle\n    name: a\n    when:\n      idle_gpu: {for: 5m}\n"
        "    do:\n      - log: {message: idle}\n"
        "  - <<: *idle\n    name: b\n"
    )
    assert [p.name for p in load_policies([path]).policies] == ["a", "b"]


def test_a_fifo_in_a_policy_directory_is_refused_not_waited_for(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    os.mkfifo(tmp_path / "b.yaml")
    with pytest.raises(PolicyError, match="not a regular file") as err:
        load_policies([tmp_path])
    assert err.value.path == str(tmp_path / "b.yaml")


def _control_policy_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    (directory / "main.yaml").write_text(GOOD)
    return directory


@pytest.mark.parametrize("kind", ATTACKS)
def test_daemon_refuses_the_attack_on_reload_and_sighup_and_keeps_its_policies(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path, kind: str
) -> None:
    directory = _control_policy_dir(tmp_path)
    daemon = run_daemon(args=["--policies", str(directory)])
    _attack(directory, kind)
    reload = daemon.ctl("policy", "reload")
    assert reload.returncode != 0
    assert "policy reload failed, the running policies stay" in reload.stderr
    assert str(directory / f"{kind}.yaml") in reload.stderr and EXPECTED[kind] in reload.stderr
    assert "internal" not in reload.stderr
    daemon.process.send_signal(signal.SIGHUP)
    failures = daemon.wait_until(
        lambda: [e for e in daemon.events() if e.get("event") == "policy.reload_failed"][1:],
        what="the SIGHUP reload to fail",
    )
    assert EXPECTED[kind] in failures[0]["error"]
    assert [p["name"] for p in daemon.status()["policies"]["policies"]] == ["gpu-idle"]
    log = daemon.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log
    assert max(len(line) for line in log.splitlines()) < 4000


def test_daemon_start_with_deep_nesting_is_a_policy_error(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    path = _attack(tmp_path, "deep")
    daemon = run_daemon(args=["--policies", str(path)], wait_ready=False)
    assert daemon.process.wait(timeout=60) == 1
    log = daemon.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log
    failed = [e for e in daemon.events() if e.get("event") == "daemon.start_failed"]
    assert failed and f"{path}:1:" in failed[0]["error"]


def test_status_answers_while_a_reload_is_parsing(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A reload of a big (within the cap) file takes a while to parse; a ``status`` asked
    after it was sent comes back before it, since the parse runs off the event loop."""
    directory = _control_policy_dir(tmp_path)
    daemon = run_daemon(args=["--policies", str(directory)])
    items = ",".join(f'"v{i}"' for i in range(80_000))  # ~0.7 MiB, ~80,000 nodes
    (directory / "zz-slow.yaml").write_text(f"policies: []\nslow: [{items}]\n")
    reloader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with reloader, asker:
        reloader.connect(str(daemon.socket))
        asker.connect(str(daemon.socket))
        reloader.sendall(b'{"id":1,"op":"policy.reload"}\n')
        asker.sendall(b'{"id":2,"op":"status"}\n')
        assert json.loads(asker.makefile("rb").readline())["ok"] is True
        reloader.setblocking(False)
        with pytest.raises(BlockingIOError):  # status answered, the reload still parsing
            reloader.recv(1, socket.MSG_PEEK)
        reloader.setblocking(True)
        reloader.settimeout(60)
        reloaded = json.loads(reloader.makefile("rb").readline())
    # Refused either way, the running policies kept: for the unknown key ``slow`` once it
    # has parsed, or for the parse deadline when the host is too loaded to parse ~0.7 MiB
    # in POLICY_LOAD_TIMEOUT_S (seen in a CI run at load average 12 on two cores).
    assert reloaded["ok"] is False
    message = reloaded["error"]["message"]
    assert "slow" in message or "reading the policies took more than" in message, message
    assert daemon.status()["policies"]["policies"], "a refused reload kept no policy"
