"""The batch-size finder's model for the battery, and the largest batch that really fits.

``factory(device)`` returns ``step(batch_size)``: one forward and backward of a token MLP
(embedding, 4x MLP, classifier) over 256-token samples, as ``gpuwatch-batch-size
--model bench.gpu.bs_model:factory`` takes it. ``python bench/gpu/bs_model.py``
searches the truth the finder estimates: doubling from 64 until a step raises
``torch.OutOfMemoryError``, then bisecting, each probe a real step after the cache is
emptied; prints ``{"true_max_batch_size": N, "probes": [...]}``.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable

import torch
from torch import nn

SEQ = 256


def token_model(device: str | torch.device) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(body, head, AdamW) of the battery's token model on ``device``: an embedding of 32000
    tokens into 1024 dims, a 4x MLP, a 10-class head; TF32 on, as training does. Each
    token keeps ~36 KiB of activations for the backward pass (fp32)."""
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = nn.Sequential(
        nn.Embedding(32000, 1024),
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024),
    ).to(device)  # fmt: skip
    head = nn.Linear(1024, 10).to(device)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-4)
    return model, head, optimizer


def factory(device: str) -> Callable[[int], None]:
    """``step(batch_size)``: one real training step on ``device`` (raises on OOM)."""
    model, head, optimizer = token_model(device)

    def step(batch_size: int) -> None:
        x = torch.randint(0, 32000, (batch_size, SEQ), device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        loss = nn.functional.cross_entropy(head(model(x).mean(dim=1)), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def fits(step: Callable[[int], None], batch_size: int) -> bool:
    """Whether one step at ``batch_size`` runs (the cache emptied before and after)."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        step(batch_size)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    step = factory("cuda")
    probes: list[tuple[int, bool]] = []
    low, high = 0, 64
    while True:
        ok = fits(step, high)
        probes.append((high, ok))
        if not ok:
            break
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        ok = fits(step, middle)
        probes.append((middle, ok))
        low, high = (middle, high) if ok else (low, middle)
    print(json.dumps({"true_max_batch_size": low, "probes": probes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
