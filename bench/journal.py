"""Benchmark the action journal's cost per daemon tick (SQLite WAL, synchronous=NORMAL).

Three scenarios on 8 fake GPUs, each N ticks (default 1000) of a real Daemon with its
journal open in a temp directory (a real file on this machine's disk):

* quiet:    default policies at 55 % utilization: nothing starts, clears or decides,
            so the journal writes nothing (the common case);
* deciding: 8 idle GPUs and a ``log`` policy without cooldown: one decision (and its
            outcome) journaled every tick, one transaction per tick;
* flapping: utilization alternating 3 % / 90 %: a finding starts or clears on all 8
            GPUs every tick, and decides when it starts.

Prints median and p90 microseconds per tick, and the same ticks without a journal for
comparison. The daemon's log lines (findings, decisions) are written as JSON, as under
systemd, to /dev/null. Target (issue 2/3): median <= 2000 us per tick.

    python bench/journal.py [--ticks 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpuwatchd.config import Settings
from gpuwatchd.daemon import Daemon
from gpuwatchd.logs import configure_logging
from gpuwatchd.testing import FakeClock, FakeNvml, install_fake_nvml

DECIDING = """\
policies:
  - name: idle-log
    when:
      low_utilization: {percent: 20, for: 0s}
    do:
      - log: {message: "GPU idle"}
"""


def run(
    ticks: int, utilization: list[float], policies: str | None, journal: bool
) -> tuple[float, float, int]:
    """(median us, p90 us, events written) over ``ticks`` ticks."""
    with tempfile.TemporaryDirectory() as tmp:
        paths: tuple[str, ...] = ()
        if policies is not None:
            policy_file = Path(tmp) / "policies.yaml"
            policy_file.write_text(policies)
            paths = (str(policy_file),)
        clock = FakeClock()
        fake = FakeNvml.h100s(8, utilization_pct=utilization, memory_used_bytes=40 * 2**30)
        with install_fake_nvml(fake):
            daemon = Daemon(
                Settings(devices="nvml", state_dir=tmp, policies=paths, interval_s=1.0),
                clock=clock,
            )
            daemon.open_samplers()
            if journal:
                daemon.open_journal()
            durations = []
            for _ in range(ticks):
                clock.advance(1.0)
                started = time.perf_counter()
                daemon.tick()
                durations.append(time.perf_counter() - started)
            written = 0
            if journal:
                written = int(daemon.events({})["last_id"])  # ids count from 1
                daemon.close_journal()
    us = sorted(d * 1e6 for d in durations)
    return statistics.median(us), us[int(0.9 * len(us))], written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=1000)
    args = parser.parse_args()
    devnull = open(os.devnull, "w")  # noqa: SIM115 - open for the whole run
    configure_logging(json=True, level="info", stream=devnull)
    scenarios = {
        "quiet": ([55.0], None),
        "deciding": ([3.0], DECIDING),
        "flapping": ([3.0, 90.0] * (args.ticks // 2 + 1), DECIDING),
    }
    ok = True
    print(f"journal: 8 fake GPUs, {args.ticks} ticks per scenario")
    for name, (utilization, policies) in scenarios.items():
        base, base90, _ = run(args.ticks, utilization, policies, journal=False)
        median, p90, written = run(args.ticks, utilization, policies, journal=True)
        ok = ok and median <= 2000
        print(
            f"  {name:9s} with journal: median {median:5.0f} us, p90 {p90:5.0f} us"
            f" ({written} events) | without: median"
            f" {base:5.0f} us, p90 {base90:5.0f} us"
        )
    print("  result: " + ("within target (median <= 2000 us)" if ok else "OUTSIDE TARGET"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
