"""Crash classification on recorded PyTorch outputs (tests/data/crashes) and on edge cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.crash import CRASH_KINDS, CrashInfo, classify, signal_of

CRASHES = Path(__file__).parent / "data" / "crashes"
CASES: list[dict[str, Any]] = json.loads((CRASHES / "cases.json").read_text())["cases"]


def _text(name: str) -> str:
    return (CRASHES / name).read_text(encoding="utf-8")


def test_every_recorded_file_is_listed_and_named_in_the_readme() -> None:
    listed = {case["file"] for case in CASES}
    on_disk = {p.name for p in CRASHES.glob("*.txt")}
    assert listed == on_disk
    readme = (CRASHES / "README.md").read_text(encoding="utf-8")
    for case in CASES:
        assert f"`{case['file']}`" in readme
        # a public report, generated text, or recorded on a GPU by `make gpu-check`
        assert case["source"].split(":", 1)[0] in ("https", "generated", "recorded")


@pytest.mark.parametrize("case", CASES, ids=[c["file"] for c in CASES])
def test_recorded_outputs_are_classified(case: dict[str, Any]) -> None:
    info = classify(case["returncode"], _text(case["file"]), None)
    assert info.kind == case["kind"]
    assert info.kind in CRASH_KINDS
    assert info.evidence, "the verdict names the line it rests on"
    assert info.evidence in _text(case["file"])


@pytest.mark.parametrize("case", CASES, ids=[c["file"] for c in CASES])
def test_the_hooks_last_exception_alone_is_enough(case: dict[str, Any]) -> None:
    """The hook reports the exception text; stderr may hold only unrelated lines."""
    info = classify(case["returncode"], "epoch 3 loss 0.25\n", _text(case["file"]))
    assert info.kind == case["kind"]


def test_assert_evidence_prefers_the_kernels_own_line() -> None:
    info = classify(1, _text("assert_runtimeerror_loss_kernel.txt"), None)
    assert info.evidence.startswith("/opt/conda/conda-bld/")
    assert "Loss.cu:95" in info.evidence
    assert "relaunched" in info.reason
    assert info.exit_code == 1
    assert info.signal is None


def test_abort_path_reports_sigabrt_as_python_and_as_a_shell_see_it() -> None:
    text = _text("abort_c10_cudaerror_assert.txt")
    direct = classify(-6, text, None)
    shell = classify(134, text, None)
    assert direct.kind == shell.kind == "cuda_assert"
    assert direct.signal == shell.signal == "SIGABRT"
    assert direct.exit_code is None and shell.exit_code is None
    assert "128+SIGABRT" in shell.reason


def test_acceleratorerror_for_another_cuda_error_is_a_sticky_error() -> None:
    text = (
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
        "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/"
        "cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
    )
    info = classify(1, text, None)
    assert info.kind == "cuda_assert"
    assert info.reason.startswith("CUDA error")
    assert "illegal memory access" in info.evidence


def test_cuda_error_out_of_memory_through_c10_cuda_check_is_an_oom() -> None:
    info = classify(1, "torch.AcceleratorError: CUDA error: out of memory\n", None)
    assert info.kind == "cuda_oom"


def test_an_assert_wins_over_an_earlier_caught_oom() -> None:
    text = _text("oom_torch_cuda_outofmemoryerror.txt") + _text("assert_runtimeerror_traceback.txt")
    assert classify(1, text, None).kind == "cuda_assert"


def test_a_host_side_c_assert_is_not_a_device_side_assert() -> None:
    text = "vector_add: vector_add.cu:48: int main(): Assertion `fabs(x) < 1e-6' failed.\n"
    info = classify(-6, text, None)
    assert info.kind == "other"
    assert info.signal == "SIGABRT"


@pytest.mark.parametrize(
    ("returncode", "text", "oom_kills", "kind"),
    [
        (-9, "", 1, "host_oom"),
        (137, "step 10\n", 2, "host_oom"),
        (-9, "", 0, "other"),  # kill -9 by someone: no OOM kill was counted
        (-9, "", None, "host_oom"),  # no counter readable, nothing printed
        (-9, "Traceback (most recent call last):\nValueError: x\n", None, "other"),
        # A CUDA text before a SIGKILL does not make it a CUDA crash.
        (-9, _text("oom_torch_cuda_outofmemoryerror.txt"), 1, "host_oom"),
    ],
)
def test_sigkill_is_judged_by_the_oom_rules(
    returncode: int, text: str, oom_kills: int | None, kind: str
) -> None:
    info = classify(returncode, text, None, oom_kills=oom_kills)
    assert info.kind == kind
    assert info.signal == "SIGKILL"


def test_python_memoryerror_is_a_host_oom_but_cuda_outofmemoryerror_is_not() -> None:
    assert classify(1, "Traceback (most recent call last):\nMemoryError\n", None).kind == "host_oom"
    assert classify(1, "torch.OutOfMemoryError: CUDA out of memory.\n", None).kind == "cuda_oom"


def test_other_names_the_last_exception() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "tune.py", line 3, in <module>\n'
        "KeyError: 'lr'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        "ValueError: bad learning rate\n"
    )
    info = classify(1, text, None)
    assert info == CrashInfo(
        "other",
        "exit status 1: ValueError: bad learning rate",
        None,
        1,
        "ValueError: bad learning rate",
    )


def test_unknown_status_and_signals() -> None:
    assert classify(None, "", None).reason == "exit status unknown"
    segv = classify(-11, "", None)
    assert (segv.kind, segv.signal, segv.reason) == ("other", "SIGSEGV", "killed by SIGSEGV")
    assert signal_of(0) == (None, 0, "exit status 0")
    assert signal_of(2) == (None, 2, "exit status 2")
    assert signal_of(255)[0] is None  # 255 - 128 = 127 is no signal
    assert signal_of(-99) == ("signal 99", None, "killed by signal 99")


def test_real_processes_give_the_return_codes_the_rules_assume(tmp_path: Path) -> None:
    """The recorded cases use 1 for an uncaught exception and -6 for abort(): check both."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, sys\n"
        "sys.stderr.write(open(sys.argv[2]).read()); sys.stderr.flush()\n"
        "if sys.argv[1] == 'abort':\n    os.abort()\n"
        "raise RuntimeError('CUDA error: device-side assert triggered')\n"
    )
    results = {}
    for how, name in (
        ("abort", "abort_c10_cudaerror_assert.txt"),
        ("raise", "assert_runtimeerror_loss_kernel.txt"),
    ):
        proc = subprocess.run(
            [sys.executable, str(script), how, str(CRASHES / name)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        results[how] = classify(proc.returncode, proc.stderr, None)
    assert (results["abort"].kind, results["abort"].signal) == ("cuda_assert", "SIGABRT")
    assert (results["raise"].kind, results["raise"].exit_code) == ("cuda_assert", 1)


def test_to_dict_is_json_able() -> None:
    info = classify(-6, _text("abort_c10_cudaerror_assert.txt"), None)
    assert json.loads(json.dumps(info.to_dict()))["kind"] == "cuda_assert"


_ENVIRONMENT_FAILURES = {
    "missing script": (["no-such-train.py"], "can't open file"),
    "missing module": (["-c", "import no_such_module_for_gpuwatchd"], "ModuleNotFoundError"),
    "read-only file system": (
        [
            "-c",
            "import errno, os; "
            "raise OSError(errno.EROFS, os.strerror(errno.EROFS), '/srv/hpo/ckpt.pt')",
        ],
        "Read-only file system",
    ),
    "permission denied": (
        ["-c", "import os; os.setuid(65534) if os.getuid() == 0 else None; open('/root/x', 'w')"],
        "Permission denied",
    ),
    "read-only sqlite": (
        [
            "-c",
            "import sqlite3, sys; db = sys.argv[1]; c = sqlite3.connect(db); "
            "c.execute('create table if not exists t (a)'); c.commit(); c.close(); "
            "sqlite3.connect(f'file:{db}?mode=ro', uri=True).execute('insert into t values (1)')",
        ],
        "attempt to write a readonly database",
    ),
}


@pytest.mark.parametrize("name", list(_ENVIRONMENT_FAILURES))
def test_environment_failures_are_their_own_kind_with_the_line_as_evidence(
    name: str, tmp_path: Path
) -> None:
    """Real Python processes failing as a worker does in a wrong environment."""
    args, needle = _ENVIRONMENT_FAILURES[name]
    extra = [str(tmp_path / "study.db")] if name == "read-only sqlite" else []
    proc = subprocess.run(
        [sys.executable, *args, *extra], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode != 0
    info = classify(proc.returncode, proc.stderr, None)
    assert info.kind == "environment", (info, proc.stderr)
    assert needle in info.evidence and info.evidence in proc.stderr
    assert needle in info.reason


def test_a_cuda_error_wins_over_a_file_error_printed_with_it() -> None:
    text = _text("assert_runtimeerror_loss_kernel.txt") + "\nOSError: No such file or directory\n"
    assert classify(1, text, None).kind == "cuda_assert"


def test_an_earlier_warning_about_a_missing_file_is_not_the_cause() -> None:
    """The hook warns on stderr when the daemon's socket is missing; the worker then died
    of something else: not an environment failure."""
    text = (
        "gpuwatchd: no daemon at /run/gpuwatchd/control.sock ([Errno 2] No such file or "
        "directory); training goes on unmonitored, retrying in the background\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        "ValueError: bad learning rate\n"
    )
    assert classify(1, text, None).kind == "other"
    assert classify(3, text.split("Traceback")[0], None).kind == "other"


_TOLD_ELSEWHERE = """\
import sys

import optuna

storage = sys.argv[1]
study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True)


def objective(trial):
    x = trial.suggest_float("x", -10, 10)
    # another thread of optimize(n_jobs=2) ran the same re-enqueued trial and told it first
    optuna.load_study(study_name="s", storage=storage).tell(trial.number, x * x)
    return x * x


study.optimize(objective, n_trials=1)
"""


def test_a_worker_ending_on_optunas_own_error_is_an_optuna_error(tmp_path: Path) -> None:
    """A real Optuna worker dies of ``Cannot tell a COMPLETE trial.``: its own crash kind
    with that line as evidence (before: ``other``)."""
    script = tmp_path / "tune.py"
    script.write_text(_TOLD_ELSEWHERE)
    proc = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 's.db'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    info = classify(proc.returncode, proc.stderr, None)
    assert info.kind == "optuna_error", info
    assert info.evidence == "ValueError: Cannot tell a COMPLETE trial."
    assert info.reason == "Optuna error (exit status 1): ValueError: Cannot tell a COMPLETE trial."


@pytest.mark.parametrize(
    "line",
    [
        "optuna.exceptions.UpdateFinishedTrialError: Trial#3 has already finished and can not "
        "be updated.",
        "ValueError: Cannot tell a FAIL trial.",
        "ValueError: Cannot tell for trial with number 7 since it has not been created.",
        "optuna.exceptions.DuplicatedStudyError: Another study with name 's' already exists. "
        "Please specify a different name, or reuse the existing one by setting "
        "`load_if_exists` (for Python API) or `--skip-if-exists` flag (for CLI).",
    ],
)
def test_optunas_errors_are_named_by_their_line(line: str) -> None:
    text = f'Traceback (most recent call last):\n  File "tune.py", line 9, in <module>\n{line}\n'
    info = classify(1, text, None)
    assert (info.kind, info.evidence) == ("optuna_error", line)


def test_a_storage_internal_error_names_the_error_it_was_raised_from() -> None:
    info = classify(1, _text("optuna_storageinternalerror_locked_generated.txt"), None)
    assert info.kind == "optuna_error"
    assert info.evidence.startswith("optuna.exceptions.StorageInternalError: ")
    assert "database is locked -> optuna.exceptions.StorageInternalError" in info.reason
    # Raised from a read-only database: the environment, which a restart cannot mend.
    info = classify(1, _text("optuna_storageinternalerror_readonly_generated.txt"), None)
    assert info.kind == "environment"
    assert "attempt to write a readonly database" in info.evidence


def test_an_uncaught_trialpruned_or_an_earlier_optuna_error_is_no_optuna_error() -> None:
    pruned = "optuna.exceptions.TrialPruned: Trial was pruned at step 5.\n"
    assert classify(1, pruned, None).kind == "other"
    earlier = "ValueError: Cannot tell a COMPLETE trial.\n" + "RuntimeError: diverged\n"
    assert classify(1, earlier, None).kind == "other"
