"""Show an Optuna study's trials by state, durations, pruning, retries and throughput.

Reads the Optuna storage directly (an SQLite or PostgreSQL URL, or Optuna's JournalStorage:
journal:///path/optuna.log or redis://host:port/db); no daemon is needed.
--storage defaults to $OPTUNA_STORAGE (as Optuna's own CLI); without --study, every
study in the storage is shown. With --json, print the stable object documented in
docs/studies.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Final

from gpuwatchd.cli.commands import Output, add_table_arguments
from gpuwatchd.control.client import ControlClient
from gpuwatchd.errors import StudyError
from gpuwatchd.units import format_duration

__all__ = ["NEEDS_DAEMON", "SCRIPT_COLUMNS", "add_arguments", "execute", "render"]

NEEDS_DAEMON = False
"""``gpuwatchctl`` runs this command without connecting to the control socket."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--storage SPEC``, ``--study NAME``, ``--format table|csv``, ``--no-legend`` and a
    local ``--json`` (same as the global one)."""
    parser.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help=(
            "Optuna storage URL, e.g. sqlite:////srv/hpo/optuna.db, or a JournalStorage: "
            "journal:///srv/hpo/optuna.log, redis://HOST:6379/0 (default $OPTUNA_STORAGE)"
        ),
    )
    parser.add_argument("--study", default=None, metavar="NAME", help="one study (default: all)")
    # SUPPRESS keeps the global `gpuwatchctl --json study` working: the sub-parser only
    # sets `json` when the flag is given after the command.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    add_table_arguments(parser)


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _duration(value: Any) -> str:
    return "-" if value is None else format_duration(float(value))


SCRIPT_COLUMNS: Final = ("study", "state", "trials", "percent", "mean_duration_s")
"""Columns of ``--format csv`` and ``--no-legend``: one row per study and TrialState."""


def _script_rows(stats: dict[str, Any]) -> list[list[str]]:
    return [
        [
            study["study"],
            state,
            str(row["count"]),
            _num(row["pct"]),
            _num(row["mean_duration_s"], "{:.3f}"),
        ]
        for study in stats["studies"]
        for state, row in study["states"].items()
    ]


def render(stats: dict[str, Any], out: Output) -> None:
    """Print :func:`gpuwatchd.jobs.study.study_stats`'s dict as one table per study; with
    ``--format csv`` or ``--no-legend``, one table of :data:`SCRIPT_COLUMNS` rows instead
    (durations in seconds, "-" for none), without titles and summary lines."""
    from rich.table import Table

    if out.csv or not out.legend:
        out.table(SCRIPT_COLUMNS, _script_rows(stats))
        return
    console = out.console()
    if not stats["studies"]:
        console.print(f"no studies in {stats['storage']}")
        return
    for study in stats["studies"]:
        best = ""
        if study["best_value"] is not None:
            best = f", best value {study['best_value']:.6g} (trial {study['best_trial']})"
        console.print(
            f"[bold]study {study['study']}[/] ({', '.join(study['directions'])}): "
            f"{study['trials']} trials{best}"
        )
        table = Table()
        for column in ("state", "trials", "%", "mean duration"):
            table.add_column(column, justify="left" if column == "state" else "right")
        for state, row in study["states"].items():
            table.add_row(
                state, str(row["count"]), _num(row["pct"]), _duration(row["mean_duration_s"])
            )
        console.print(table)
        retries = study["retries"]
        rate = study["trials_per_hour"]
        console.print(
            f"pruned: {_num(study['pruned_pct'])} % of COMPLETE+PRUNED  "
            f"retries: {retries['retry_trials']} "
            f"for {retries['retried_trials']} trial(s){_makers(retries)}, "
            f"longest chain {retries['max_retry']}  "
            f"trials/hour: {_num(rate['overall'])} overall, {rate['last_hour']} in the last hour"
        )


def _makers(retries: dict[str, Any]) -> str:
    """`` (gpuwatchd 2, Optuna 1)``: who made the retries; empty without any."""
    made_by = retries.get("made_by") or {}
    if not retries["retry_trials"]:
        return ""
    return f" (gpuwatchd {made_by.get('gpuwatchd', 0)}, Optuna {made_by.get('optuna', 0)})"


def _error(out: Output, code: str, message: str, status: int = 1) -> int:
    if out.json_mode:
        out.json({"error": {"code": code, "message": message}})
    else:
        print(f"gpuwatchctl study: {message}", file=sys.stderr)
    return status


def execute(client: ControlClient | None, args: argparse.Namespace, out: Output) -> int:
    """Read the storage and print its statistics; 0, or 1 (message on stderr) on a bad storage."""
    try:  # the 'optuna' extra brings Optuna and its SQLAlchemy
        import optuna  # noqa: F401
        import sqlalchemy  # noqa: F401
    except ImportError as exc:
        return _error(
            out,
            "missing_extra",
            f"needs the 'optuna' extra ({exc.name} is not installed): "
            "pip install 'gpuwatchd[optuna]'",
        )
    from gpuwatchd.jobs.study import study_stats

    storage = args.storage or os.environ.get("OPTUNA_STORAGE")
    if not storage:
        return _error(out, "usage", "give --storage URL (or set OPTUNA_STORAGE)", status=2)
    try:
        stats = study_stats(storage, args.study)
    except StudyError as exc:
        return _error(out, "storage", str(exc))
    if out.json_mode:
        out.json(stats)
    else:
        render(stats, out)
    return 0
