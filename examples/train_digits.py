#!/usr/bin/env python3
"""A real (small) PyTorch CPU training job attached to gpuwatchd through the hook.

It trains an MLP on scikit-learn's bundled digits data set (1797 8x8 images; nothing
is downloaded). Each sample is augmented on the fly (random rotation, scale and shift,
noise, blur) and described by its pixels plus a histogram of oriented gradients, so
the DataLoader workers burn real CPU (about 0.2-0.5 ms per sample and view). The
default ``--num-workers 8`` is too many for a small host: the case gpuwatchd's
policies cut back.

Usage::

    python examples/train_digits.py --job digits --num-workers 8 --epochs 10
    GPUWATCHD_SOCKET=/tmp/gw/control.sock python examples/train_digits.py --duration-s 30

One line per epoch on stdout (``epoch=… num_workers=… steps=… loss=… samples_per_s=…``).
Without a daemon it trains all the same (the hook logs one warning). A daemon's
``stop`` ends the run after the current step (``--checkpoint PATH``: the model is saved
first), ``drain`` after the current epoch; each is acknowledged when applied.
Exit status 0 when done.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpuwatchd.hook import attach

SIDE = 32  # augmentation works on the 8x8 digit upsampled to 32x32
OUT = 16  # ...and pools the result down to 16x16 pixels
HOG_CELLS = 4  # 4x4 cells of 4x4 pixels
HOG_BINS = 9  # unsigned gradient orientation bins (Dalal & Triggs 2005)
FEATURES = OUT * OUT + HOG_CELLS * HOG_CELLS * HOG_BINS


class AugmentedDigits(Dataset[tuple[torch.Tensor, int]]):
    """scikit-learn digits with per-sample random augmentation and HOG features.

    ``__getitem__`` returns ``(features, label)``: a float32 tensor of shape
    ``(FEATURES,)`` (16x16 pixels in 0..1, then 16 cells x 9 orientation bins) and the
    digit 0..9. ``views`` augmented copies are averaged, so the CPU cost per sample
    grows linearly with it.
    """

    def __init__(self, views: int, seed: int) -> None:
        digits = load_digits()
        self.images = (digits.images / 16.0).astype(np.float32)
        self.labels = digits.target.astype(np.int64)
        self.views = views
        self.seed = seed
        grid = np.arange(SIDE, dtype=np.float32)
        self._yy, self._xx = np.meshgrid(grid, grid, indexing="ij")
        cells = np.arange(OUT) // (OUT // HOG_CELLS)
        self._cell = (cells[:, None] * HOG_CELLS + cells[None, :]).ravel()
        self._rng: np.random.Generator | None = None
        self._rng_pid = -1

    def __len__(self) -> int:
        return len(self.labels)

    def _generator(self) -> np.random.Generator:
        # One generator per process; workers get torch's per-worker, per-epoch seed.
        if self._rng is None or self._rng_pid != os.getpid():
            self._rng = np.random.default_rng([self.seed, os.getpid(), torch.initial_seed()])
            self._rng_pid = os.getpid()
        return self._rng

    def _augment(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        big = np.kron(image, np.ones((SIDE // 8, SIDE // 8), dtype=np.float32))
        angle = rng.uniform(-0.25, 0.25)  # radians, about +-14 degrees
        scale = rng.uniform(0.9, 1.1)
        cos_a, sin_a = np.cos(angle) / scale, np.sin(angle) / scale
        centre = (SIDE - 1) / 2
        dy, dx = self._yy - centre, self._xx - centre
        src_y = cos_a * dy - sin_a * dx + centre + rng.uniform(-2.0, 2.0)
        src_x = sin_a * dy + cos_a * dx + centre + rng.uniform(-2.0, 2.0)
        iy = np.clip(np.rint(src_y), 0, SIDE - 1).astype(np.intp)
        ix = np.clip(np.rint(src_x), 0, SIDE - 1).astype(np.intp)
        out = big[iy, ix] + rng.normal(0.0, 0.05, size=(SIDE, SIDE)).astype(np.float32)
        padded = np.pad(out, 1, mode="edge")
        blurred = np.zeros((SIDE, SIDE), dtype=np.float32)
        for i in range(3):
            for j in range(3):
                blurred += padded[i : i + SIDE, j : j + SIDE]
        pooled = (blurred / 9.0).reshape(OUT, SIDE // OUT, OUT, SIDE // OUT).mean(axis=(1, 3))
        result: np.ndarray = np.clip(pooled, 0.0, 1.0).astype(np.float32)
        return result

    def _hog(self, image: np.ndarray) -> np.ndarray:
        grad_y, grad_x = np.gradient(image)
        magnitude = np.hypot(grad_x, grad_y)
        orientation = (np.arctan2(grad_y, grad_x) % np.pi) / np.pi * HOG_BINS
        bins = np.minimum(orientation.astype(np.intp), HOG_BINS - 1).ravel()
        hist = np.bincount(
            self._cell * HOG_BINS + bins,
            weights=magnitude.ravel(),
            minlength=HOG_CELLS * HOG_CELLS * HOG_BINS,
        )
        normalised: np.ndarray = (hist / (np.linalg.norm(hist) + 1e-6)).astype(np.float32)
        return normalised

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = self._generator()
        features = np.zeros(FEATURES, dtype=np.float32)
        for _ in range(self.views):
            pixels = self._augment(self.images[index], rng)
            features[: OUT * OUT] += pixels.ravel()
            features[OUT * OUT :] += self._hog(pixels)
        features /= self.views
        return torch.from_numpy(features), int(self.labels[index])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.environ.get("GPUWATCHD_JOB", "digits"))
    parser.add_argument("--socket", default=None, help="control socket (default: gpuwatchd's)")
    parser.add_argument("--num-workers", type=int, default=8, help="DataLoader num_workers")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="DataLoader prefetch_factor")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="0: no limit (default: 10, or no limit with --duration-s)",
    )
    parser.add_argument("--duration-s", type=float, default=0.0, help="stop after; 0: no limit")
    parser.add_argument("--views", type=int, default=2, help="augmented views per sample (cost)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="where a daemon's stop saves the model")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 0 if args.duration_s > 0 else 10
    if args.epochs <= 0 and args.duration_s <= 0:
        parser.error("give --epochs or --duration-s (or both)")
    if args.num_workers < 0 or args.batch_size < 1 or args.views < 1:
        parser.error("--num-workers must be >= 0, --batch-size and --views >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Train until ``--epochs`` or ``--duration-s`` (whichever first); return 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # the main process computes; the workers prepare data
    torch.manual_seed(args.seed)
    dataset = AugmentedDigits(views=args.views, seed=args.seed)
    model = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def make_loader(knobs: dict[str, Any]) -> DataLoader[tuple[torch.Tensor, int]]:
        num_workers = int(knobs["num_workers"])
        return DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=num_workers,
            # DataLoader accepts prefetch_factor only with worker processes
            prefetch_factor=int(knobs["prefetch_factor"]) if num_workers > 0 else None,
        )

    knobs = {"num_workers": args.num_workers, "prefetch_factor": args.prefetch_factor}
    started_s = time.monotonic()
    deadline_s = started_s + args.duration_s if args.duration_s > 0 else float("inf")

    def save_checkpoint(reason: str | None) -> None:
        if args.checkpoint:
            torch.save(model.state_dict(), args.checkpoint)
            print(f"checkpoint saved to {args.checkpoint} ({reason})", flush=True)

    with attach(job=args.job, knobs=knobs, socket=args.socket, on_stop=save_checkpoint) as watch:
        print(
            f"job={watch.job} pid={os.getpid()} socket={watch.socket_path} "
            f"connected={watch.connected}",
            flush=True,
        )
        loader = watch.loader(make_loader)
        epoch = 0
        while (args.epochs <= 0 or epoch < args.epochs) and time.monotonic() < deadline_s:
            epoch_start_s = time.monotonic()
            steps = samples = correct = 0
            loss_sum = 0.0
            for features, labels in loader:
                optimizer.zero_grad()
                logits = model(features)
                loss = F.cross_entropy(logits, labels)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                steps += 1
                samples += len(labels)
                loss_sum += loss.item() * len(labels)
                correct += int((logits.argmax(dim=1) == labels).sum())
                if time.monotonic() >= deadline_s:
                    break  # (a daemon's stop ends the epoch inside the loader, at the next step)
            elapsed_s = time.monotonic() - epoch_start_s
            print(
                f"epoch={epoch} num_workers={loader.knobs['num_workers']} steps={steps} "
                f"loss={loss_sum / max(samples, 1):.4f} acc={correct / max(samples, 1):.3f} "
                f"samples_per_s={samples / max(elapsed_s, 1e-9):.1f} "
                f"epoch_s={elapsed_s:.2f} connected={watch.connected}",
                flush=True,
            )
            epoch += 1
            if watch.should_stop:  # a stop or drain was applied (and acknowledged)
                why = "stop" if watch.stop_requested else "drain"
                print(f"{why} requested by gpuwatchd; ending after epoch {epoch - 1}", flush=True)
                break
    print(f"done: {epoch} epochs in {time.monotonic() - started_s:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
