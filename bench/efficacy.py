"""Does acting help? ``examples/train_digits.py`` for ``--seconds`` each, one run after
the other on this machine: ``num_workers`` fixed at 8, 0, 1, 2 and 4 with no daemon, and
starting from 8 and from 0 under a real ``gpuwatchd run`` with the default policies
(``tune_loader``: docs/tuning.md).

Prints epochs per run, the ``num_workers`` each run went through, and the managed runs'
epochs as a share of the best fixed setting's (issue 14's acceptance: >= 90 % from both
8 and 0 workers on a 2-core host).

    python bench/efficacy.py [--seconds 60] [--views 2] [--fixed 8,0,1,2,4] [--repeat 1]

Everything shares this machine's CPUs: on a host loaded by other work the figures move
with that load, so compare ratios from one invocation, never across invocations, and
use ``--repeat`` (medians) on a busy host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_digits.py"
POLICIES = REPO / "policies" / "default.yaml"
_EPOCH = re.compile(r"^epoch=(\d+) num_workers=(\d+)", re.MULTILINE)


def _train(workers: int, seconds: float, views: int, env: dict[str, str]) -> tuple[int, list[int]]:
    """Run the job; return (epochs completed, the num_workers sequence it went through)."""
    out = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            "--job",
            "digits",
            "--num-workers",
            str(workers),
            "--views",
            str(views),
            "--duration-s",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    epochs = _EPOCH.findall(out)
    path: list[int] = []
    for _, value in epochs:
        if not path or path[-1] != int(value):
            path.append(int(value))
    return len(epochs), path


def _managed(workers: int, seconds: float, views: int) -> tuple[int, list[int], list[str]]:
    """The same job under a fresh ``gpuwatchd run`` with the default policies."""
    with tempfile.TemporaryDirectory(prefix="gw-efficacy-") as tmp:
        socket = Path(tmp) / "control.sock"
        env = dict(os.environ, GPUWATCHD_SOCKET=str(socket))
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "run",
                "--devices",
                "none",
                "--policies",
                str(POLICIES),
                "--socket",
                str(socket),
                "--state-dir",
                str(Path(tmp) / "state"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            deadline = time.monotonic() + 30
            while not socket.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            started_s = time.time()
            epochs, path = _train(workers, seconds, views, env)
            ctl = Path(sys.executable).parent / "gpuwatchctl"
            listed = subprocess.run(
                [str(ctl), "--socket", str(socket), "events", "--json", "--since", "1h"],
                capture_output=True,
                text=True,
                env=env,
            ).stdout
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    steps = []
    for line in listed.splitlines():
        event = json.loads(line)
        if event.get("kind") == "decision" and event.get("action") == "tune_loader":
            p = event["params"]
            steps.append(
                f"+{event['time_s'] - started_s:4.1f} s {p['knob']} "
                f"{p['previous']}->{p['value']} {p['verdict']} "
                f"({p['samples_per_s_before']} -> {p['samples_per_s_after']} samples/s)"
            )
    return epochs, path, steps


def main() -> int:
    """Run every setting once and print the table and the ratios; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--fixed", default="8,0,1,2,4", help="fixed num_workers to run")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of every run; epochs are the median"
    )
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("GPUWATCHD_SOCKET", None)
    env["GPUWATCHD_SOCKET"] = "/nonexistent/gpuwatchd-efficacy.sock"  # no daemon: untouched
    print(f"host: {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'setting':<34} {'epochs':>6}  num_workers path")
    fixed: dict[int, list[int]] = {}
    managed: dict[int, list[int]] = {}
    for round_ in range(args.repeat):
        if args.repeat > 1:
            print(f"-- round {round_ + 1} of {args.repeat}")
        for workers in [int(w) for w in args.fixed.split(",")]:
            epochs, path = _train(workers, args.seconds, args.views, env)
            fixed.setdefault(workers, []).append(epochs)
            label = f"num_workers={workers} fixed, no daemon"
            print(f"{label:<34} {epochs:>6}  {path}", flush=True)
            if workers in (8, 0):
                epochs, path, steps = _managed(workers, args.seconds, args.views)
                managed.setdefault(workers, []).append(epochs)
                label = f"num_workers={workers}, gpuwatchd default"
                print(f"{label:<34} {epochs:>6}  {path}", flush=True)
                for step in steps:
                    print(f"{'':<42}tune_loader {step}")
    medians = {w: statistics.median(e) for w, e in fixed.items()}
    best_workers = max(medians, key=lambda w: medians[w])
    best = medians[best_workers]
    print(f"best fixed: num_workers={best_workers}, {best:g} epochs (median of {args.repeat})")
    for workers, runs in managed.items():
        epochs = statistics.median(runs)
        print(
            f"managed from {workers}: {epochs:g}/{best:g} = {epochs / best:.0%} of the best fixed"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
