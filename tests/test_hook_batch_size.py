"""The batch-size finder on the CPU: real forward+backward steps measured by peak RSS, the
search itself (with the out-of-memory error PyTorch raises), the daemon's view of other
processes' GPU memory, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuwatchd.hook.batch_size import (
    BatchSizeError,
    find_batch_size,
    main,
    other_processes_bytes,
)

MIB = 2**20


def oom_above(limit: int, seen: list[int] | None = None) -> Callable[[int], None]:
    """A step that fails like CUDA does for batches above ``limit``."""

    def step(batch_size: int) -> None:
        if seen is not None:
            seen.append(batch_size)
        if batch_size > limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {batch_size} MiB"
            )

    return step


def sizes(result: Any) -> list[tuple[int, bool]]:
    return [(p.batch_size, p.fits) for p in result.probes]


def test_doubling_then_binary_search_finds_the_exact_limit() -> None:
    found = find_batch_size(oom_above(40), 8, device="cpu", memory_budget_bytes=2**40)
    assert sizes(found) == [
        (8, True),
        (16, True),
        (32, True),
        (64, False),
        (48, False),
        (40, True),
        (44, False),
        (42, False),
        (41, False),
    ]
    assert (found.max_batch_size, found.batch_size, found.accumulation_steps) == (40, 40, 1)
    assert found.probes[3].error is not None and "CUDA out of memory" in found.probes[3].error


def test_a_start_that_does_not_fit_is_halved_first() -> None:
    found = find_batch_size(oom_above(40), 100, device="cpu", memory_budget_bytes=2**40)
    assert [s for s, _ in sizes(found)][:3] == [100, 50, 25]
    assert found.max_batch_size == 40


def test_effective_batch_gives_a_dividing_batch_size_and_accumulation() -> None:
    seen: list[int] = []
    found = find_batch_size(
        oom_above(40, seen), 8, effective_batch_size=96, device="cpu", memory_budget_bytes=2**40
    )
    assert (found.batch_size, found.accumulation_steps, found.effective_batch_size) == (32, 3, 96)
    assert found.max_batch_size == 40
    small = find_batch_size(
        oom_above(1000), 8, effective_batch_size=24, device="cpu", memory_budget_bytes=2**40
    )
    assert (small.batch_size, small.accumulation_steps) == (24, 1)  # never above the effective
    assert max(p.batch_size for p in small.probes) == 24


def test_multiple_of_and_steps_per_probe() -> None:
    seen: list[int] = []
    found = find_batch_size(
        oom_above(45, seen),
        8,
        device="cpu",
        memory_budget_bytes=2**40,
        multiple_of=8,
        steps_per_probe=3,
    )
    assert found.max_batch_size == 40
    assert all(size % 8 == 0 for size in seen)
    assert seen[:3] == [8, 8, 8]  # each probe runs three real steps


def test_peak_rss_of_real_steps_decides_what_fits() -> None:
    """About 3 MiB per sample at the peak of a real forward+backward; 96 MiB budget."""
    features = MIB // 4  # one float32 MiB per sample
    weight = torch.zeros(features, requires_grad=True)

    def step(batch_size: int) -> None:
        x = torch.ones(batch_size, features)
        loss = (x * weight).square().mean()
        loss.backward()  # type: ignore[no-untyped-call]
        weight.grad = None

    budget = 96 * MIB
    found = find_batch_size(
        step, 4, device="cpu", memory_budget_bytes=budget, max_batch_size=512, steps_per_probe=1
    )
    assert found.budget_bytes == int(0.85 * budget)
    assert "RSS" in found.measure
    fitting = [p for p in found.probes if p.fits]
    failing = [p for p in found.probes if not p.fits]
    assert fitting and failing
    for probe in fitting:
        assert probe.peak_bytes is not None and probe.peak_bytes <= found.budget_bytes
        assert probe.peak_bytes >= probe.batch_size * MIB  # the tensors were really seen
    for probe in failing:
        assert probe.peak_bytes is not None and probe.peak_bytes > found.budget_bytes
    assert 8 <= found.max_batch_size <= 81  # at least 1 MiB a sample, budget 81.6 MiB
    smallest_failing = min(p.batch_size for p in failing)
    assert smallest_failing == found.max_batch_size + 1  # searched to the exact size


def test_nothing_fits_or_bad_arguments_raise_batch_size_error() -> None:
    with pytest.raises(BatchSizeError, match="not even batch_size=1 fits"):
        find_batch_size(oom_above(0), 16, device="cpu", memory_budget_bytes=2**40)
    with pytest.raises(BatchSizeError, match="memory_budget_bytes"):
        find_batch_size(oom_above(8), 16, device="cpu")
    with pytest.raises(BatchSizeError, match="device must be"):
        find_batch_size(oom_above(8), 16, device="tpu", memory_budget_bytes=MIB)
    with pytest.raises(BatchSizeError, match="safety"):
        find_batch_size(oom_above(8), 16, device="cpu", memory_budget_bytes=MIB, safety=1.5)
    with pytest.raises(BatchSizeError, match="start"):
        find_batch_size(oom_above(8), 0, device="cpu", memory_budget_bytes=MIB)
    if not torch.cuda.is_available():
        with pytest.raises(BatchSizeError, match="CUDA is not available"):
            find_batch_size(oom_above(8), 16, device="cuda")


def test_other_errors_of_the_step_propagate() -> None:
    def broken(batch_size: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        find_batch_size(broken, 8, device="cpu", memory_budget_bytes=2**40)


@pytest.mark.slow
def test_other_processes_memory_comes_from_a_live_daemons_status(
    run_daemon: Callable[..., Any],
) -> None:
    from gpuwatchd.control.client import ControlClient

    script = {
        "devices": [
            {
                "uuid": "GPU-5e7c0a1b-0000-0000-0000-000000000001",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_bytes": 80 * 2**30,
                "series": {"memory.used": [30 * 2**30]},
                "processes": [
                    {"pid": 4242, "used_gpu_memory_bytes": 20 * 2**30},
                    {"pid": os.getpid(), "used_gpu_memory_bytes": 9 * 2**30},
                ],
            }
        ]
    }
    daemon = run_daemon(script=script)
    with ControlClient(daemon.socket) as client:
        status = client.call("status")
    uuid = "5E7C0A1B-0000-0000-0000-000000000001"  # as PyTorch may spell it
    assert other_processes_bytes(status, uuid, os.getpid()) == 20 * 2**30


def test_other_processes_bytes_reads_a_status_reply() -> None:
    status = {
        "gpus": [
            {"uuid": "GPU-aaaa", "processes": [{"pid": 1, "used_gpu_memory_bytes": 5}]},
            {
                "uuid": "GPU-BBBB",
                "processes": [
                    {"pid": 10, "used_gpu_memory_bytes": 7 * MIB},
                    {"pid": 11, "used_gpu_memory_bytes": None},
                    {"pid": 99, "used_gpu_memory_bytes": 3 * MIB},
                ],
            },
        ]
    }
    assert other_processes_bytes(status, "bbbb", own_pid=99) == 7 * MIB
    assert other_processes_bytes(status, "GPU-cccc", own_pid=99) is None


FACTORY = """
import torch

def make_step(device):
    features = 2**18
    weight = torch.zeros(features, requires_grad=True, device=device)

    def step(batch_size):
        x = torch.ones(batch_size, features, device=device)
        (x * weight).square().mean().backward()
        weight.grad = None

    return step
"""


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "bsmodel.py").write_text(FACTORY)
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd.hook.batch_size", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
        env=dict(os.environ, GPUWATCHD_SOCKET=str(tmp_path / "none.sock")),
    )


def test_command_line_finds_a_batch_size_on_the_cpu(tmp_path: Path) -> None:
    done = run_cli(
        tmp_path,
        "--model",
        "bsmodel:make_step",
        "--device",
        "cpu",
        "--budget",
        "64MiB",
        "--start",
        "4",
        "--effective-batch",
        "32",
        "--json",
        "--steps-per-probe",
        "1",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["effective_batch_size"] == 32
    assert result["batch_size"] * result["accumulation_steps"] == 32
    assert 32 % result["batch_size"] == 0 and result["batch_size"] <= result["max_batch_size"]
    assert result["budget_bytes"] == int(0.85 * 64 * MIB)
    assert len(result["probes"]) >= 3
    assert "batch_size=4: peak=" in done.stderr  # one line per probe


def run_main(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
) -> tuple[int, str, str]:
    (tmp_path / "bsmodel.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GPUWATCHD_SOCKET", str(tmp_path / "none.sock"))
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_command_line_table_and_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ("--model", "bsmodel:make_step")
    code, out, _ = run_main(
        tmp_path,
        monkeypatch,
        capsys,
        *model,
        "--device",
        "cpu",
        "--budget",
        "16MiB",
        "--start",
        "2",
        "--steps-per-probe",
        "1",
    )
    assert code == 0
    assert out.splitlines()[0].split()[0] == "batch_size"
    assert "budget" in out and "13.6 MiB (85% of 16.0 MiB free)" in out
    code, _, err = run_main(tmp_path, monkeypatch, capsys, *model, "--device", "cpu")
    assert code == 1 and "memory_budget_bytes" in err
    code, _, err = run_main(tmp_path, monkeypatch, capsys, *model, "--budget", "lots")
    assert code == 2 and "is not a size" in err
    code, _, err = run_main(
        tmp_path,
        monkeypatch,
        capsys,
        "--model",
        "nosuchmodule:f",
        "--device",
        "cpu",
        "--budget",
        "1MiB",
    )
    assert code == 1 and "cannot import 'nosuchmodule'" in err
    code, _, err = run_main(tmp_path, monkeypatch, capsys, "--model", "not a spec")
    assert code == 1 and "MODULE:FACTORY" in err
