"""The hook's cost per training step on the GPU: the same CUDA loop with and without it.

A small MLP step on the GPU (forward, backward, optimizer, ~1 ms); ``plain`` iterates a
list of GPU batches, ``hooked`` the same list through ``watch.loader`` and
``watch.step`` while attached to the daemon on ``$GPUWATCHD_SOCKET`` (its background
thread reporting every 0.25 s). Runs interleave; prints JSON with the medians.

    python bench/gpu/hook_step.py --steps 2000 --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from gpuwatchd.hook import attach


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: to rehearse the battery)")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(256, 1024, device=device) for _ in range(args.steps)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    def plain() -> float:
        sync()
        started = time.perf_counter()
        for x in batches:
            loss = forward(x)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        sync()
        return time.perf_counter() - started

    with attach(job="hook-step", knobs={"batch_size": 256}, report_interval_s=0.25) as watch:
        loader = watch.loader(lambda knobs: batches)

        def hooked() -> float:
            sync()
            started = time.perf_counter()
            for x in loader:
                watch.step(forward, x, optimizer)
            sync()
            return time.perf_counter() - started

        plain(), hooked()  # warm-up: kernels compiled, allocator filled
        times: dict[str, list[float]] = {"plain": [], "hooked": []}
        for _ in range(args.runs):
            times["plain"].append(plain())
            times["hooked"].append(hooked())
    step_us = {k: statistics.median(v) / args.steps * 1e6 for k, v in times.items()}
    out: dict[str, Any] = {
        "steps": args.steps,
        "runs": args.runs,
        "plain_us_per_step": round(step_us["plain"], 2),
        "hooked_us_per_step": round(step_us["hooked"], 2),
        "overhead_us_per_step": round(step_us["hooked"] - step_us["plain"], 2),
        "overhead_pct": round(100 * (step_us["hooked"] / step_us["plain"] - 1), 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
