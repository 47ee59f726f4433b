"""What the hook asks of PyTorch's CUDA side, without ever importing torch or initialising CUDA.

Every function looks torch up in :data:`sys.modules`: a job that never imported
torch gets empty answers, and nothing here creates a CUDA context. The memory figures
come from the caching allocator's counters (``torch.cuda.memory_allocated`` and
friends), which are host-side bookkeeping: reading them does not synchronise the
device.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Final

__all__ = [
    "CUDA_OOM_MESSAGES",
    "crash_kind",
    "cuda_memory",
    "is_cuda_oom",
    "is_trial_pruned",
    "release_cached_memory",
]

CUDA_OOM_MESSAGES: Final = ("CUDA out of memory", "CUDA error: out of memory")
"""Messages of a CUDA OOM raised as a plain RuntimeError (PyTorch before 1.13 had no
``torch.cuda.OutOfMemoryError``; cuBLAS/cuDNN report the driver's error text)."""
CUDA_ASSERT_MESSAGES: Final = ("device-side assert triggered", "cudaErrorAssert")
"""A CUDA device-side assert: the process's CUDA context is poisoned and it must die."""
MAX_DEVICES: Final = 64
"""Devices reported at most (the daemon refuses longer ``cuda_memory`` lists)."""


def _torch_cuda() -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, "cuda", None) if torch is not None else None


def cuda_memory() -> list[dict[str, int]]:
    """Per CUDA device of this process: ``{device, allocated_bytes, reserved_bytes,
    peak_allocated_bytes}`` (``torch.cuda.memory_allocated``/``memory_reserved``/
    ``max_memory_allocated``, bytes), in CUDA ordinal order.

    ``[]`` when torch is not imported, CUDA is not initialised (a CPU job, or before
    the first CUDA call) or the counters cannot be read. Never initialises CUDA and
    never synchronises: safe to call from the hook's background thread.
    """
    cuda = _torch_cuda()
    if cuda is None:
        return []
    try:
        if not cuda.is_initialized():
            return []
        count = min(int(cuda.device_count()), MAX_DEVICES)
        return [
            {
                "device": index,
                "allocated_bytes": int(cuda.memory_allocated(index)),
                "reserved_bytes": int(cuda.memory_reserved(index)),
                "peak_allocated_bytes": int(cuda.max_memory_allocated(index)),
            }
            for index in range(count)
        ]
    except Exception:  # a broken driver must not break reporting
        return []


def is_cuda_oom(exc: BaseException) -> bool:
    """True for ``torch.cuda.OutOfMemoryError`` and for RuntimeErrors with CUDA's OOM text."""
    cuda = _torch_cuda()
    oom_type = getattr(cuda, "OutOfMemoryError", None) if cuda is not None else None
    if isinstance(oom_type, type) and isinstance(exc, oom_type):
        return True
    if isinstance(exc, RuntimeError) and exc.args and isinstance(exc.args[0], str):
        return any(text in exc.args[0] for text in CUDA_OOM_MESSAGES)
    return False


def is_trial_pruned(exc: BaseException) -> bool:
    """True for ``optuna.TrialPruned`` (looked up only if optuna is imported)."""
    optuna = sys.modules.get("optuna")
    pruned = getattr(optuna, "TrialPruned", None) if optuna is not None else None
    return isinstance(pruned, type) and isinstance(exc, pruned)


def is_optuna_error(exc: BaseException) -> bool:
    """True for Optuna's own errors: an ``optuna.exceptions.OptunaError`` (e.g.
    ``StorageInternalError``, ``UpdateFinishedTrialError``; looked up only if optuna is
    imported) other than ``TrialPruned``, and the ``ValueError`` of ``Study.tell`` on a
    trial that is no longer RUNNING (``Cannot tell a COMPLETE trial.``)."""
    if isinstance(exc, ValueError) and str(exc).startswith("Cannot tell "):
        return True
    optuna = sys.modules.get("optuna")
    exceptions = getattr(optuna, "exceptions", None) if optuna is not None else None
    base = getattr(exceptions, "OptunaError", None)
    return isinstance(base, type) and isinstance(exc, base) and not is_trial_pruned(exc)


def crash_kind(exc: BaseException) -> str | None:
    """The ``crash_kind`` of an exception that ends the job, or None if it is no crash.

    ``cuda_oom`` (CUDA out of memory), ``cuda_assert`` (device-side assert),
    ``host_oom`` (:class:`MemoryError`), ``optuna_error`` (:func:`is_optuna_error`),
    ``other``; None for ``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit`` and
    ``optuna.TrialPruned`` (an ending, not a crash).
    """
    if not isinstance(exc, Exception) or is_trial_pruned(exc):
        return None
    if is_cuda_oom(exc):
        return "cuda_oom"
    text = str(exc)
    if any(marker in text for marker in CUDA_ASSERT_MESSAGES):
        return "cuda_assert"
    if isinstance(exc, MemoryError):
        return "host_oom"
    if is_optuna_error(exc):
        return "optuna_error"
    return "other"


def release_cached_memory() -> None:
    """``gc.collect()`` and, when CUDA is initialised, ``torch.cuda.empty_cache()``.

    What Accelerate's ``find_executable_batch_size`` does between two attempts, so that
    the memory of the failed attempt (freed tensors, the caching allocator's blocks)
    is available to the next one.
    """
    gc.collect()
    cuda = _torch_cuda()
    if cuda is None:
        return
    try:
        if cuda.is_initialized():
            cuda.empty_cache()
    except Exception:
        pass
