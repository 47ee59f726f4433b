"""A worker's stdout/stderr files: opened for the child, size-capped, stderr tail in memory.

The worker writes to the files itself (they are its fds 1 and 2, opened ``O_APPEND``);
the daemon never sits in the middle of a pipe. That is deliberate: if the daemon dies
(SIGKILL, OOM, a bug), a pipe would break and the worker's next ``print`` would fail with
``BrokenPipeError`` and kill it; a file keeps working, and the next daemon finds the
output in place.

Consequences: rotation is *copy-truncate* (as logrotate's ``copytruncate``): when a file
exceeds its cap, it is copied to ``<name>.1`` and truncated in place; thanks to
``O_APPEND`` the worker goes on writing at the new end. Lines written between the copy and
the truncate are lost (a window of microseconds), and the cap is checked when the
supervisor polls, so a file can overshoot it by what the worker writes in one poll
interval. The stderr tail (the last :data:`TAIL_LINES` lines) is kept in memory by
reading what was appended since the last poll.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_OUTPUT_MAX_BYTES", "TAIL_LINES", "OutputFiles", "StderrTail"]

TAIL_LINES: Final = 200
"""Lines of stderr kept in memory per worker for crash classification."""

DEFAULT_OUTPUT_MAX_BYTES: Final = 64 * 2**20
"""Size cap per output file (64 MiB) before it is rotated to ``<name>.1``."""

_READ_CHUNK: Final = 1 << 20
_MAX_LINE: Final = 4096
"""Characters kept of one stderr line (a kernel's assert spam can be very long)."""


class StderrTail:
    """The last ``lines`` lines of a file that another process appends to.

    :meth:`update` reads what was appended since the previous call (and starts over when
    the file shrank: it was rotated or truncated). ``start_at_end=False`` reads the file's
    existing last lines first; ``start_at`` reads from that byte offset (an adopted
    worker's launch recorded where its output began: an earlier launch's lines in the
    same file are not its evidence).
    """

    def __init__(
        self,
        path: Path,
        *,
        lines: int = TAIL_LINES,
        start_at_end: bool = True,
        start_at: int | None = None,
    ) -> None:
        self.path = path
        self._lines: deque[str] = deque(maxlen=lines)
        self._partial = ""
        self._offset = 0
        self._skip_to_newline = False
        if start_at is not None:
            # One launch's output only: from where the file ended when it started (a
            # file shorter than that was rotated since: read it all).
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            self._offset = start_at if 0 <= start_at <= size else 0
            self.update()
        elif start_at_end:
            try:
                self._offset = path.stat().st_size
            except OSError:
                self._offset = 0
        else:
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            # Enough bytes for `lines` ordinary lines; the first (partial) one is dropped.
            self._offset = max(0, size - lines * 256)
            self._skip_to_newline = self._offset > 0
            self.update()

    def update(self) -> None:
        """Read newly appended bytes into the tail. Never raises (a missing file is empty)."""
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # rotated or truncated under us
                    self._offset = 0
                    self._partial = ""
                if size == self._offset:
                    return
                # A huge burst: only its end can matter for the tail.
                budget = max(_READ_CHUNK, self._lines.maxlen or TAIL_LINES * _MAX_LINE)
                if size - self._offset > budget:
                    self._offset = size - budget
                    self._partial = ""
                    self._skip_to_newline = True
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except OSError:
            return
        self._offset += len(data)
        if self._skip_to_newline:  # we started mid-line: drop up to the first newline
            cut = data.find(b"\n")
            if cut < 0:
                return
            data = data[cut + 1 :]
            self._skip_to_newline = False
        text = self._partial + data.decode("utf-8", "replace")
        parts = text.split("\n")
        self._partial = parts.pop()[-_MAX_LINE:]
        for line in parts:
            self._lines.append(line[:_MAX_LINE])

    @property
    def offset(self) -> int:
        """Bytes of the file read so far (where the next :meth:`update` starts)."""
        return self._offset

    def reset_offset(self) -> None:
        """Forget the read position (the file was just truncated by its owner)."""
        self._offset = 0

    def text(self) -> str:
        """The tail as one string (lines joined by ``\\n``, the unfinished last line included)."""
        lines = list(self._lines)
        if self._partial:
            lines.append(self._partial)
        return "\n".join(lines)


class OutputFiles:
    """``<dir>/worker-<n>.out`` and ``.err`` of one worker, with copy-truncate rotation."""

    def __init__(self, directory: Path, worker: int, *, max_bytes: int) -> None:
        self.out = directory / f"worker-{worker}.out"
        self.err = directory / f"worker-{worker}.err"
        self.max_bytes = max_bytes

    def open_for_child(self) -> tuple[int, int]:
        """Open both files ``O_WRONLY|O_APPEND|O_CREAT`` (mode 0640) and return the fds.

        The caller passes them as the child's stdout and stderr and closes them afterwards.
        Raises :class:`OSError` when a file cannot be opened.
        """
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        out = os.open(self.out, flags, 0o640)
        try:
            err = os.open(self.err, flags, 0o640)
        except OSError:
            os.close(out)
            raise
        return out, err

    def rotate_if_needed(self, tail: StderrTail | None) -> list[Path]:
        """Copy-truncate each file over the cap to ``<name>.1``; return the rotated paths.

        ``tail`` (the stderr tail) is brought up to date first and rewound after the
        truncate, so no line is counted twice. Errors are swallowed (tried again next poll).
        """
        rotated: list[Path] = []
        for path in (self.out, self.err):
            try:
                if path.stat().st_size <= self.max_bytes:
                    continue
                if tail is not None and path == self.err:
                    tail.update()
                shutil.copyfile(path, path.with_name(path.name + ".1"))
                with path.open("r+b") as f:
                    f.truncate(0)
                if tail is not None and path == self.err:
                    tail.reset_offset()
                rotated.append(path)
            except OSError:
                continue
        return rotated
