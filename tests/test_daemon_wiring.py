"""The daemon is wired explicitly (issue 20/21): its parts get objects made before them,
never a lambda or a bound method of the Daemon that calls back into it later, and no part
takes the Daemon itself (docs/daemon-internals.md, "Wiring")."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from gpuwatchd.cordon import CordonActions
from gpuwatchd.daemon.metrics import MetricsExport
from gpuwatchd.daemon.restore import JournalKeeper
from gpuwatchd.daemon.tick import Ticker
from gpuwatchd.jobs.crashes import CrashHandler
from gpuwatchd.jobs.runner import JobRunner
from gpuwatchd.jobs.supervisor import Supervisor

REPO = Path(__file__).resolve().parent.parent
DAEMON = REPO / "gpuwatchd" / "daemon" / "__init__.py"

ALLOWED = frozenset({("ControlServer", "handle")})
"""(constructor, Daemon method) pairs that are the wiring itself: the control server's
request handler is the daemon's control-op entry (``ops.dispatch`` over it)."""

OLD_WIRING = '''
class Daemon:
    def __init__(self, settings):
        self.supervisor = Supervisor(
            settings.jobs,
            drain_worker=lambda job, pid: self.jobs.drain_worker(job, pid),
            cordoned=self._cordoned_indexes,
        )
        self.metrics = MetricsExport(self, 0.0, None)

    def _cordoned_indexes(self):
        return frozenset()
'''
"""What the daemon's wiring looked like before (main at c8f5737), cut down."""


def wiring_faults(source: str) -> list[str]:
    """What in ``source`` (a module defining ``class Daemon``) wires by late binding: every
    lambda, every constructor call (a capitalised name) given the Daemon (``self``) or one
    of its bound methods (``self.name`` for a ``def`` of the class), every ``x.on_... =``
    rebinding of another object's callback."""
    tree = ast.parse(source)
    faults = [f"line {n.lineno}: lambda" for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
    daemon = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Daemon"
    )
    methods = {
        n.name for n in daemon.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }

    def bound(node: ast.expr) -> str | None:
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr in methods
        ):
            return node.attr
        return None

    for node in ast.walk(daemon):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            ctor = node.func.id
            if not ctor[:1].isupper():
                continue
            values = [*node.args, *(k.value for k in node.keywords)]
            for value in values:
                if isinstance(value, ast.Name) and value.id == "self":
                    faults.append(f"line {node.lineno}: {ctor} is given the Daemon")
                method = bound(value)
                if method is not None and (ctor, method) not in ALLOWED:
                    faults.append(f"line {node.lineno}: {ctor} is given Daemon.{method}")
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr.startswith("on_")
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    faults.append(f"line {node.lineno}: rebinds {target.attr}")
    return faults


def test_the_checker_names_the_old_late_bound_wiring() -> None:
    faults = wiring_faults(OLD_WIRING)
    assert any("lambda" in f for f in faults)
    assert any("Supervisor is given Daemon._cordoned_indexes" in f for f in faults)
    assert any("MetricsExport is given the Daemon" in f for f in faults)


def test_the_daemon_wires_its_parts_with_objects_not_callbacks() -> None:
    assert wiring_faults(DAEMON.read_text(encoding="utf-8")) == []


def test_the_parts_take_no_callable_in_place_of_a_part() -> None:
    """The constructors of the parts the daemon wires take objects: the only callables
    they accept are clocks (and the actuator's outcome callback, outside this list)."""
    for part in (Ticker, CrashHandler, JobRunner, Supervisor, CordonActions, JournalKeeper):
        for name, param in inspect.signature(part.__init__).parameters.items():
            annotation = str(param.annotation)
            if name != "clock":
                assert "Callable" not in annotation, f"{part.__name__}({name}: {annotation})"
    params = inspect.signature(MetricsExport.__init__).parameters
    assert "daemon" not in params and str(params["sources"].annotation) == "MetricsSources"
