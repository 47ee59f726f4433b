"""Choosing a GPU for a worker (pure: takes the GPU samples and our per-GPU worker counts).

``gpus: auto``: among the GPUs NVML reports without error, the one with the most free
memory *per worker* once this one is added, ``free / (ours + 1)``, where ``free`` is
``memory.total - memory.used`` and ``ours`` the number of our managed workers (all jobs)
already on it. A fresh worker has not allocated yet, so free memory alone would send
every worker started in the same tick to the same GPU; dividing by the count spreads
them while still avoiding a GPU that someone else has filled. Ties go to fewer workers,
then the lower index. GPUs whose memory is unknown (``N/A``) rank after all others:
that includes a GPU still without a first reading (``stale``, its NVML call hung past
the daemon's start-up wait, :data:`gpuwatchd.daemon.tick.INITIAL_SAMPLE_WAIT_S`), where
a worker's CUDA start would likely hang too.

A fixed list (``gpus: [0, 1]``): the listed GPU with the fewest of our workers, ties in
list order, which is round-robin for workers started together and refills the emptiest
GPU after a restart. Listed GPUs that NVML reports as failed are avoided while another
listed GPU is healthy; when there is no inventory (no NVML) the list is used as given.

Cordoned GPUs (``gpuwatchctl gpu cordon``, the ``cordon_gpu`` action;
:mod:`gpuwatchd.cordon`) are never chosen, in either form: with every candidate
cordoned the worker gets no GPU (``CUDA_VISIBLE_DEVICES=""``) and the reason says so.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.model import NA, GpuSample
from gpuwatchd.units import format_bytes

__all__ = ["Placement", "choose_gpu"]


@dataclass(frozen=True, slots=True)
class Placement:
    """The chosen NVML index (``None``: no GPU, ``CUDA_VISIBLE_DEVICES=""``) and why."""

    gpu: int | None
    reason: str


def _free(gpu: GpuSample) -> int | None:
    if gpu.memory_total_bytes is NA or gpu.memory_used_bytes is NA:
        return None
    return max(0, gpu.memory_total_bytes - gpu.memory_used_bytes)


def choose_gpu(
    gpus: Sequence[GpuSample],
    ours: Mapping[int, int],
    allowed: Sequence[int] | None = None,
    cordoned: Collection[int] = (),
) -> Placement:
    """Pick a GPU; see the module docstring. ``ours`` maps NVML index to our worker count.

    ``allowed`` is the job's fixed list, or ``None`` for ``gpus: auto``; ``cordoned``: the
    NVML indexes never chosen. Never raises.
    """
    healthy = {g.index: g for g in gpus if g.error is None and g.index not in cordoned}
    if allowed is not None:
        if not allowed:
            return Placement(None, "the job's GPU list is empty")
        open_ = [i for i in allowed if i not in cordoned]
        if not open_:
            return Placement(None, f"every GPU of the job's list {list(allowed)} is cordoned")
        pool = [i for i in open_ if i in healthy] if healthy else open_
        if not pool:
            pool = open_
        best = min(pool, key=lambda i: (ours.get(i, 0), pool.index(i)))
        return Placement(
            best,
            f"fixed list {list(allowed)}: fewest of our workers ({ours.get(best, 0)})",
        )
    if not healthy:
        if any(g.index in cordoned for g in gpus):
            return Placement(None, "no GPU left: every GPU is cordoned or reported an NVML error")
        if gpus:
            return Placement(None, "no healthy GPU (every GPU reported an NVML error)")
        return Placement(None, "no GPU available (no NVML devices)")

    def key(g: GpuSample) -> tuple[int, float, int, int]:
        free = _free(g)
        n = ours.get(g.index, 0)
        if free is None:
            return (1, 0.0, n, g.index)
        return (0, -free / (n + 1), n, g.index)

    best_gpu = min(healthy.values(), key=key)
    free = _free(best_gpu)
    n = ours.get(best_gpu.index, 0)
    if free is None:
        why = f"auto: memory unknown, fewest of our workers ({n})"
    else:
        why = f"auto: most free memory per worker ({format_bytes(free)} free, {n} of our workers)"
    return Placement(best_gpu.index, why)
