"""Show the action journal: findings started/cleared, decisions and their outcomes.

    gpuwatchctl events                 the latest 100 events (-n N for another number)
    gpuwatchctl events --since 10m     every event of the last 10 minutes
    gpuwatchctl events --follow        then print new events as they come, until Ctrl-C
    gpuwatchctl events --json          one JSON object per line (docs/journal.md)
    gpuwatchctl events --plot F.png    draw them: one panel per GPU (docs/plots.md)

Times are local. --follow polls the daemon every second and carries on from where it
was if the daemon restarts (journal ids persist).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Final, TextIO

from gpuwatchd.cli.commands import Output
from gpuwatchd.cli.errors import stdout_to_devnull
from gpuwatchd.control.client import UNAVAILABLE, ControlClient
from gpuwatchd.control.protocol import Op
from gpuwatchd.errors import ControlError, GpuwatchError
from gpuwatchd.policy import action_names
from gpuwatchd.units import parse_duration

__all__ = ["add_arguments", "execute", "format_event", "parse_since"]

POLL_INTERVAL_S: Final = 1.0
"""How often --follow asks the daemon for new events."""
PAGE: Final = 1000
"""Events asked for per request when paging (the daemon's maximum)."""
_WIDTHS: Final = (19, 15, 24, 16)
_HEADER: Final = ("TIME", "KIND", "POLICY/DETECTOR", "SUBJECT/JOB", "DETAILS/OUTCOME")


def parse_since(text: str) -> float:
    """``--since`` value: a duration (``10m``, ``1h``, ``30s``, ``90`` seconds) -> seconds."""
    try:
        seconds = parse_duration(text)
    except GpuwatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return seconds


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= PAGE:
        raise argparse.ArgumentTypeError(f"must be between 1 and {PAGE}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``events [--follow] [--since DURATION] [-n N] [--json]``."""
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C"
    )
    parser.add_argument(
        "--since",
        type=parse_since,
        metavar="DURATION",
        help="events of the last DURATION, e.g. 10m, 2h, 1d (default: the latest -n events)",
    )
    parser.add_argument(
        "-n",
        "--lines",
        type=_positive,
        default=100,
        metavar="N",
        help="without --since: how many of the latest events to show (default 100)",
    )
    parser.add_argument(
        "--json",
        dest="json_lines",
        action="store_true",
        help="one JSON object per line (same as gpuwatchctl --json events)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the events (default --since 1h) to FILE.png/.svg/.html: finding spans and "
        "decisions, one panel per GPU (the 'plot' extra)",
    )


def _plot(client: ControlClient, args: argparse.Namespace) -> int:
    from gpuwatchd.plot import check_output, from_journal, render

    try:
        check_output(args.plot)
    except GpuwatchError as exc:
        print(f"gpuwatchctl: {exc}", file=sys.stderr)
        return 1
    gpu_count = len(client.call(Op.STATUS).get("gpus") or [])
    since_s = 3600.0 if args.since is None else args.since
    now = time.time()
    events: list[dict[str, Any]] = []
    last_id: int | None = None
    while True:  # page through (the daemon sends at most PAGE events a call)
        params: dict[str, Any] = {"limit": PAGE}
        if last_id is None:
            params["since_s"] = now - since_s
        else:
            params["after_id"] = last_id
        reply = client.call(Op.EVENTS, **params)
        events.extend(reply["events"])
        last_id = int(reply["last_id"])
        if not reply.get("more"):
            break
    try:
        render(from_journal(events, gpu_count, now), args.plot)
    except GpuwatchError as exc:
        print(f"gpuwatchctl: {exc}", file=sys.stderr)
        return 1
    print(f"{len(events)} events drawn to {args.plot}", file=sys.stderr)
    return 0


def _local_time(time_s: object) -> str:
    if not isinstance(time_s, (int, float)):
        return "-"
    return datetime.fromtimestamp(float(time_s)).strftime("%Y-%m-%d %H:%M:%S")


def _value(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def _where(event: dict[str, Any]) -> str:
    """The subject for people: ``GPU 1``, the job's name, or ``host``."""
    if event.get("job"):
        return str(event["job"])
    if event.get("gpu_index") is not None:
        return f"GPU {event['gpu_index']}"
    subject = event.get("subject") or event.get("gpu_uuid") or "-"
    return str(subject).removeprefix("job:")


def _columns(event: dict[str, Any]) -> tuple[str, str, str, str, str]:
    kind = str(event.get("kind", "?"))
    when = _local_time(event.get("time_s"))
    if kind.startswith("finding_"):
        name = str(event.get("detector") or "-")
        if kind == "finding_started":
            detail = str(event.get("message") or "")
        else:
            why = event.get("clear_reason")
            detail = "daemon stopped" if why == "stopped" else "condition no longer holds"
        return when, kind.replace("_", " "), name, _where(event), detail
    policy = str(event.get("policy") or "-")
    action = event.get("action") or "?"
    ref = f"#{event.get('decision_id')} "
    if kind == "decision":
        params = event.get("params") or {}
        if action == action_names.LOG:
            text = f"log {params.get('level', 'info')}: {params.get('message', '')}"
        else:
            shown = ", ".join(
                f"{k}={_value(v)}" for k, v in params.items() if k not in ("job", "subjects")
            )
            text = f"{action}({shown})"
        if event.get("dry_run"):
            text += " [dry-run]"
        return when, "decision", policy, _where(event), ref + text
    outcome = str(event.get("outcome") or "?")
    detail = event.get("detail") or ""
    text = f"{action} {outcome}" if action != action_names.LOG else outcome
    return when, kind, policy, _where(event), ref + text + (f": {detail}" if detail else "")


def format_event(event: dict[str, Any]) -> str:
    """One table row for ``event`` (an element of the daemon's ``events`` reply)."""
    cells = _columns(event)
    fixed = [
        c.ljust(w) if len(c) <= w else c[: w - 1] + "…"
        for c, w in zip(cells, _WIDTHS, strict=False)
    ]
    return "  ".join([*fixed, cells[-1]]).rstrip()


def _header() -> str:
    fixed = [h.ljust(w) for h, w in zip(_HEADER, _WIDTHS, strict=False)]
    return "  ".join([*fixed, _HEADER[-1]])


class _Printer:
    def __init__(self, stream: TextIO, json_lines: bool) -> None:
        self.stream = stream
        self.json_lines = json_lines
        self.header_done = json_lines
        self.printed = 0

    def print(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            self.printed += 1
            if not self.header_done:
                self.stream.write(_header() + "\n")
                self.header_done = True
            if self.json_lines:
                line = json.dumps(event, sort_keys=True, separators=(",", ":"))
            else:
                line = format_event(event)
            self.stream.write(line + "\n")
        self.stream.flush()


def _page_forward(
    client: ControlClient, printer: _Printer, after_id: int | None, since_s: float | None
) -> int:
    """Print every event after ``after_id``/since ``since_s``; return the last id."""
    params: dict[str, Any] = {"limit": PAGE}
    if since_s is not None:
        params["since_s"] = since_s
    if after_id is not None:
        params["after_id"] = after_id
    while True:
        reply = client.call(Op.EVENTS, **params)
        printer.print(reply["events"])
        last_id = int(reply["last_id"])
        if not reply.get("more"):
            return last_id
        params["after_id"] = last_id


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Print the journal's events; with ``--follow`` poll for new ones until SIGINT (exit 0)."""
    if args.plot is not None:
        return _plot(client, args)
    printer = _Printer(out.stream, out.json_mode or args.json_lines)
    try:
        if args.since is not None:
            last_id = _page_forward(client, printer, None, time.time() - args.since)
        else:
            reply = client.call(Op.EVENTS, limit=args.lines)
            printer.print(reply["events"])
            last_id = int(reply["last_id"])
        if not printer.printed and not args.follow:
            print("no events", file=sys.stderr)
        if not args.follow:
            return 0
        # Explicit, because Python installs no SIGINT handler when it starts with SIGINT
        # ignored (a background job of a non-interactive shell): Ctrl-C and SIGTERM both
        # end --follow cleanly.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _interrupt)
        warned = False
        while True:
            time.sleep(POLL_INTERVAL_S)
            try:
                last_id = _page_forward(client, printer, last_id, None)
            except ControlError as exc:
                if exc.code != UNAVAILABLE:
                    raise
                if not warned:  # the daemon restarts: keep the cursor, try again
                    print(f"gpuwatchctl: {exc.message}; retrying", file=sys.stderr)
                    warned = True
                continue
            warned = False
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # e.g. `gpuwatchctl events --follow | head`
        stdout_to_devnull()
        return 0
