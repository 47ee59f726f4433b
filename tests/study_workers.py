"""Real Optuna worker subprocesses for the study tests (test_study.py, test_study_retries.py);
not a test module.

Each worker is a script run as a user runs it (``tests/optuna_worker.py`` by default, or
``tests/optuna_checkpoint_worker.py``), its output in ``worker<N>.log`` of the test's temp
dir; a worker "dies mid-trial" by writing its trial number to a mark file and hanging until
the test SIGKILLs it, as a dead CUDA process leaves its trial RUNNING.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OPTUNA_WORKER = TESTS / "optuna_worker.py"
CHECKPOINT_WORKER = TESTS / "optuna_checkpoint_worker.py"


class Workers:
    """Worker subprocesses of one test, killed at the end (:meth:`close`) whatever happens."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        url: str,
        study: str,
        *args: str,
        env: dict[str, str] | None = None,
        script: Path = OPTUNA_WORKER,
    ) -> subprocess.Popen[bytes]:
        """``python SCRIPT URL STUDY ARGS...`` with ``env`` over this process's environment."""
        log = (self.tmp_path / f"worker{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, str(script), url, study, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {})),
        )
        self.procs.append(proc)
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        """What ``proc`` printed so far (stdout and stderr)."""
        return (self.tmp_path / f"worker{self.procs.index(proc)}.log").read_text()

    def wait_mark(self, proc: subprocess.Popen[bytes], mark: Path, timeout_s: float = 30) -> int:
        """The trial number the worker wrote to ``mark`` (it is in the middle of that trial).

        Raises AssertionError (with every worker's output) when the worker exits first, or
        after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not mark.exists():
            if proc.poll() is not None:
                logs = "\n".join(p.read_text() for p in self.tmp_path.glob("worker*.log"))
                raise AssertionError(f"worker exited {proc.returncode} before {mark}:\n{logs}")
            assert time.monotonic() < deadline, f"no {mark} after {timeout_s}s"
            time.sleep(0.02)
        return int(mark.read_text())

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL ``proc`` and reap it."""
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL

    def die_in_trial(self, proc: subprocess.Popen[bytes], mark: Path) -> int:
        """:meth:`wait_mark` (up to 90 s: a PyTorch worker imports for a while), then
        :meth:`kill`: the worker dies mid-trial. Returns that trial's number."""
        number = self.wait_mark(proc, mark, timeout_s=90)
        self.kill(proc)
        return number

    def finish(self, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> str:
        """Wait for ``proc`` to exit 0 (AssertionError with its output otherwise); its output."""
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker still running:\n{self.output(proc)}") from None
        assert code == 0, f"worker exited {code}:\n{self.output(proc)}"
        return self.output(proc)

    def close(self) -> None:
        """Kill and reap the workers still running."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
