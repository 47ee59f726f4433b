"""Crash classification of a managed worker's death (pure: no I/O, no clock).

Specification: docs/modules.md#gpuwatchdcrash
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "CRASH_KINDS",
    "SLURM_FAILED_STATES",
    "CrashInfo",
    "CrashKind",
    "classify",
    "classify_slurm_task",
    "signal_of",
]

CrashKind = Literal["cuda_assert", "cuda_oom", "host_oom", "environment", "optuna_error", "other"]

#: The kinds :func:`classify` returns, as the ``job_crashed`` detector's ``kind`` names them.
CRASH_KINDS: Final[tuple[str, ...]] = (
    "cuda_assert",
    "cuda_oom",
    "host_oom",
    "environment",
    "optuna_error",
    "other",
)

SLURM_FAILED_STATES: Final = frozenset({"FAILED", "OUT_OF_MEMORY"})
"""The ``JobState`` of a task that died of itself (squeue(1), "JOB STATE CODES"): a
non-zero exit or signal, or the cgroup's OOM kill. ``CANCELLED``, ``TIMEOUT``,
``NODE_FAIL``, ``PREEMPTED`` are Slurm's doing, not a crash."""
_EVIDENCE_MAX: Final = 300
"""Characters of the evidence line kept (kernel assert lines can be long)."""

# Device-side assert: PyTorch's message (c10/cuda/CUDAException.cpp appends
# cudaGetErrorString(cudaErrorAssert) = "device-side assert triggered"), the CUDA error
# name (PyTorch >= 2.6 adds "Search for `cudaErrorAssert' in ..."), and the kernel's own
# assert line as CUDA prints it ("<file>:<line>: <func>: block: [x,y,z], thread: [x,y,z]
# Assertion `<cond>` failed.").
_ASSERT_RES: Final = (
    re.compile(r"device-side assert(?:ion)? triggered", re.IGNORECASE),
    re.compile(r"\bcudaErrorAssert\b"),
    re.compile(r"block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion .* failed"),
)
# CUDA OOM: the caching allocator's message (torch.OutOfMemoryError, c10::OutOfMemoryError)
# and cudaErrorMemoryAllocation through C10_CUDA_CHECK ("CUDA error: out of memory").
_CUDA_OOM_RES: Final = (
    re.compile(r"CUDA out of memory"),
    re.compile(r"CUDA error: out of memory"),
    re.compile(r"\bcudaErrorMemoryAllocation\b"),
    re.compile(r"\b(?:torch\.(?:cuda\.)?)?OutOfMemoryError\b"),
)
# Any other CUDA error raised by PyTorch: torch.AcceleratorError (>= 2.8, c10::AcceleratorError),
# c10::CUDAError (1.x-2.x C++ name), or the generic "CUDA error: <text>" first line.
# A sticky CUDA error (illegal address, launch failure) poisons the context like an assert.
_CUDA_ERROR_RES: Final = (
    re.compile(r"\b(?:torch\.)?AcceleratorError\b"),
    re.compile(r"\bc10::(?:CUDAError|AcceleratorError)\b"),
    re.compile(r"\bCUDA error: "),
)
_HOST_MEMORY_RE: Final = re.compile(r"(?<![A-Za-z])MemoryError\b")
# slurmstepd's word on a task its cgroup's OOM killer hit, written into the task's
# stderr: "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=12.batch. Some of
# your processes may have been killed by the cgroup out-of-memory handler."
_SLURM_OOM_RE: Final = re.compile(r"\boom[-_]kill event", re.IGNORECASE)
# The worker's environment, not its code or the GPU: the messages of errno EROFS, EACCES
# and ENOENT (glibc's strerror, as Python's OSError and the shell print them), CPython's
# "can't open file" for a missing script, an import that cannot be resolved, and SQLite's
# SQLITE_READONLY text (sqlite3.OperationalError: the storage's directory is read-only).
_ENVIRONMENT_RES: Final = (
    re.compile(r"Read-only file system"),
    re.compile(r"Permission denied"),
    re.compile(r"No such file or directory"),
    re.compile(r"can't open file"),
    re.compile(r"\bModuleNotFoundError\b"),
    re.compile(r"attempt to write a readonly database"),
)
# Optuna's own errors, as the uncaught error that ended a worker: ``Study.tell`` on a trial
# that is no longer RUNNING (optuna/study/_tell.py: "Cannot tell a COMPLETE trial.", two
# threads of optimize(n_jobs=2) that took the same re-enqueued trial), and the classes of
# optuna.exceptions (StorageInternalError, UpdateFinishedTrialError: "Trial#3 has already
# finished and can not be updated.", DuplicatedStudyError); never TrialPruned (an ending).
_OPTUNA_RES: Final = (
    re.compile(r"\bCannot tell (?:a [A-Z]+ trial|for trial with number \d+)"),
    re.compile(r"\boptuna\.exceptions\.(?!TrialPruned\b)\w+(?:Error|Exception)\b"),
    re.compile(r"\b(?:StorageInternalError|UpdateFinishedTrialError)\b"),
    re.compile(r"\bTrial#\d+ has already finished and can not be updated\b"),
)
# Signs that the process printed an error of its own before dying.
_ERROR_LINE_RE: Final = re.compile(
    r"^(?:Traceback \(most recent call last\)|terminate called"
    r"|[A-Za-z_][\w.]*(?:Error|Exception)\b)"
)
_PYTHON_EXC_RE: Final = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::|$)")


@dataclass(frozen=True, slots=True)
class CrashInfo:
    """The verdict on one worker death.

    ``kind``: one of :data:`CRASH_KINDS`. ``reason``: one line for people. ``signal``: the
    signal's name (``"SIGKILL"``) when the process died of one (return code ``-N``, or
    ``128+N`` as a shell reports a killed child), else ``None``. ``exit_code``: the exit
    status when the process exited, ``None`` when a signal killed it or it is unknown
    (an adopted worker, which the supervisor cannot ``wait()`` for). ``evidence``: the
    line the verdict rests on, at most 300 characters, or ``""``.
    """

    kind: CrashKind
    reason: str
    signal: str | None = None
    exit_code: int | None = None
    evidence: str = ""

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (``status --json``, the journal)."""
        return {
            "kind": self.kind,
            "reason": self.reason,
            "signal": self.signal,
            "exit_code": self.exit_code,
            "evidence": self.evidence,
        }


def signal_of(returncode: int | None) -> tuple[str | None, int | None, str]:
    """Split a return code into ``(signal name, exit status, description)``.

    ``-N`` (Python's :attr:`subprocess.Popen.returncode` for a child killed by signal N)
    gives the signal's name; ``128+N`` for a real signal N is read as a shell's report of
    a killed child (``bash -c`` exits with 137 when its child got SIGKILL); other values
    are exit statuses. ``None`` (unknown) gives ``(None, None, "exit status unknown")``.
    """
    if returncode is None:
        return None, None, "exit status unknown"
    if returncode < 0:
        name = _signal_name(-returncode)
        return name, None, f"killed by {name}"
    if 128 < returncode <= 128 + 64:
        name = _signal_name(returncode - 128)
        if not name.startswith("signal "):
            return name, None, f"exit status {returncode} (128+{name}: killed by {name})"
    return None, returncode, f"exit status {returncode}"


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _first_match(text: str, patterns: tuple[re.Pattern[str], ...]) -> str | None:
    """The first line of ``text`` matching any of ``patterns`` (stripped), else None."""
    for line in text.splitlines():
        if any(p.search(line) for p in patterns):
            return line.strip()[:_EVIDENCE_MAX]
    return None


def _environment_line(text: str) -> str | None:
    """The line that says the worker died of its environment, else None.

    Only what ended the process counts: the last exception line (the uncaught error) or
    CPython's ``can't open file`` (printed as it gives up on a missing script). Earlier
    lines (a warning that a socket is missing, a retried open) do not, except the error
    that Optuna's ``StorageInternalError`` was raised from (its own message says only
    "An exception is raised during the commit"; SQLite's "attempt to write a readonly
    database" is the line before it).
    """
    errors = _error_lines(text)
    ending = errors[-2:] if errors and "StorageInternalError" in errors[-1] else errors[-1:]
    for line in reversed(ending):
        if any(p.search(line) for p in _ENVIRONMENT_RES):
            return line
    found = None
    for line in text.splitlines():
        if "can't open file" in line:
            found = line.strip()[:_EVIDENCE_MAX]
    return found


def _error_lines(text: str) -> list[str]:
    """The lines that look like an exception (``FooError: ...``) or an abort, in order."""
    found = []
    for line in text.splitlines():
        stripped = line.strip()
        if _PYTHON_EXC_RE.match(stripped) or stripped.startswith("terminate called"):
            found.append(stripped[:_EVIDENCE_MAX])
    return found


def _last_error_line(text: str) -> str:
    """The last line that looks like an exception or an abort, or ``""``."""
    errors = _error_lines(text)
    return errors[-1] if errors else ""


def classify(
    returncode: int | None,
    stderr_tail: str,
    last_exception: str | None = None,
    *,
    oom_kills: int | None = None,
) -> CrashInfo:
    """Classify a worker's death; see the module docstring for the rules and their sources.

    ``returncode``: as :attr:`asyncio.subprocess.Process.returncode` (``-N`` for signal N),
    or ``None`` when unknown. ``stderr_tail``: the last lines of the worker's stderr.
    ``last_exception``: the hook's report of the last exception in the job
    (``"torch.AcceleratorError: CUDA error: ..."``), or ``None``. ``oom_kills``: how many
    processes the kernel OOM killer killed in the worker's cgroup (or system-wide) while it
    ran, or ``None`` when no counter was readable.

    Precedence: a SIGKILL is judged by the OOM rules alone (CUDA errors end in exit status
    1 or SIGABRT, never SIGKILL); otherwise a device-side assert anywhere in the text wins
    (the context was poisoned, later errors are its consequences), then a CUDA OOM, then
    any other CUDA error (``cuda_assert``: sticky, relaunch), then ``MemoryError``
    (``host_oom``), then an environment failure (``environment``: the uncaught error
    says a read-only file system, a permission, a missing file or module, a read-only
    SQLite database, or CPython could not open the script; that line is the evidence),
    then Optuna's own error as the uncaught one (``optuna_error``: ``Cannot tell a
    COMPLETE trial.``, ``optuna.exceptions.StorageInternalError``,
    ``UpdateFinishedTrialError``; that line is the evidence), then ``other``. Never raises.
    """
    sig, exit_code, status = signal_of(returncode)
    text = stderr_tail if last_exception is None else f"{last_exception}\n{stderr_tail}"

    if sig == "SIGKILL":
        if oom_kills is not None:
            if oom_kills > 0:
                return CrashInfo(
                    "host_oom",
                    f"{status}; the kernel OOM killer killed {oom_kills} process(es) "
                    "meanwhile (oom_kill counter)",
                    sig,
                    exit_code,
                )
            return CrashInfo(
                "other",
                f"{status}; no OOM kill counted (kill -9, or a userspace OOM killer)",
                sig,
                exit_code,
            )
        own_error = next(
            (ln.strip() for ln in text.splitlines() if _ERROR_LINE_RE.match(ln.strip())), None
        )
        if own_error is None:
            return CrashInfo(
                "host_oom",
                f"{status} without an error message of its own (likely the kernel OOM "
                "killer; no oom_kill counter readable)",
                sig,
                exit_code,
            )
        return CrashInfo(
            "other", f"{status} after printing an error", sig, exit_code, own_error[:_EVIDENCE_MAX]
        )

    line = _first_match(text, _ASSERT_RES)
    if line is not None:
        return CrashInfo(
            "cuda_assert",
            f"CUDA device-side assert ({status}); the CUDA context is unusable, "
            "the process must be relaunched",
            sig,
            exit_code,
            _best_assert_evidence(text, line),
        )
    line = _first_match(text, _CUDA_OOM_RES)
    if line is not None:
        return CrashInfo("cuda_oom", f"CUDA out of memory ({status})", sig, exit_code, line)
    line = _first_match(text, _CUDA_ERROR_RES)
    if line is not None:
        return CrashInfo(
            "cuda_assert",
            f"CUDA error ({status}); a sticky CUDA error leaves the context unusable, "
            "the process must be relaunched",
            sig,
            exit_code,
            line,
        )
    line = _first_match(text, (_HOST_MEMORY_RE,))
    if line is not None:
        return CrashInfo(
            "host_oom", f"host memory allocation failed ({status})", sig, exit_code, line
        )
    line = _environment_line(text)
    if line is not None:
        return CrashInfo(
            "environment",
            f"environment failure ({status}): {line}"[:_EVIDENCE_MAX],
            sig,
            exit_code,
            line,
        )
    errors = _error_lines(text)
    last = errors[-1] if errors else ""
    if last and any(p.search(last) for p in _OPTUNA_RES):
        cause = errors[-2] if "StorageInternalError" in last and len(errors) > 1 else ""
        reason = f"Optuna error ({status}): " + (f"{cause} -> {last}" if cause else last)
        return CrashInfo("optuna_error", reason[:_EVIDENCE_MAX], sig, exit_code, last)
    reason = f"{status}: {last}" if last else status
    return CrashInfo("other", reason[:_EVIDENCE_MAX], sig, exit_code, last)


def _best_assert_evidence(text: str, first: str) -> str:
    """Prefer the kernel's own assert line (file, line, condition) as evidence."""
    kernel = _first_match(text, (_ASSERT_RES[2],))
    return kernel if kernel is not None else first


def classify_slurm_task(state: str, returncode: int | None, output_tail: str) -> CrashInfo:
    """Classify a Slurm task's death from what Slurm kept of it (pure, never raises).

    ``state``: its ``JobState`` (sacct's or scontrol's). ``returncode``: the batch
    script's, as :func:`classify` takes it (``ExitCode=0:9`` is ``-9``). ``output_tail``:
    the end of its stderr file (``sbatch -e``/``-o``), ``""`` if unreadable. A host OOM
    is ``OUT_OF_MEMORY`` or slurmstepd's ``oom-kill event`` line; anything else is
    :func:`classify`'s verdict (exit 137 without an error of its own: ``host_oom``), its
    reason prefixed ``Slurm <state>``.
    """
    sig, exit_code, status = signal_of(returncode)
    line = _first_match(output_tail, (_SLURM_OOM_RE,))
    if state == "OUT_OF_MEMORY" or line is not None:
        reason = f"Slurm {state}: {status}; " + (line or "the cgroup's OOM killer")
        return CrashInfo("host_oom", reason[:_EVIDENCE_MAX], sig, exit_code, line or "")
    info = classify(returncode, output_tail)
    return CrashInfo(
        info.kind,
        f"Slurm {state}: {info.reason}"[:_EVIDENCE_MAX],
        info.signal,
        info.exit_code,
        info.evidence,
    )
