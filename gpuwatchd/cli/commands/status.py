"""Show the daemon's state: GPUs, host, jobs and their knobs, policies, findings, decisions.

With --json, print the daemon's status object (documented in docs/cli.md); with --full,
each policy's whole definition in it too (else only the policies' names). The tables
ask for the brief status (each job with what they show, the last 10 decisions).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpuwatchd.cli.commands import Output, add_table_arguments
from gpuwatchd.cli.commands._format import ago, gpu_state, na, pct, size, sm_active_text
from gpuwatchd.cli.commands._table import print_table
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op
from gpuwatchd.units import format_duration

__all__ = [
    "GPU_COLUMNS",
    "JOB_COLUMNS",
    "add_arguments",
    "execute",
    "gpu_rows",
    "hold_line",
    "knobs_cell",
    "managed_table",
    "render",
    "slurm_label",
    "truncated_line",
]


GPU_COLUMNS = (
    "GPU",
    "name",
    "util",
    "memory used",
    "memory total",
    "mem %",
    "temp",
    "power",
    "procs",
    "state",
    "SM act",
)
"""The GPU table's columns (``status``, and its ``--format csv`` rows); ``SM act`` (GPM
SM activity, issue 22) comes last so scripts reading the older columns by position
keep working."""


JOB_COLUMNS = (
    "job",
    "pid",
    "knobs",
    "step",
    "data wait",
    "samples/s",
    "CPU",
    "RSS",
    "workers",
    "Slurm job",
)
"""The Jobs table's columns."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--format table|csv`` and ``--no-legend``: either prints the GPU table alone;
    ``--full``: ask for each policy's definition (``status`` param ``full``)."""
    add_table_arguments(parser)
    parser.add_argument(
        "--full",
        action="store_true",
        help="with each policy's definition in --json (as `policy show` gives them)",
    )


def gpu_rows(gpus: list[dict[str, Any]]) -> list[list[str]]:
    """One row of :data:`GPU_COLUMNS` per GPU of a ``status`` reply's ``gpus``."""
    return [
        [
            str(gpu["index"]),
            gpu["name"],
            pct(gpu["utilization_gpu_pct"]),
            size(gpu["memory_used_bytes"]),
            size(gpu["memory_total_bytes"]),
            pct(gpu["memory_used_pct"]),
            na(gpu["temperature_gpu_c"], "{:.0f} C"),
            na(gpu["power_draw_w"], "{:.0f} W"),
            str(len(gpu["processes"])),
            gpu_state(gpu),
            sm_active_text(gpu),
        ]
        for gpu in gpus
    ]


def slurm_label(slurm: dict[str, Any] | None) -> str:
    """A job's Slurm job as ``squeue`` names it (``<array>_<task>`` for an array task,
    else the job id; :meth:`gpuwatchd.model.SlurmJob.label`), ``-`` outside Slurm."""
    if not slurm:
        return "-"
    if slurm.get("array_job_id") is not None and slurm.get("array_task_id") is not None:
        return f"{slurm['array_job_id']}_{slurm['array_task_id']}"
    return str(slurm.get("job_id") or "-")


def knobs_cell(knobs: dict[str, Any]) -> str:
    """The knobs cell of ``status``/``jobs``: one ``name=value [min..max] from SOURCE,
    applied AGO`` line per knob of the daemon's ``knobs`` object, ``-`` when there is none."""
    parts = []
    for name, knob in sorted(knobs.items()):
        bounds = ""
        if knob.get("min") is not None or knob.get("max") is not None:
            bounds = f" [{na(knob.get('min'))}..{na(knob.get('max'))}]"
        source = f" from {knob['source']}" if knob.get("source") else ""
        applied = f", applied {ago(knob['applied_at_s'])}" if knob.get("applied_at_s") else ""
        parts.append(f"{name}={knob['value']}{bounds}{source}{applied}")
    return "\n".join(parts) or "-"


def _worker_state(worker: dict[str, Any]) -> str:
    state = str(worker["state"])
    colour = {"running": "green", "failed": "red", "backoff": "yellow", "stopped": "dim"}
    text = f"[{colour[state]}]{state}[/]" if state in colour else state
    if worker.get("adopted"):
        text += " (adopted)"
    if worker.get("note"):
        text += f": {worker['note']}"
    return text


def managed_table(managed: list[dict[str, Any]], *, placements: bool = False) -> Any:
    """A rich table of the managed workers (``status``/``jobs`` replies' ``managed``).

    One row per worker slot: job, slot, pid, GPU, state, restarts, last crash kind, trial;
    with ``placements``, also why the GPU was chosen.
    """
    from rich.table import Table

    table = Table(title="Managed workers", title_justify="left")
    columns = ["job", "worker", "pid", "GPU", "state", "restarts", "last crash", "trial"]
    if placements:
        columns.append("placement")
    for column in columns:
        table.add_column(column)
    for job in managed:
        for worker in job["workers"]:
            crash = worker.get("last_crash_kind")
            row = [
                f"{job['job']} ({job['parallelism']}/{job['workers_max']})",
                str(worker["worker"]),
                na(worker.get("pid")),
                na(worker.get("gpu")),
                _worker_state(worker),
                str(worker["restarts"]),
                crash if crash else "-",
                na(worker.get("trial_number")),
            ]
            if placements:
                row.append(worker.get("placement_reason") or "-")
            table.add_row(*row)
    return table


def hold_line(held: dict[str, Any]) -> str:
    """One operator hold of ``status``'s ``holds``: ``Operator override: job J knob
    num_workers=2 by uid 0 until 18:42:07 UTC (policies may not move it)``."""
    value = held["value"]
    shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
    until = time.strftime("%H:%M:%S UTC", time.gmtime(float(held["until_s"])))
    return (
        f"Operator override: job {held['job']} knob {held['knob']}={shown} by uid "
        f"{held['by_uid']} until {until} (policies may not move it)"
    )


def render(status: dict[str, Any], out: Output) -> None:
    """Print ``status`` (the daemon's reply) as tables."""
    console = out.console()
    flags = []
    if status.get("paused"):
        flags.append("[bold yellow]PAUSED (remediation off)[/]")
    if status.get("dry_run"):
        flags.append("[bold yellow]DRY RUN[/]")
    console.print(
        f"[bold]gpuwatchd {status['version']}[/]  pid {status['pid']}  "
        f"up {format_duration(status['uptime_s'])}  ticks {status['ticks']} "
        f"(last {status['last_tick_duration_s'] * 1000:.2f} ms, every {status['interval_s']:g}s)  "
        + "  ".join(flags)
    )
    gpus = status["gpus"]
    if not gpus:
        console.print(f"GPUs: {status['gpu_status']}")
    else:
        out.table(GPU_COLUMNS, gpu_rows(gpus), title=f"GPUs ({status['gpu_status']})")
    journal = status.get("journal") or {}
    if journal.get("error") or journal.get("failed_writes"):
        console.print(
            f"[red]Journal: {journal.get('failed_writes', 0)} failed writes[/] (decisions of "
            f"those ticks were not carried out); last error: {journal.get('error') or 'none since'}"
        )
    xids = status.get("xid_events") or []
    if xids:
        last = xids[-1]
        earlier = f" ({len(xids) - 1} earlier)" if len(xids) > 1 else ""
        console.print(
            f"[red]Xid {last['xid']} on GPU {last['gpu_index']}[/] {ago(last['timestamp_s'])}: "
            f"{last['description']}{earlier}"
        )
    for cordon in status.get("cordons") or []:
        reason = cordon.get("reason") or ""
        console.print(
            f"[bold red]GPU {cordon['index']} cordoned[/] {ago(cordon['since_s'])} by "
            f"{cordon['by']}" + (f": {reason}" if reason else "") + " (no new placement)"
        )
    host = status["host"]
    if host:
        console.print(
            f"Host: CPU {host['cpu_pct']:.1f} % of {host['cpu_count']} CPUs, memory "
            f"{size(host['memory_used_bytes'])} / {size(host['memory_total_bytes'])} "
            f"({host['memory_used_pct']:.1f} %)"
        )
    jobs = status["jobs"]
    if jobs:
        rows = []
        for job in jobs:
            report = job.get("last_report") or {}
            proc = job.get("process") or {}
            rows.append(
                [
                    job["name"],
                    str(job["pid"]),
                    knobs_cell(job["knobs"]),
                    na(report.get("step_time_s") and report["step_time_s"] * 1000, "{:.1f} ms"),
                    na(report.get("data_wait_fraction"), "{:.0%}"),
                    na(report.get("samples_per_s"), "{:.0f}"),
                    na(proc.get("cpu_pct"), "{:.0f} %"),
                    size(proc.get("rss_bytes")),
                    na(proc.get("num_worker_children")),
                    slurm_label(job.get("slurm")),
                ]
            )
        print_table(console, "Jobs", JOB_COLUMNS, rows)
    else:
        console.print("Jobs: none attached")
    if status.get("managed"):
        console.print(managed_table(status["managed"]))
    policies = status["policies"]
    names = ", ".join(p["name"] for p in policies.get("policies", [])) or "none"
    console.print(f"Policies ({', '.join(policies.get('sources', []))}): {names}")
    for held in status.get("holds") or []:
        console.print(hold_line(held), markup=False, highlight=False)
    if status["findings"]:
        rows = [
            [f["detector"], f["subject"], ago(f["since_s"]), f["message"]]
            for f in status["findings"]
        ]
        print_table(console, "Findings", ("detector", "subject", "since", "message"), rows)
    if status["decisions"]:
        rows = []
        for decision in status["decisions"][-10:]:
            params = ", ".join(f"{k}={v}" for k, v in decision["params"].items())
            outcome = decision["outcome"] + (
                f": {decision['detail']}" if decision["detail"] else ""
            )
            rows.append(
                [
                    ago(decision["timestamp_s"]),
                    decision["policy"],
                    decision["action"],
                    decision["job"] or "-",
                    params,
                    outcome,
                ]
            )
        columns = ("when", "policy", "action", "job", "params", "outcome")
        print_table(console, "Recent decisions", columns, rows)
    left_out = truncated_line(status.get("truncated"))
    if left_out:
        console.print(f"[yellow]{left_out}[/]")


def truncated_line(truncated: dict[str, Any] | None) -> str | None:
    """What a ``status`` reply left out to fit one line (its ``truncated`` counts but
    ``policies``, whose names stay), as ``Not shown (the reply fits one 64 KiB line):
    jobs 3, findings 12``; None when nothing was left out."""
    parts = [
        f"{name} {count}"
        for name, count in (truncated or {}).items()
        if isinstance(count, int) and count > 0 and name != "policies"
    ]
    if not parts:
        return None
    return "Not shown (the reply fits one 64 KiB line): " + ", ".join(parts)


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Ask the daemon for ``status`` (``brief`` for the tables: they show less than
    ``--json``) and print it."""
    if out.json_mode or args.full:
        status = client.call(Op.STATUS, full=args.full)
    else:
        status = client.call(Op.STATUS, brief=True)
    if out.json_mode:
        out.json(status)
    elif out.csv or not out.legend:
        out.table(GPU_COLUMNS, gpu_rows(status["gpus"]))
    else:
        render(status, out)
    return 0
