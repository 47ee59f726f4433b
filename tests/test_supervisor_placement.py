"""Worker placement (gpuwatchd.jobs.placement): which GPU a worker gets."""

from __future__ import annotations

from gpuwatchd.jobs.placement import choose_gpu
from gpuwatchd.model import GpuSample

GIB = 2**30


def gpu(index: int, used_gib: float, total_gib: float = 80, error: str | None = None) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        index=index,
        name="NVIDIA H100 80GB HBM3",
        timestamp_s=0.0,
        memory_used_bytes=int(used_gib * GIB),
        memory_total_bytes=int(total_gib * GIB),
        error=error,
    )


def test_choose_gpu_auto_prefers_free_memory_per_worker() -> None:
    gpus = [gpu(0, used_gib=40), gpu(1, used_gib=1), gpu(2, used_gib=0, error="GPU is lost")]
    first = choose_gpu(gpus, {})
    assert first.gpu == 1 and "79.0 GiB free" in first.reason
    assert choose_gpu(gpus, {1: 1}).gpu == 0  # 79/2 = 39.5 < 40
    assert choose_gpu(gpus, {1: 1, 0: 1}).gpu == 1  # 39.5 > 20
    assert choose_gpu([gpu(2, 0, error="GPU is lost")], {}).gpu is None
    nothing = choose_gpu([], {})
    assert nothing.gpu is None and "no GPU" in nothing.reason


def test_choose_gpu_fixed_list_is_round_robin_and_avoids_lost_gpus() -> None:
    assert choose_gpu([], {}, [2, 0]).gpu == 2
    assert choose_gpu([], {2: 1}, [2, 0]).gpu == 0
    assert choose_gpu([], {2: 1, 0: 1}, [2, 0]).gpu == 2
    gpus = [gpu(0, 0), gpu(2, 0, error="GPU is lost")]
    assert choose_gpu(gpus, {0: 3}, [2, 0]).gpu == 0


def test_choose_gpu_never_picks_a_cordoned_gpu() -> None:
    gpus = [gpu(0, used_gib=0), gpu(1, used_gib=40)]
    assert choose_gpu(gpus, {}).gpu == 0
    assert choose_gpu(gpus, {}, cordoned={0}).gpu == 1
    none_left = choose_gpu(gpus, {}, cordoned={0, 1})
    assert none_left.gpu is None and "cordoned" in none_left.reason
    assert choose_gpu(gpus, {}, [0, 1], cordoned={0}).gpu == 1
    assert choose_gpu([], {}, [0, 1], cordoned={0}).gpu == 1  # no inventory: the list minus 0
    listed = choose_gpu(gpus, {}, [0], cordoned={0})
    assert listed.gpu is None and "every GPU of the job's list [0] is cordoned" in listed.reason
