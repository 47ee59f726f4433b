"""List the jobs attached through the hook (knobs, latest report) and the managed workers
(pid, GPU placement and why, state, restarts, last crash kind, trial)."""

from __future__ import annotations

import argparse

from gpuwatchd.cli.commands import Output
from gpuwatchd.cli.commands._format import na
from gpuwatchd.cli.commands.status import _knobs, managed_table
from gpuwatchd.control.client import ControlClient

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``jobs`` takes no arguments."""


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``jobs`` and print the managed workers, then one row per attached job."""
    from rich.table import Table

    result = client.call("jobs")
    if out.json_mode:
        out.json(result)
        return 0
    console = out.console()
    managed = result.get("managed") or []
    if managed:
        console.print(managed_table(managed, placements=True))
    if not result["jobs"]:
        console.print("no jobs attached")
        return 0
    table = Table(title="Attached jobs" if managed else None, title_justify="left")
    for column in ("job", "pid", "CUDA devices", "trial", "knobs", "steps", "epoch"):
        table.add_column(column)
    for job in result["jobs"]:
        report = job.get("last_report") or {}
        table.add_row(
            job["name"],
            str(job["pid"]),
            ",".join(job["cuda_devices"]) or "-",
            na(job.get("trial_number")),
            _knobs(job["knobs"]),
            na(report.get("steps")),
            na(report.get("epoch")),
        )
    console.print(table)
    return 0
