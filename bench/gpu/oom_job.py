"""A hooked CUDA job whose first batch does not fit (the battery's out-of-memory check).

The battery's token model (bench/gpu/bs_model.py: embedding, a 4x MLP, a classifier)
over ``--seq``-token samples: each sample keeps tens of MiB of activations for the
backward pass, so ``--batch-size 8192`` asks for far more than an 80 GiB H100 has.
With ``--oom halve`` the hook (:meth:`gpuwatchd.hook.Watch.step`) reports each real
``torch.OutOfMemoryError`` and halves ``batch_size`` keeping the effective batch by
gradient accumulation; with ``--oom raise`` the error ends the process as it would any
unhooked job (its stderr is the real text the crash classifier reads).

    python bench/gpu/oom_job.py --job oomy --oom halve --steps 2
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from bs_model import token_model  # bench/gpu/bs_model.py, beside this script
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpuwatchd.hook import attach


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="oomy")
    parser.add_argument("--oom", choices=("halve", "raise"), default="halve")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps to run")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, head, optimizer = token_model(device)
    tokens = torch.randint(0, 32000, (2 * args.batch_size, args.seq))
    labels = torch.randint(0, 10, (2 * args.batch_size,))
    dataset = TensorDataset(tokens, labels)
    knobs = {"batch_size": args.batch_size}
    with attach(job=args.job, knobs=knobs, oom=args.oom) as watch:

        def make_loader(k: dict[str, Any]) -> DataLoader[Any]:
            return DataLoader(dataset, batch_size=int(k["batch_size"]), shuffle=True)

        def forward(batch: list[torch.Tensor]) -> torch.Tensor:
            x, y = batch[0].to(device), batch[1].to(device)
            return nn.functional.cross_entropy(head(model(x).mean(dim=1)), y)

        loader = watch.loader(make_loader)
        steps = 0
        while steps < args.steps:
            for batch in loader:
                watch.step(forward, batch, optimizer)
                if watch.sync_gradients:
                    steps += 1
                    print(
                        f"step {steps}: batch_size={watch.batch_size} "
                        f"peak={torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
                        flush=True,
                    )
                if steps >= args.steps:
                    break
    return 0


if __name__ == "__main__":
    sys.exit(main())
