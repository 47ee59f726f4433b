"""Live view of the daemon, like nvitop's monitor: GPUs, jobs, findings, decisions.

GPUs with utilization and memory bars and a short utilization history; jobs with step
time, data wait and knobs; open findings; the last decisions. One ``status`` request per
refresh. Keys (in a terminal): p pause remediation, r resume it (admin), q quit.
Without a terminal (or with --once) it prints plain-text snapshots instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from gpuwatchd.cli.commands import Output
from gpuwatchd.cli.commands._format import ago, gpu_state, na, pct, size, sm_active_text
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op
from gpuwatchd.errors import ControlError
from gpuwatchd.units import format_duration

__all__ = ["HISTORY_LEN", "History", "add_arguments", "execute", "sparkline", "view"]

HISTORY_LEN = 30
"""Refreshes of utilization history kept per GPU (30 s at the default 1 s interval)."""
_SPARKS = "▁▂▃▄▅▆▇█"
_MAX_JOB_ROWS = 64
_MAX_FINDING_ROWS = 8
_MAX_DECISION_ROWS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``top [--interval SECONDS] [--once]``."""
    parser.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="SECONDS",
        help="refresh interval (default 1; 0.1 to 3600)",
    )
    parser.add_argument(
        "--once", action="store_true", help="print one plain-text snapshot and exit"
    )


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.1 and 3600 seconds")
    return value


def sparkline(values: list[float | None], *, top: float = 100.0) -> str:
    """One block character per value in ``[0, top]`` (``None``: a space); e.g. ``▁▃█``."""
    out = []
    for value in values:
        if value is None:
            out.append(" ")
            continue
        level = min(max(value / top, 0.0), 1.0)
        out.append(_SPARKS[min(int(level * len(_SPARKS)), len(_SPARKS) - 1)])
    return "".join(out)


class History:
    """Utilization (%) of each GPU over the last :data:`HISTORY_LEN` refreshes."""

    def __init__(self, length: int = HISTORY_LEN) -> None:
        self.length = length
        self._gpus: dict[int, deque[float | None]] = {}

    def add(self, status: dict[str, Any]) -> None:
        """Record one ``status`` reply's GPU utilizations."""
        for gpu in status.get("gpus") or []:
            series = self._gpus.setdefault(int(gpu["index"]), deque(maxlen=self.length))
            series.append(gpu.get("utilization_gpu_pct"))

    def of(self, index: int) -> list[float | None]:
        """The history of GPU ``index``, oldest first (empty when never seen)."""
        return list(self._gpus.get(index, ()))


def _bar(value: object, width: int = 20) -> Any:
    """A bar of ``value`` percent (``█`` blocks, empty when N/A), green/yellow/red."""
    from rich.bar import Bar

    level = 0.0 if value is None else min(max(float(value), 0.0), 100.0)  # type: ignore[arg-type]
    colour = "green" if level < 70 else "yellow" if level < 90 else "red"
    return Bar(size=100.0, begin=0.0, end=level, width=width, color=colour, bgcolor="grey23")


def _header(status: dict[str, Any], note: str) -> str:
    flags = []
    if status.get("paused"):
        flags.append("[bold yellow]PAUSED (remediation off)[/]")
    if status.get("dry_run"):
        flags.append("[bold yellow]DRY RUN[/]")
    host = status.get("host") or {}
    host_text = (
        f"  host CPU {host['cpu_pct']:.0f} %  mem {host['memory_used_pct']:.0f} %" if host else ""
    )
    line = (
        f"[bold]gpuwatchd {status['version']}[/]  up {format_duration(status['uptime_s'])}  "
        f"ticks {status['ticks']}  {time.strftime('%H:%M:%S')}{host_text}  " + "  ".join(flags)
    )
    if note:
        line += f"\n{note}"
    return line


def _gpu_table(status: dict[str, Any], history: History) -> Any:
    from rich.table import Table

    table = Table(title=f"GPUs ({status['gpu_status']})", title_justify="left", expand=False)
    for column in (
        "GPU", "name", "util", "", "SM act", "memory", "", "temp", "power", "history", "state"
    ):  # fmt: skip
        table.add_column(column, no_wrap=True)
    for gpu in status["gpus"]:
        used = gpu.get("memory_used_bytes")
        total = gpu.get("memory_total_bytes")
        memory = f"{size(used)} / {size(total)}"
        table.add_row(
            f"GPU {gpu['index']}",
            str(gpu["name"])[:24],
            pct(gpu.get("utilization_gpu_pct")),
            _bar(gpu.get("utilization_gpu_pct")),
            sm_active_text(gpu),
            memory,
            _bar(gpu.get("memory_used_pct")),
            na(gpu.get("temperature_gpu_c"), "{:.0f} C"),
            na(gpu.get("power_draw_w"), "{:.0f} W"),
            sparkline(history.of(int(gpu["index"]))),
            gpu_state(gpu),
        )
    return table


def _knob_text(knobs: dict[str, Any]) -> str:
    return " ".join(f"{name}={knob['value']}" for name, knob in sorted(knobs.items())) or "-"


def _job_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    jobs = status.get("jobs") or []
    table = Table(title=f"Jobs ({len(jobs)})", title_justify="left")
    for column in (
        "job",
        "pid",
        "CUDA devices",
        "trial",
        "step",
        "data wait",
        "samples/s",
        "knobs",
    ):
        table.add_column(column, no_wrap=True)
    for job in jobs[:_MAX_JOB_ROWS]:
        report = job.get("last_report") or {}
        step = report.get("step_time_s")
        trial = job.get("trial_number")
        table.add_row(
            str(job["name"]),
            str(job["pid"]),
            ",".join(str(d) for d in job.get("cuda_devices") or ()) or "-",
            "-" if trial is None else f"{job.get('study') or ''}#{trial}",
            na(step and step * 1000, "{:.1f} ms"),
            na(report.get("data_wait_fraction"), "{:.0%}"),
            na(report.get("samples_per_s"), "{:.0f}"),
            _knob_text(job.get("knobs") or {}),
        )
    if len(jobs) > _MAX_JOB_ROWS:
        table.caption = f"{len(jobs) - _MAX_JOB_ROWS} more jobs not shown"
    return table


def _finding_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    findings = status.get("findings") or []
    table = Table(title=f"Open findings ({len(findings)})", title_justify="left")
    for column in ("detector", "subject", "since", "message"):
        table.add_column(column)
    for finding in findings[:_MAX_FINDING_ROWS]:
        table.add_row(
            f"[yellow]{finding['detector']}[/]",
            str(finding["subject"]),
            ago(finding.get("since_s")),
            str(finding.get("message", "")),
        )
    return table


def _decision_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    decisions = status.get("decisions") or []
    table = Table(title="Last decisions", title_justify="left")
    for column in ("when", "policy", "action", "job", "outcome"):
        table.add_column(column)
    for decision in decisions[-_MAX_DECISION_ROWS:]:
        outcome = str(decision["outcome"])
        if decision.get("detail"):
            outcome += f": {decision['detail']}"
        table.add_row(
            ago(decision.get("timestamp_s")),
            str(decision["policy"]),
            str(decision["action"]),
            str(decision.get("job") or "-"),
            outcome,
        )
    return table


def view(status: dict[str, Any], history: History, note: str = "", keys: bool = True) -> Any:
    """The whole screen for one ``status`` reply: a :class:`rich.console.Group`."""
    from rich.console import Group

    parts: list[Any] = [_header(status, note)]
    if status.get("gpus"):
        parts.append(_gpu_table(status, history))
    else:
        parts.append(f"GPUs: {status.get('gpu_status')}")
    parts.append(_job_table(status))
    parts.append(_finding_table(status))
    parts.append(_decision_table(status))
    if keys:
        parts.append("[dim]keys: p pause remediation  r resume  q quit[/]")
    return Group(*parts)


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Keys without Enter and without echo, restored on exit."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _read_key(fd: int, timeout_s: float) -> str | None:
    """One key typed within ``timeout_s`` seconds, or None."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
    if not ready:
        return None
    data = os.read(fd, 32)
    if not data:
        return "q"  # the terminal went away
    return data.decode(errors="replace")[-1:].lower()


def _remediation(client: ControlClient, op: str) -> str:
    """Send ``pause``/``resume``; the note shown under the header (the refusal if any)."""
    try:
        result = client.call(op)
    except ControlError as exc:
        if exc.code == "unavailable":
            raise
        return f"[red]{op} refused: {exc.code}: {exc.message}[/]"
    return "remediation paused" if result.get("paused") else "remediation resumed"


def _plain(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    from rich.console import Console

    history = History()
    console = Console(
        file=out.stream,
        highlight=False,
        soft_wrap=False,
        force_terminal=False,
        no_color=True,
        width=int(os.environ.get("COLUMNS", "160")),
    )
    while True:
        status = client.call(Op.STATUS, brief=True)
        history.add(status)
        console.print(view(status, history, keys=False))
        out.stream.flush()
        if args.once:
            return 0
        time.sleep(args.interval)


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Refresh every ``--interval`` seconds until q (or Ctrl-C); plain text without a TTY."""
    if out.json_mode:
        out.json(client.call(Op.STATUS))
        return 0
    stdin_tty = sys.stdin.isatty()
    if args.once or not (stdin_tty and out.stream.isatty()):
        try:
            return _plain(client, args, out)
        except KeyboardInterrupt:
            return 0
    from rich.console import Console
    from rich.live import Live

    console = Console(file=out.stream, highlight=False)
    history = History()
    fd = sys.stdin.fileno()
    note = ""
    try:
        with _cbreak(fd), Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                status = client.call(Op.STATUS, brief=True)
                history.add(status)
                live.update(view(status, history, note), refresh=True)
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    key = _read_key(fd, left)
                    if key == "q":
                        return 0
                    if key in ("p", "r"):
                        note = _remediation(client, Op.PAUSE if key == "p" else Op.RESUME)
                        break
    except KeyboardInterrupt:
        return 0
