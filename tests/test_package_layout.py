"""The package's layout stays navigable (issue 9): no module over 600 lines, the ``Daemon``
class is wiring only (under 300 lines), and every control op has its own module and test."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpuwatchd"
MAX_MODULE_LINES = 600
MAX_DAEMON_CLASS_LINES = 300


def oversized(package: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``"path: N lines"`` for each ``*.py`` under ``package`` longer than ``limit`` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(package.parent).as_posix()}: {lines} lines")
    return found


def class_lines(path: Path, name: str) -> int:
    """Lines of the class ``name`` defined at the top level of ``path`` (decorators excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            assert node.end_lineno is not None
            return node.end_lineno - node.lineno + 1
    raise LookupError(f"no class {name} in {path}")


def test_no_module_is_over_600_lines() -> None:
    assert oversized(PACKAGE) == [], "split these along their concepts (docs/modules.md)"


def test_the_size_check_finds_a_long_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES, encoding="utf-8")
    (package / "sub" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1), encoding="utf-8")
    assert oversized(package) == [f"pkg/sub/long.py: {MAX_MODULE_LINES + 1} lines"]


def test_the_daemon_class_is_under_300_lines() -> None:
    lines = class_lines(PACKAGE / "daemon" / "__init__.py", "Daemon")
    assert lines < MAX_DAEMON_CLASS_LINES, f"Daemon is {lines} lines: move work out of it"


def test_every_control_op_has_its_own_module_and_test() -> None:
    ops = sorted(
        p.stem for p in (PACKAGE / "daemon" / "ops").glob("*.py") if p.name != "__init__.py"
    )
    assert {"status", "events", "knob", "policy", "pause"} <= set(ops)
    missing = [op for op in ops if not (REPO / "tests" / f"test_daemon_ops_{op}.py").is_file()]
    assert missing == [], f"ops without tests/test_daemon_ops_<op>.py: {missing}"
