"""Worker output files (gpuwatchd.jobs.output): the in-memory stderr tail."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.jobs.output import StderrTail


def test_stderr_tail_keeps_the_last_lines_and_survives_truncation(tmp_path: Path) -> None:
    path = tmp_path / "err"
    path.write_text("".join(f"old {i}\n" for i in range(500)))
    tail = StderrTail(path, lines=5, start_at_end=False)
    assert tail.text().splitlines() == [f"old {i}" for i in range(495, 500)]
    with path.open("a") as f:
        f.write("new 1\nnew 2 partial")
    tail.update()
    assert tail.text().splitlines()[-2:] == ["new 1", "new 2 partial"]
    path.write_text("after truncate\n")
    tail.update()
    assert tail.text().splitlines()[-1] == "after truncate"
