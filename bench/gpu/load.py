"""A GPU load for the battery (bench/gpu_check.py): ``busy`` SMs or ``tiny`` kernels.

``busy``: back-to-back 8192x8192 bf16 matrix products (every SM busy, tensor cores on).
``tiny``: one-element additions launched back to back: nvidia-smi's ``utilization.gpu``
(the share of time *any* kernel runs) reads near 100 % while almost every SM idles,
the case DCGM's ``DCGM_FI_PROF_SM_ACTIVE`` exists for. Prints ``ready`` once the first
kernels ran, then runs ``--seconds`` (or until SIGTERM).

    python bench/gpu/load.py --phase busy --seconds 8
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("busy", "tiny"), required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    import torch

    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    device = torch.device("cuda")
    if args.phase == "busy":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

        def work() -> None:
            for _ in range(8):
                torch.mm(a, b)
    else:
        x = torch.zeros(1, device=device)

        def work() -> None:
            for _ in range(200):
                x.add_(1.0)

    work()
    torch.cuda.synchronize()
    print("ready", flush=True)
    end = time.monotonic() + args.seconds
    while not stop and time.monotonic() < end:
        work()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
