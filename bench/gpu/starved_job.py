"""A CUDA training job whose DataLoader starves the GPU (the battery's tuning check).

A small CNN on the GPU; each sample costs ~2 ms of CPU (a few FFTs standing for JPEG
decoding and augmentation), so with ``num_workers=0`` the GPU waits on the loader most
of the time. Written as PyTorch's examples are (``len(loader.dataset)``, a new
``DataLoader`` per epoch from the hook's knobs); prints each epoch's samples/s and
``num_workers``.

    python bench/gpu/starved_job.py --job starved --duration-s 60
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpuwatchd.hook import attach


class Decoded(Dataset[tuple[torch.Tensor, int]]):
    """``n`` 3x64x64 images made by CPU work per item (FFT round trips)."""

    def __init__(self, n: int, cost: int) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        image = rng.standard_normal((3, 64, 64)).astype(np.float32)
        for _ in range(self.cost):
            image = np.fft.irfft2(np.fft.rfft2(image), s=(64, 64)).astype(np.float32)
        return torch.from_numpy(image), index % 10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="starved")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--cost", type=int, default=12, help="FFT round trips per sample")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: to rehearse the battery)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = Decoded(1024, args.cost)
    end = time.monotonic() + args.duration_s
    with attach(job=args.job, knobs={"num_workers": 0, "prefetch_factor": 2}) as watch:

        def make_loader(knobs: dict[str, Any]) -> DataLoader[Any]:
            workers = int(knobs["num_workers"])
            return DataLoader(
                dataset,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=workers,
                prefetch_factor=int(knobs["prefetch_factor"]) if workers else None,
                pin_memory=device.type == "cuda",
            )

        loader = watch.loader(make_loader)  # rebuilt by the hook when a knob changes
        epoch = 0
        while time.monotonic() < end and not watch.should_stop:
            started, seen = time.monotonic(), 0
            for images, labels in loader:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                loss = nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += len(images)
                if time.monotonic() >= end:
                    break
            if device.type == "cuda":
                torch.cuda.synchronize()
            rate = seen / max(time.monotonic() - started, 1e-9)
            print(
                f"epoch {epoch}: {rate:.0f} samples/s of {len(loader.dataset)}, "
                f"num_workers={loader.num_workers}",
                flush=True,
            )
            epoch += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
