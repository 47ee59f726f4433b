"""List the jobs attached through the hook (knobs, latest report) and the managed workers
(pid, GPU placement and why, state, restarts, last crash kind, trial)."""

from __future__ import annotations

import argparse

from gpuwatchd.cli.commands import Output, add_table_arguments
from gpuwatchd.cli.commands._format import na
from gpuwatchd.cli.commands.status import knobs_cell, managed_table, slurm_label
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--format table|csv`` and ``--no-legend``; with ``csv`` only the attached jobs."""
    add_table_arguments(parser)


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``jobs`` and print the managed workers, then one row per attached job
    (with ``--format csv``: the attached jobs only, one CSV row each)."""
    result = client.call(Op.JOBS)
    if out.json_mode:
        out.json(result)
        return 0
    managed = result.get("managed") or []
    if not out.csv:
        console = out.console()
        if managed:
            console.print(managed_table(managed, placements=True))
        if not result["jobs"] and out.legend:
            console.print("no jobs attached")
            return 0
    rows = []
    for job in result["jobs"]:
        report = job.get("last_report") or {}
        rows.append(
            [
                job["name"],
                str(job["pid"]),
                ",".join(job["cuda_devices"]) or "-",
                na(job.get("trial_number")),
                knobs_cell(job["knobs"]),
                na(report.get("steps")),
                na(report.get("epoch")),
                slurm_label(job.get("slurm")),
            ]
        )
    out.table(
        ("job", "pid", "CUDA devices", "trial", "knobs", "steps", "epoch", "Slurm job"),
        rows,
        title="Attached jobs" if managed else None,
    )
    return 0
