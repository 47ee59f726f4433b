"""The hook's cost per training step on the GPU: the same CUDA loop with and without it.

A small MLP step on the GPU (forward, backward, optimizer; Python-bound, under 1 ms);
``plain`` iterates a list of GPU batches; ``loader`` the same list through
``watch.loader`` (plain step code); ``step`` plain iteration with ``watch.step``;
``hooked`` both, as a user of the hook writes it. Attached to the daemon on
``$GPUWATCHD_SOCKET`` (its background thread reporting every 0.25 s, the fastest it
allows). Runs interleave; prints JSON with the medians in µs per step.

    python bench/gpu/hook_step.py --steps 2000 --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
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

    def plain_step(x: torch.Tensor) -> None:
        loss = forward(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def timed(loop: Callable[[], None]) -> float:
        sync()
        started = time.perf_counter()
        loop()
        sync()
        return time.perf_counter() - started

    with attach(job="hook-step", knobs={"batch_size": 256}, report_interval_s=0.25) as watch:
        loader: Iterable[torch.Tensor] = watch.loader(lambda knobs: batches)

        def plain() -> None:
            for x in batches:
                plain_step(x)

        def loader_only() -> None:
            for x in loader:
                plain_step(x)

        def step_only() -> None:
            for x in batches:
                watch.step(forward, x, optimizer)

        def hooked() -> None:
            for x in loader:
                watch.step(forward, x, optimizer)

        loops = {"plain": plain, "loader": loader_only, "step": step_only, "hooked": hooked}
        for loop in loops.values():  # warm-up: kernels compiled, allocator filled
            timed(loop)
        times: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(args.runs):
            for name, loop in loops.items():
                times[name].append(timed(loop))
    us: dict[str, Any] = {k: statistics.median(v) / args.steps * 1e6 for k, v in times.items()}
    out: dict[str, Any] = {
        "steps": args.steps,
        "runs": args.runs,
        "plain_us_per_step": round(us["plain"], 2),
        "hooked_us_per_step": round(us["hooked"], 2),
        "overhead_us_per_step": round(us["hooked"] - us["plain"], 2),
        "overhead_pct": round(100 * (us["hooked"] / us["plain"] - 1), 2),
        "loader_overhead_us_per_step": round(us["loader"] - us["plain"], 2),
        "step_overhead_us_per_step": round(us["step"] - us["plain"], 2),
        "spread_us_per_step": {
            k: [round(min(v) / args.steps * 1e6, 2), round(max(v) / args.steps * 1e6, 2)]
            for k, v in times.items()
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
