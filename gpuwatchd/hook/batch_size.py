"""Batch-size finder: the largest batch that fits, measured with real training steps.

``find_batch_size(step, start=32, effective_batch_size=256)`` with ``step(batch_size)``
one real forward and backward; also ``gpuwatch-batch-size`` / ``python -m
gpuwatchd.hook.batch_size`` (see :func:`main`). Search and memory budget:
docs/hook-internals.md, "Batch-size finder".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol

from gpuwatchd.control.protocol import Op
from gpuwatchd.errors import GpuwatchError
from gpuwatchd.hook._cuda import is_cuda_oom, release_cached_memory
from gpuwatchd.hook._knobs import divisors

__all__ = [
    "DEFAULT_SAFETY",
    "BatchSizeError",
    "BatchSizeResult",
    "Probe",
    "find_batch_size",
    "main",
    "other_processes_bytes",
]

DEFAULT_SAFETY: Final = 0.85
"""Fraction of the free memory a batch may use at its peak (the rest absorbs
fragmentation, other jobs' growth and the allocations the probe steps do not make)."""
CPU_OOM_MESSAGES: Final = ("DefaultCPUAllocator: can't allocate memory",)
"""PyTorch's CPU allocator failure (as Accelerate's ``should_reduce_batch_size``)."""
_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class BatchSizeError(GpuwatchError):
    """The finder could not run (bad arguments, no measurable memory) or no batch fits."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One tried batch size: whether it fit, its peak memory above the baseline (bytes,
    None when an error came first) and the error text, if any."""

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class BatchSizeResult:
    """What :func:`find_batch_size` found.

    ``batch_size`` (to use) and ``accumulation_steps`` keep ``effective_batch_size``
    (``batch_size * accumulation_steps``); ``max_batch_size`` is the largest size that
    fit (``batch_size`` is the largest divisor of the effective batch size not above
    it). ``budget_bytes = safety * free_bytes``; ``other_processes_bytes`` is what the
    daemon said other processes hold on the GPU (None without a daemon or on the CPU).
    ``measure`` names how peaks were measured.
    """

    batch_size: int
    accumulation_steps: int
    effective_batch_size: int
    max_batch_size: int
    peak_bytes: int
    budget_bytes: int
    free_bytes: int
    safety: float
    device: str
    measure: str
    other_processes_bytes: int | None = None
    probes: tuple[Probe, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``probes`` as a list of dicts)."""
        return asdict(self)


class _Meter(Protocol):
    measure: str

    def free_bytes(self) -> int: ...

    def start(self) -> None: ...

    def peak_bytes(self) -> int: ...


# -- CPU: peak RSS --------------------------------------------------------------------------


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise BatchSizeError(f"/proc/self/status has no {field_name}")


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * _PAGE_BYTES


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


class _RssMeter:
    """Peak RSS of this process during a probe (Linux ``/proc``); see the module docstring."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._baseline = 0
        self._clear_refs = self._can_reset_hwm()
        self._sampler: threading.Thread | None = None
        self._sampling = threading.Event()
        self._sampled_peak = 0
        self.measure = (
            "peak RSS (VmHWM reset by /proc/self/clear_refs) above RSS before the probe"
            if self._clear_refs
            else "peak RSS sampled every 1 ms above RSS before the probe"
        )

    @staticmethod
    def _can_reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                refs.write("5")
            _status_kib("VmHWM")
        except (OSError, BatchSizeError):
            return False
        return True

    def free_bytes(self) -> int:
        return self._budget

    def start(self) -> None:
        self._stop_sampler()
        gc.collect()
        _malloc_trim()
        self._baseline = _rss_bytes()
        if self._clear_refs:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                refs.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
            return
        self._sampled_peak = self._baseline
        self._sampling.clear()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._sampling.wait(0.001):
            self._sampled_peak = max(self._sampled_peak, _rss_bytes())

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampling.set()
            self._sampler.join()
            self._sampler = None

    def peak_bytes(self) -> int:
        if self._clear_refs:
            peak = _status_kib("VmHWM") * 1024
        else:
            self._stop_sampler()
            peak = max(self._sampled_peak, _rss_bytes())
        return max(0, peak - self._baseline)


# -- GPU: torch.cuda ----------------------------------------------------------------------


class _CudaMeter:
    """Peak ``torch.cuda.max_memory_reserved`` above the reservation before the probe."""

    measure = "torch.cuda.max_memory_reserved above memory_reserved before the probe"

    def __init__(self, torch: Any, device: Any) -> None:
        self._cuda = torch.cuda
        self._device = device
        self._baseline = 0

    def free_bytes(self) -> int:
        release_cached_memory()
        free, _total = self._cuda.mem_get_info(self._device)
        return int(free)

    def total_bytes(self) -> int:
        return int(self._cuda.mem_get_info(self._device)[1])

    def start(self) -> None:
        release_cached_memory()
        self._cuda.synchronize(self._device)
        self._cuda.reset_peak_memory_stats(self._device)
        self._baseline = int(self._cuda.memory_reserved(self._device))

    def peak_bytes(self) -> int:
        self._cuda.synchronize(self._device)
        return max(0, int(self._cuda.max_memory_reserved(self._device)) - self._baseline)


def other_processes_bytes(status: Any, gpu_uuid: str, own_pid: int) -> int | None:
    """GPU memory held by processes other than ``own_pid`` on the GPU ``gpu_uuid``, from a
    daemon ``status`` reply (``gpus[].processes[]``); None if that GPU is not listed.

    UUIDs compare without the ``GPU-`` prefix and case-insensitively (PyTorch and NVML
    spell them differently). Processes whose usage NVML cannot report count 0.
    """
    want = gpu_uuid.lower().removeprefix("gpu-")
    for gpu in status.get("gpus", []) if isinstance(status, dict) else []:
        uuid = str(gpu.get("uuid", "")).lower().removeprefix("gpu-")
        if uuid != want:
            continue
        used = 0
        for process in gpu.get("processes") or []:
            if process.get("pid") == own_pid:
                continue
            value = process.get("used_gpu_memory_bytes")
            if isinstance(value, int) and not isinstance(value, bool):
                used += value
        return used
    return None


def _daemon_status(socket_path: str | None) -> Any:
    from gpuwatchd.control.client import ControlClient

    try:
        with ControlClient(socket_path, timeout_s=2.0) as client:
            return client.call(Op.STATUS)
    except (GpuwatchError, OSError):
        return None


# -- the search ------------------------------------------------------------------------------


def _is_oom(exc: BaseException) -> bool:
    if is_cuda_oom(exc) or isinstance(exc, MemoryError):
        return True
    text = exc.args[0] if isinstance(exc, RuntimeError) and exc.args else ""
    return isinstance(text, str) and any(message in text for message in CPU_OOM_MESSAGES)


def _round_down(value: int, multiple: int) -> int:
    return max(multiple, value // multiple * multiple)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchSizeError(f"{name} must be a positive integer, not {value!r}")
    return value


def find_batch_size(
    step: Callable[[int], object],
    start: int,
    *,
    effective_batch_size: int | None = None,
    max_batch_size: int | None = None,
    device: str = "cuda",
    safety: float = DEFAULT_SAFETY,
    memory_budget_bytes: int | None = None,
    socket: str | os.PathLike[str] | None = None,
    use_daemon: bool = True,
    steps_per_probe: int = 2,
    multiple_of: int = 1,
    log: Callable[[str], object] | None = None,
) -> BatchSizeResult:
    """Find the largest batch size whose real steps fit the memory budget.

    ``step(batch_size)`` must run one real training step (forward and backward, with
    the optimizer step if it allocates) on a batch of that many samples, on
    ``device``. ``start`` is the first size tried; the search never goes above
    ``max_batch_size`` nor above ``effective_batch_size`` (no need: the accumulation is
    then 1). ``safety`` in (0, 1] is the budget's fraction of the free memory;
    ``memory_budget_bytes`` is the memory available on the CPU (required there), and
    on a GPU caps the free memory. ``socket``/``use_daemon``: ask the daemon for the
    memory other processes hold on the GPU. ``multiple_of``: sizes searched are
    multiples of it (e.g. 8 for tensor cores). ``log(line)`` is told each probe.

    Returns a :class:`BatchSizeResult`. Raises :class:`BatchSizeError` for bad
    arguments, when CUDA is asked for but not available, or when not even
    ``multiple_of`` samples fit. Exceptions of ``step`` other than out-of-memory errors
    propagate.
    """
    start = _positive_int(start, "start")
    multiple_of = _positive_int(multiple_of, "multiple_of")
    steps_per_probe = _positive_int(steps_per_probe, "steps_per_probe")
    if not 0.0 < safety <= 1.0:
        raise BatchSizeError(f"safety must be in (0, 1], not {safety!r}")
    cap = max_batch_size if max_batch_size is not None else sys.maxsize
    cap = _positive_int(cap, "max_batch_size")
    if effective_batch_size is not None:
        effective_batch_size = _positive_int(effective_batch_size, "effective_batch_size")
        cap = min(cap, effective_batch_size)
    if memory_budget_bytes is not None:
        memory_budget_bytes = _positive_int(memory_budget_bytes, "memory_budget_bytes")

    meter: _Meter
    other: int | None = None
    if device == "cpu":
        if memory_budget_bytes is None:
            raise BatchSizeError("on the CPU give memory_budget_bytes (e.g. --budget 4GiB)")
        meter = _RssMeter(memory_budget_bytes)
        free = memory_budget_bytes
    elif device == "cuda" or device.startswith("cuda:"):
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():
            raise BatchSizeError(f"device {device!r}: CUDA is not available")
        torch_device = torch.device(device)
        index = torch_device.index if torch_device.index is not None else 0
        cuda_meter = _CudaMeter(torch, index)
        meter = cuda_meter
        free = cuda_meter.free_bytes()
        if use_daemon:
            status = _daemon_status(os.fspath(socket) if socket is not None else None)
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
            if status is not None and uuid:
                other = other_processes_bytes(status, uuid, os.getpid())
            if other is not None:
                reserved = int(torch.cuda.memory_reserved(index))
                free = min(free, cuda_meter.total_bytes() - other - reserved)
        if memory_budget_bytes is not None:
            free = min(free, memory_budget_bytes)
    else:
        raise BatchSizeError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}")
    budget = int(max(0, free) * safety)
    probes: list[Probe] = []

    def probe(size: int) -> bool:
        meter.start()
        began = time.perf_counter()
        error: str | None = None
        peak: int | None = None
        try:
            for _ in range(steps_per_probe):
                step(size)
            peak = meter.peak_bytes()
        except Exception as exc:
            if not _is_oom(exc):
                raise
            error = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        fits = error is None and peak is not None and peak <= budget
        if error is None and not fits:
            error = f"peak {peak} bytes above the budget {budget}"
        result = Probe(size, fits, peak, time.perf_counter() - began, error)
        probes.append(result)  # the next probe's meter.start() frees this one's memory
        if log is not None:
            verdict = "fits" if fits else f"no: {error}"
            log(f"batch_size={size}: peak={peak} budget={budget} {verdict}")
        return fits

    size = min(_round_down(start, multiple_of), _round_down(cap, multiple_of))
    good = 0
    bad: int | None = None
    if probe(size):
        good = size
        while good < cap:
            size = min(_round_down(good * 2, multiple_of), _round_down(cap, multiple_of))
            if size <= good:
                break
            if probe(size):
                good = size
            else:
                bad = size
                break
    else:
        bad = size
        while size > multiple_of:
            size = _round_down(size // 2, multiple_of)
            if probe(size):
                good = size
                break
            bad = size
        if good == 0:
            raise BatchSizeError(
                f"not even batch_size={size} fits in {budget} bytes "
                f"({safety:.0%} of {free} free on {device}): {probes[-1].error}"
            )
    while bad is not None and bad - good > multiple_of:
        mid = _round_down((good + bad) // 2, multiple_of)
        if mid <= good:
            break
        if probe(mid):
            good = mid
        else:
            bad = mid

    peak_at_good = max((p.peak_bytes or 0) for p in probes if p.fits and p.batch_size == good)
    if effective_batch_size is not None:
        batch_size = max(d for d in divisors(effective_batch_size) if d <= good)
        accumulation = effective_batch_size // batch_size
        effective = effective_batch_size
    else:
        batch_size, accumulation, effective = good, 1, good
    return BatchSizeResult(
        batch_size=batch_size,
        accumulation_steps=accumulation,
        effective_batch_size=effective,
        max_batch_size=good,
        peak_bytes=peak_at_good,
        budget_bytes=budget,
        free_bytes=free,
        safety=safety,
        device=device,
        measure=meter.measure,
        other_processes_bytes=other,
        probes=tuple(probes),
    )


# -- command line ------------------------------------------------------------------------------

_FACTORY_RE: Final = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _load_factory(spec: str) -> Callable[..., Callable[[int], object]]:
    if not _FACTORY_RE.match(spec):
        raise BatchSizeError(
            f"--model must be MODULE:FACTORY (e.g. mypkg.models:make_step), not {spec!r}"
        )
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BatchSizeError(f"cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BatchSizeError(f"{spec!r}: {attr!r} is not a callable in {module_name!r}")
    return factory  # type: ignore[no-any-return]


_SIZE_UNITS: Final = {
    "": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
"""The size units of gpuwatchd's config (``gpuwatchd.units``), repeated here because the
hook imports no daemon-side module."""
_SIZE_RE: Final = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    factor = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or factor is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (e.g. 4GiB, 512MiB, 2GB, 1048576)"
        )
    return int(float(match.group(1)) * factor)


def _format_size(n_bytes: int) -> str:
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpuwatch-batch-size",
        description="Find the largest batch size that fits, with real forward+backward steps.",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="FACTORY(device) returns step(batch_size), one real training step",
    )
    parser.add_argument("--start", type=int, default=32, help="first batch size tried (32)")
    parser.add_argument(
        "--effective-batch",
        type=int,
        default=None,
        help="samples per optimizer step to keep with gradient accumulation",
    )
    parser.add_argument(
        "--max", type=int, default=None, dest="max_batch_size", help="largest batch size to try"
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cuda)")
    parser.add_argument(
        "--safety",
        type=float,
        default=DEFAULT_SAFETY,
        help="fraction of the free memory a batch may use (0.85)",
    )
    parser.add_argument(
        "--budget",
        type=_parse_size,
        default=None,
        help="memory available, e.g. 4GiB (required with --device cpu)",
    )
    parser.add_argument("--steps-per-probe", type=int, default=2)
    parser.add_argument("--multiple-of", type=int, default=1)
    parser.add_argument("--socket", default=None, help="gpuwatchd's control socket")
    parser.add_argument(
        "--no-daemon",
        action="store_true",
        help="do not ask the daemon for other processes' GPU memory",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``gpuwatch-batch-size``: run :func:`find_batch_size` on ``FACTORY(device)``.

    Prints one line per probe on stderr, then the result (a table, or JSON with
    ``--json``: :meth:`BatchSizeResult.as_dict`) on stdout. Exit status 0 when a batch
    size was found, 1 when none fits or the finder failed, 2 for bad arguments.
    """
    args = _parse_args(argv)
    try:
        factory = _load_factory(args.model)
        step = factory(args.device)
        found = find_batch_size(
            step,
            args.start,
            effective_batch_size=args.effective_batch,
            max_batch_size=args.max_batch_size,
            device=args.device,
            safety=args.safety,
            memory_budget_bytes=args.budget,
            socket=args.socket,
            use_daemon=not args.no_daemon,
            steps_per_probe=args.steps_per_probe,
            multiple_of=args.multiple_of,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except BatchSizeError as exc:
        print(f"gpuwatch-batch-size: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(found.as_dict(), indent=2))
        return 0
    rows = [
        ("batch_size", str(found.batch_size)),
        ("accumulation_steps", str(found.accumulation_steps)),
        ("effective_batch_size", str(found.effective_batch_size)),
        ("max_batch_size", str(found.max_batch_size)),
        ("peak", _format_size(found.peak_bytes)),
        (
            "budget",
            f"{_format_size(found.budget_bytes)} ({found.safety:.0%} of "
            f"{_format_size(found.free_bytes)} free)",
        ),
        ("device", found.device),
        ("measured as", found.measure),
        ("probes", str(len(found.probes))),
    ]
    if found.other_processes_bytes is not None:
        rows.append(("other processes", _format_size(found.other_processes_bytes)))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def entry() -> None:
    """Console-script entry point: ``sys.exit(main())``."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
