"""Reading policy files: the I/O edge of the pure :mod:`gpuwatchd.policy` package.

:func:`load_policies` finds and reads the files (a directory contributes its
``*.yaml``, sorted), then hands the text to :func:`~gpuwatchd.policy.schema.parse_policies`
and :func:`~gpuwatchd.policy.schema.merge_policy_sets`, which do no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpuwatchd.config import DEFAULT_POLICY_DIR
from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import PolicySet, merge_policy_sets, parse_policies

__all__ = ["default_policy_path", "load_policies", "resolve_policy_paths"]


def _policy_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.glob("*.yaml") if p.is_file())
    if path.exists():
        return [path]
    raise PolicyError("no such policy file or directory", path=str(path))


def load_policies(paths: Sequence[str | Path]) -> PolicySet:
    """Read and validate policy files; a directory contributes its ``*.yaml`` files, sorted.

    Names must be unique across all files. All or nothing: any unreadable file or
    invalid policy raises :class:`~gpuwatchd.errors.PolicyError` (file and line) and
    nothing is returned, so a failed reload leaves the running policies in place.
    ``sources`` lists the files read, in order.
    """
    parsed: list[PolicySet] = []
    for entry in paths:
        for file in _policy_files(Path(entry)):
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise PolicyError(f"cannot read policy file: {exc}", path=str(file)) from None
            parsed.append(parse_policies(text, str(file)))
    return merge_policy_sets(parsed)


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
