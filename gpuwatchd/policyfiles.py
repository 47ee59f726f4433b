"""Reading policy files: the I/O edge of the pure :mod:`gpuwatchd.policy` package.

:func:`load_policies` finds and reads the files (a directory contributes its
``*.yaml``, sorted), then hands the text to :func:`~gpuwatchd.policy.schema.parse_policies`
and :func:`~gpuwatchd.policy.schema.merge_policy_sets`, which do no I/O.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from gpuwatchd.config import DEFAULT_POLICY_DIR
from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import PolicySet, merge_policy_sets, parse_policies

__all__ = [
    "MAX_POLICY_FILES",
    "MAX_POLICY_FILE_BYTES",
    "default_policy_path",
    "load_policies",
    "read_policy_file",
    "resolve_policy_paths",
]

MAX_POLICY_FILE_BYTES: Final = 1024 * 1024
"""The largest policy file read (the shipped default is about 5 KiB)."""
MAX_POLICY_FILES: Final = 256
"""The most ``*.yaml`` files one directory may contribute."""
_MAX_MESSAGE_CHARS: Final = 1000
"""A policy error's message is cut to this many characters (it is logged and replied)."""


def _policy_files(path: Path) -> list[Path]:
    if path.is_dir():
        # Everything named *.yaml but a directory: a FIFO or device is refused by name below.
        files = sorted(p for p in path.glob("*.yaml") if not p.is_dir())
        if len(files) > MAX_POLICY_FILES:
            raise PolicyError(
                f"more than {MAX_POLICY_FILES} *.yaml files in the directory", path=str(path)
            )
        return files
    if path.exists() or path.is_symlink():
        return [path]
    raise PolicyError("no such policy file or directory", path=str(path))


def read_policy_file(path: Path) -> str:
    """The UTF-8 text of the policy file ``path``, read within bounds.

    Opened with ``O_NONBLOCK`` (a FIFO does not wait for a writer) and checked with
    ``fstat`` on the open file (no race with a rename): only a regular file of at most
    :data:`MAX_POLICY_FILE_BYTES` is read; a symlink is followed to what it names, so
    one to ``/dev/zero`` is refused as a character device. Raises
    :class:`~gpuwatchd.errors.PolicyError` (with ``path``) otherwise.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise PolicyError(
            f"cannot read policy file: {exc.strerror or exc}", path=str(path)
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PolicyError("not a regular file; refused", path=str(path))
        if info.st_size > MAX_POLICY_FILE_BYTES:
            raise PolicyError(
                f"policy file of {info.st_size} bytes is over the limit of "
                f"{MAX_POLICY_FILE_BYTES} bytes; refused",
                path=str(path),
            )
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_POLICY_FILE_BYTES:  # it grew while being read
                raise PolicyError(
                    f"policy file is over the limit of {MAX_POLICY_FILE_BYTES} bytes; refused",
                    path=str(path),
                )
        return b"".join(chunks).decode("utf-8")
    except OSError as exc:
        raise PolicyError(
            f"cannot read policy file: {exc.strerror or exc}", path=str(path)
        ) from None
    except UnicodeDecodeError as exc:
        raise PolicyError(
            f"cannot read policy file: not UTF-8 ({exc.reason})", path=str(path)
        ) from None
    finally:
        os.close(fd)


def _bounded(exc: PolicyError) -> PolicyError:
    if len(exc.message) <= _MAX_MESSAGE_CHARS:
        return exc
    short = exc.message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return PolicyError(short, path=exc.path, line=exc.line)


def load_policies(paths: Sequence[str | Path]) -> PolicySet:
    """Read and validate policy files; a directory contributes its ``*.yaml`` files, sorted.

    Names must be unique across all files. All or nothing: any unreadable file or
    invalid policy raises :class:`~gpuwatchd.errors.PolicyError` (file and line) and
    nothing is returned, so a failed reload leaves the running policies in place.
    ``sources`` lists the files read, in order.

    Files are read with :func:`read_policy_file` (regular files, size-capped, never
    blocking) and parsed with the bounded YAML loader (:mod:`gpuwatchd.yamlsrc`);
    messages are cut to 1000 characters.
    """
    parsed: list[PolicySet] = []
    for entry in paths:
        for file in _policy_files(Path(entry)):
            text = read_policy_file(file)
            try:
                parsed.append(parse_policies(text, str(file)))
            except PolicyError as exc:
                raise _bounded(exc) from None
            except RecursionError:  # defence in depth: yamlsrc refuses deep nesting first
                raise PolicyError("policy nested too deeply", path=str(file)) from None
    try:
        return merge_policy_sets(parsed)
    except PolicyError as exc:
        raise _bounded(exc) from None


def default_policy_path() -> Path:
    """The shipped ``default.yaml``: ``gpuwatchd/policies/`` in an installed wheel, else
    the repository's top-level ``policies/`` (a source checkout or an editable install).
    """
    package = Path(__file__).resolve().parent
    installed = package / "policies" / "default.yaml"
    return installed if installed.is_file() else package.parent / "policies" / "default.yaml"


def resolve_policy_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """Return the policy sources to load: ``paths``, else the system directory, else the default.

    The system directory (``/etc/gpuwatchd/policies.d``) counts only when it holds
    ``*.yaml`` files; otherwise the packaged ``policies/default.yaml`` is used.
    """
    if paths:
        return tuple(paths)
    system_dir = Path(DEFAULT_POLICY_DIR)
    if system_dir.is_dir() and any(system_dir.glob("*.yaml")):
        return (str(system_dir),)
    return (str(default_policy_path()),)
