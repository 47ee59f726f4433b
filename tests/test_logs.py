"""Logging: JSON lines for journald and pipes, readable text on a terminal."""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import structlog

from gpuwatchd.errors import ConfigError
from gpuwatchd.logs import STABLE_KEYS, configure_logging, get_logger, wants_json

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state; put it back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    aps_level = logging.getLogger("apscheduler").level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(aps_level)


def _json_lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_carry_the_stable_keys() -> None:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    log = get_logger("gpuwatchd.test")
    log.info("vram_above", gpu=1, gpu_uuid="GPU-5e1f", job="digits", policy="vram", action="log")

    (line,) = _json_lines(buf)
    assert list(line)[:4] == ["event", "level", "timestamp", "logger"]
    assert line["event"] == "vram_above"
    assert line["level"] == "info"
    assert line["logger"] == "gpuwatchd.test"
    assert {k: line[k] for k in STABLE_KEYS[4:]} == {
        "gpu": 1,
        "gpu_uuid": "GPU-5e1f",
        "job": "digits",
        "policy": "vram",
        "action": "log",
    }
    stamp = datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - stamp) < timedelta(minutes=1)


def test_json_mode_one_object_per_line_even_with_newlines_and_exceptions() -> None:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    log = get_logger("gpuwatchd.test", job="a\nb")
    try:
        raise RuntimeError("cuda device-side assert")
    except RuntimeError:
        log.exception("worker_crashed", exit_code=-6)
    log.info("after")
    first, second = _json_lines(buf)
    assert first["job"] == "a\nb"
    assert first["level"] == "error"
    assert "RuntimeError: cuda device-side assert" in str(first["exception"])
    assert second["event"] == "after"


def test_stdlib_loggers_of_libraries_come_out_as_json_too() -> None:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    logging.getLogger("some.library").warning("disk %s full", "/var")
    (line,) = _json_lines(buf)
    assert line["event"] == "disk /var full"
    assert line["level"] == "warning"
    assert line["logger"] == "some.library"


def test_apscheduler_per_tick_info_is_held_back_unless_debug() -> None:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    logging.getLogger("apscheduler.executors.default").info("Running job tick")
    logging.getLogger("apscheduler.executors.default").warning("missed run")
    assert [line["event"] for line in _json_lines(buf)] == ["missed run"]
    configure_logging(json=True, level="debug", stream=buf)
    logging.getLogger("apscheduler.executors.default").info("Running job tick")
    assert _json_lines(buf)[-1]["event"] == "Running job tick"


def test_level_filters_and_is_case_insensitive() -> None:
    buf = io.StringIO()
    configure_logging(json=True, level="WARNING", stream=buf)
    log = get_logger("gpuwatchd.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [line["event"] for line in _json_lines(buf)] == ["w", "e"]


def test_unknown_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown log level 'loud'"):
        configure_logging(level="loud", stream=io.StringIO())


def test_console_mode_renders_readable_text_without_colors_off_a_tty() -> None:
    buf = io.StringIO()
    configure_logging(json=False, stream=buf)
    get_logger("gpuwatchd.test").info("gpu_idle", gpu=0, job="digits")
    text = buf.getvalue()
    assert text.count("\n") == 1
    assert not ANSI.search(text)
    assert "gpu_idle" in text
    assert "gpu=0" in text
    assert "job=digits" in text
    assert "[gpuwatchd.test]" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_console_on_a_real_terminal_is_colored_and_auto_picks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    controller, terminal = os.openpty()
    with open(terminal, "w", encoding="utf-8", closefd=True) as tty:
        assert tty.isatty()
        configure_logging(stream=tty)  # json=None: auto
        get_logger("gpuwatchd.test").info("gpu_idle", gpu=3)
        tty.flush()
        output = os.read(controller, 65536).decode()
    os.close(controller)
    assert ANSI.search(output)  # colored
    plain = ANSI.sub("", output)
    assert "gpu_idle" in plain
    assert "gpu=3" in plain
    assert not plain.lstrip().startswith("{")


def test_auto_mode_picks_json_under_systemd_even_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller, terminal = os.openpty()
    try:
        with open(terminal, "w", encoding="utf-8", closefd=True) as tty:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
            monkeypatch.delenv("INVOCATION_ID", raising=False)
            assert not wants_json(tty)
            assert wants_json(tty, {"JOURNAL_STREAM": "8:12345"})
            assert wants_json(tty, {"INVOCATION_ID": "0b5c3f2e"})
            monkeypatch.setenv("INVOCATION_ID", "0b5c3f2e")
            assert wants_json(tty)
    finally:
        os.close(controller)
    assert wants_json(io.StringIO(), {})  # a pipe or a file: JSON


def test_auto_mode_on_a_pipe_writes_json() -> None:
    buf = io.StringIO()
    configure_logging(stream=buf)
    get_logger("gpuwatchd.test").info("ready")
    assert _json_lines(buf)[0]["event"] == "ready"


def test_configure_twice_is_idempotent_and_reaches_earlier_loggers() -> None:
    log = get_logger("gpuwatchd.test")  # obtained before any configuration
    first, second = io.StringIO(), io.StringIO()
    configure_logging(json=True, stream=first)
    log.info("one")
    configure_logging(json=True, stream=second)
    configure_logging(json=True, stream=second)
    log.info("two")
    assert [line["event"] for line in _json_lines(first)] == ["one"]
    assert [line["event"] for line in _json_lines(second)] == ["two"]  # exactly once
    marked = [h for h in logging.getLogger().handlers if getattr(h, "_gpuwatchd_handler", False)]
    assert len(marked) == 1


def test_default_stream_is_stdout_at_call_time_and_import_configures_nothing() -> None:
    code = (
        "import logging, gpuwatchd.logs, gpuwatchd.systemd\n"
        "assert not logging.getLogger().handlers, 'import configured logging'\n"
        "gpuwatchd.logs.configure_logging(json=True)\n"
        "gpuwatchd.logs.get_logger('gpuwatchd.x').info('hello', gpu=0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "INVOCATION_ID")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout)
    assert (line["event"], line["gpu"], line["logger"]) == ("hello", 0, "gpuwatchd.x")


# -- event names: one convention, and docs/logging.md lists every event -------------------

_REPO = Path(__file__).resolve().parent.parent
_EVENT_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
_LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical"}


def _logged_event_names(root: Path) -> dict[str, list[str]]:
    """Event name -> where it is logged (path:line), for every structlog-style call
    ``<something log>.<level>("name", ...)`` in the daemon's modules (not the hook,
    which logs sentences through the standard logging module inside the job)."""
    found: dict[str, list[str]] = {}
    for path in sorted((root / "gpuwatchd").rglob("*.py")):
        if "hook" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _LEVELS
                and "log" in ast.unparse(node.func.value).lower()
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                where = f"{path.relative_to(root)}:{node.lineno}"
                found.setdefault(node.args[0].value, []).append(where)
    return found


def _documented_events(doc: str) -> tuple[set[str], set[str]]:
    """(names in the first column, older names in the last column) of the events table."""
    names, older = set(), set()
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            names.add(cells[0].strip("`"))
            if cells[3]:
                older.add(cells[3].strip("`"))
    return names, older


def test_event_names_follow_the_convention_and_are_all_documented() -> None:
    logged = _logged_event_names(_REPO)
    assert "systemd.notify_failed" in logged and "daemon.start_failed" in logged
    names, older = _documented_events((_REPO / "docs" / "logging.md").read_text("utf-8"))
    assert all(_EVENT_NAME.fullmatch(n) for n in names), "docs/logging.md lists a bad name"
    bad = {n: w for n, w in logged.items() if not _EVENT_NAME.fullmatch(n) and n not in older}
    assert not bad, f"event names not of the form <area>.<what_happened>: {bad}"
    missing = {n: w for n, w in logged.items() if n not in names | older}
    assert not missing, f"events missing from docs/logging.md: {missing}"


def test_the_event_name_check_finds_bad_and_undocumented_names(tmp_path: Path) -> None:
    (tmp_path / "gpuwatchd" / "hook").mkdir(parents=True)
    (tmp_path / "gpuwatchd" / "m.py").write_text(
        'log.info("finding.cleared")\nself._log.warning("gpu degraded", gpu=0)\n'
        'print("not a log")\n',
        encoding="utf-8",
    )
    (tmp_path / "gpuwatchd" / "hook" / "h.py").write_text('logger.info("gpuwatchd: %s", 1)\n')
    assert _logged_event_names(tmp_path) == {
        "finding.cleared": ["gpuwatchd/m.py:1"],
        "gpu degraded": ["gpuwatchd/m.py:2"],
    }
    assert _documented_events("| `gpu.degraded` | error | daemon | `gpu degraded` |\n") == (
        {"gpu.degraded"},
        {"gpu degraded"},
    )
    assert not _EVENT_NAME.fullmatch("gpu degraded")
    assert not _EVENT_NAME.fullmatch("ready") and _EVENT_NAME.fullmatch("daemon.ready")
