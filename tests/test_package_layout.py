"""The package's layout stays navigable: no import cycle (imports inside functions
included), and every control op has its own module and test."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpuwatchd"
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset(
    {
        frozenset({"gpuwatchd.backtest", "gpuwatchd.backtest_arrays"}),
        frozenset(
            {
                "gpuwatchd.sampling.columns",
                "gpuwatchd.sampling.replay",
                "gpuwatchd.sampling.replay_arrow",
            }
        ),
    }
)
"""Import cycles that exist today and are to be broken (issue 21); none may be added."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (inside functions too;
    ``if TYPE_CHECKING:`` blocks excluded: they do not run)."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for b in node.body for n in ast.walk(b))
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import sub`` imports the submodule; ``from pkg import name``
                # the package itself (its __init__ runs either way for any submodule)
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in modules else node.module for t in subs]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith(package.name):
                    found.add(target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_new_import_cycle() -> None:
    """Concepts, not line counts, shape the package (issue 20: nothing is split to pass a
    line count, so that rule is gone); what it protected, modules a reader can take one
    at a time, is kept by refusing import cycles, imports inside functions included."""
    found = cycles(import_graph(PACKAGE))
    assert found - KNOWN_CYCLES == set(), sorted(sorted(c) for c in found - KNOWN_CYCLES)


def test_the_cycle_check_finds_a_cycle_through_a_function_import(tmp_path: Path) -> None:
    package = tmp_path / "gpuwatchd"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from gpuwatchd.b import x\n")
    (package / "b.py").write_text("def x():\n    from gpuwatchd import a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuwatchd import a\n"
    )
    assert cycles(import_graph(package)) == {frozenset({"gpuwatchd.a", "gpuwatchd.b"})}


def test_every_control_op_has_its_own_module_and_test() -> None:
    ops = sorted(
        p.stem for p in (PACKAGE / "daemon" / "ops").glob("*.py") if p.name != "__init__.py"
    )
    assert {"status", "events", "knob", "policy", "pause"} <= set(ops)
    missing = [op for op in ops if not (REPO / "tests" / f"test_daemon_ops_{op}.py").is_file()]
    assert missing == [], f"ops without tests/test_daemon_ops_<op>.py: {missing}"


WIRE_MODULE = "gpuwatchd.control.protocol"
"""The wire contract: everything the hook, the clients and the server share."""
PER_MODULE_NAMES: dict[str, str] = {
    "NAMES": "gpuwatchd.daemon.ops.",  # each op module's ops (gpuwatchd/daemon/ops/__init__.py)
    "SPEC": "gpuwatchd.policy.actions.",  # each action module's spec (policy/actions/spec.py)
}
"""Names every module of a package defines by its convention: one per module, not one value."""
KNOWN_DUPLICATES: dict[str, frozenset[str]] = {
    "RESUME_WINDOW_S": frozenset({"gpuwatchd.cordon", "gpuwatchd.daemon.restore"}),
    "JOB": frozenset({"gpuwatchd.control.knobmemory", "gpuwatchd.policy.actions.set_knob"}),
}
"""Upper-case names defined in more than one module today (to be made
one or renamed, issue 21); none may be added."""


def constant_definitions(package: Path) -> dict[str, set[str]]:
    """Public upper-case name -> the modules that define it at module level (an
    assignment, or a class attribute of a module-level class as ``Op.HELLO`` is not
    counted: only module names)."""
    root = package.parent
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        module = _module_name(path, root)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    name = target.id
                    if name.isupper() and not name.startswith("_") and len(name) > 1:
                        found.setdefault(name, set()).add(module)
    return found


def test_each_constant_is_defined_in_one_module() -> None:
    """Issue 21: the wire contract lived in three places (the socket path in config.py,
    control/client.py and hook/_watch.py; the event message limit in control/messages.py
    and hook/_watch.py). Each upper-case constant is now defined once and imported where
    it is used; a second definition of the same name fails here."""
    found = constant_definitions(PACKAGE)
    twice = {
        name: sorted(modules)
        for name, modules in found.items()
        if len(modules) > 1
        and modules != KNOWN_DUPLICATES.get(name)
        and not all(m.startswith(PER_MODULE_NAMES.get(name, "-")) for m in modules)
    }
    assert twice == {}, twice
    wire = {name for name, modules in found.items() if WIRE_MODULE in modules}
    assert {"DEFAULT_SOCKET_PATH", "SOCKET_ENV", "EVENT_MESSAGE_MAX_CHARS", "ADMIN_OPS"} <= wire


def test_the_duplicate_check_finds_a_second_definition(tmp_path: Path) -> None:
    hook = 'from typing import Final\nDEFAULT_SOCKET_PATH: Final = "/run/x.sock"\n_PRIVATE = 2\n'
    wire = 'DEFAULT_SOCKET_PATH = "/run/x.sock"\n_PRIVATE = 1\n'
    package = fake_package(tmp_path, {"wire.py": wire, "hook/w.py": hook})
    assert constant_definitions(package) == {
        "DEFAULT_SOCKET_PATH": {"gpuwatchd.wire", "gpuwatchd.hook.w"}
    }


def _op_names() -> set[str]:
    from gpuwatchd.control.protocol import Op

    return {v for k, v in vars(Op).items() if k.isupper() and isinstance(v, str)}


def literal_op_uses(package: Path, ops: set[str]) -> list[str]:
    """Where an op's name is written as a string instead of ``Op.X``: the op argument of
    ``.call(op)``, ``request(id, op)`` and ``send_command(job, op)``, a comparison with
    ``op``/``.op``, an op module's ``NAMES`` and any string equal to a dotted op name."""
    dotted = {op for op in ops if "." in op}
    out: list[str] = []
    for path in sorted(package.rglob("*.py")):
        if _module_name(path, package.parent) == WIRE_MODULE:
            continue
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            strings: list[ast.expr] = []
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func).rpartition(".")[2]
                index = {"call": 0, "request": 1, "send_command": 1}.get(name)
                if index is not None and len(node.args) > index:
                    strings = [node.args[index]]
            elif isinstance(node, ast.Compare) and ast.unparse(node.left).endswith("op"):
                strings = list(node.comparators)
                strings += [e for c in node.comparators if isinstance(c, ast.Tuple) for e in c.elts]
            elif isinstance(node, ast.AnnAssign | ast.Assign):
                targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                if any(isinstance(t, ast.Name) and t.id == "NAMES" for t in targets):
                    value = node.value
                    strings = list(value.elts) if isinstance(value, ast.Tuple) else []
            elif isinstance(node, ast.Constant) and node.value in dotted:
                strings = [node]
            for s in strings:
                if isinstance(s, ast.Constant) and s.value in ops:
                    out.append(f"{where}:{s.lineno}: {s.value!r}")
    return sorted(set(out))


def test_op_names_are_written_once() -> None:
    """An op's name is ``gpuwatchd.control.protocol.Op``'s, not a string repeated in
    gpuwatchctl's commands, the server, the daemon's op modules and the hook."""
    assert literal_op_uses(PACKAGE, _op_names()) == []


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A ``gpuwatchd`` package under ``tmp_path`` with ``files`` (path -> text)."""
    package = tmp_path / "gpuwatchd"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_op_check_finds_a_literal_op(tmp_path: Path) -> None:
    text = (
        "def run(client, req):\n"
        '    client.call("status")\n'
        '    if req.op == "hello":\n'
        "        pass\n"
        'NAMES = ("gpu.cordon",)\n'
        'HELP = "see policy.show"\n'
        'client.call(Op.STATUS, status="status")\n'
    )
    package = fake_package(tmp_path, {"cmd.py": text})
    assert literal_op_uses(package, _op_names()) == [
        "gpuwatchd/cmd.py:2: 'status'",
        "gpuwatchd/cmd.py:3: 'hello'",
        "gpuwatchd/cmd.py:5: 'gpu.cordon'",
    ]


KNOWN_DECLARING_BASES: frozenset[str] = frozenset({"gpuwatchd.journal.queries.JournalQueries"})
"""Bases that only declare attributes a subclass sets, still there (issue 21); none may
be added."""


def declaring_bases(package: Path) -> set[str]:
    """``module.Class`` of every class of the package that another class of it inherits
    from, that declares attributes without a value (``name: type``) and has no
    ``__init__`` of its own: its state is set by a subclass. Protocols and dataclasses
    (whose annotations are their fields) are not counted."""
    root = package.parent
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in package.rglob("*.py"):
        module = _module_name(path, root)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((module, node))

    def declares_only(node: ast.ClassDef) -> bool:
        if any(ast.unparse(b).endswith("Protocol") for b in node.bases):
            return False
        if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            return False
        declared = [s for s in node.body if isinstance(s, ast.AnnAssign) and s.value is None]
        has_init = any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in node.body)
        return bool(declared) and not has_init

    found: set[str] = set()
    for defs in classes.values():
        for _module, node in defs:
            for base in node.bases:
                for base_module, base_node in classes.get(ast.unparse(base).rpartition(".")[2], []):
                    if declares_only(base_node):
                        found.add(f"{base_module}.{base_node.name}")
    return found


def test_no_class_is_assembled_from_attribute_declaring_bases() -> None:
    """Issue 21: ``Watch`` was built from mixins whose attributes were re-declared "set by
    the subclass"; its daemon session and OOM handler are now members with their own
    state, as is the adapters' watch owner."""
    assert declaring_bases(PACKAGE) - KNOWN_DECLARING_BASES == set()


def test_the_base_check_finds_a_mixin(tmp_path: Path) -> None:
    text = (
        "from dataclasses import dataclass\n"
        "from typing import Protocol\n"
        "class Mixin:\n    x: int\n    def f(self): return self.x\n"
        "class Owned:\n    x: int\n    def __init__(self): self.x = 1\n"
        "class P(Protocol):\n    x: int\n"
        "@dataclass\nclass D:\n    x: int\n"
        "class W(Mixin, Owned, D):\n    def __init__(self): self.x = 2\n"
        "class Q(P):\n    pass\n"
    )
    package = fake_package(tmp_path, {"m.py": text})
    assert declaring_bases(package) == {"gpuwatchd.m.Mixin"}


ACTIONS_DIR = PACKAGE / "policy" / "actions"
ACTION_HELPERS = frozenset({"__init__", "spec", "params", "ladder"})
"""Modules of gpuwatchd/policy/actions/ that are not actions: the registry, the spec and
the interfaces, the param parsers, the ladder both parallelism actions move."""
DISPATCHERS = (
    "policy/engine.py",
    "policy/decisions.py",
    "policy/accounting.py",
    "policy/schema.py",
    "policy/reference.py",
    "policy/policies.py",
    "actuators.py",
    "cordon.py",
)
"""Modules that handle every action; they go through the registry and name none."""
PURE_PREFIXES = ("gpuwatchd.policy.", "gpuwatchd.detectors")
PURE_CORE = frozenset(
    f"gpuwatchd.{m}"
    for m in (
        "model",
        "errors",
        "units",
        "windows",
        "crash",
        "xid",
        "control.knobmemory",
        "control.protocol",
    )
)
"""The pure core the action modules may reach (design: no I/O, a clock injected)."""
IO_MODULES = ("asyncio", "os", "socket", "sqlite3", "subprocess", "psutil", "pynvml", "apprise")


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_every_policy_action_is_one_registered_module_with_its_own_test() -> None:
    """Adding an action is one module in gpuwatchd/policy/actions/ (its SPEC: params,
    decide, carry_out; its docstring the contract), one line in MODULES, and its test
    tests/test_action_<name>.py; the modules that handle every action name none."""
    from gpuwatchd.policy.actions import ACTIONS, MODULES

    files = {p.stem for p in ACTIONS_DIR.glob("*.py")} - ACTION_HELPERS
    registered = [m.__name__.rpartition(".")[2] for m in MODULES]
    assert sorted(registered) == sorted(files), "an action module missing from MODULES"
    assert list(ACTIONS) == registered, "an action's SPEC.name differs from its module's name"
    for module in MODULES:
        assert module.__doc__ and module.SPEC.decide.__module__ == module.__name__
    missing = [n for n in registered if not (REPO / "tests" / f"test_action_{n}.py").is_file()]
    assert missing == [], f"actions without tests/test_action_<name>.py: {missing}"
    named = {
        where: sorted(_string_constants(PACKAGE / where) & set(ACTIONS)) for where in DISPATCHERS
    }
    assert {w: n for w, n in named.items() if n} == {}, "dispatch through the registry"


def test_the_action_modules_stay_pure() -> None:
    """The policy engine imports the action modules, so they do no I/O: the carrying-out
    gets its collaborators passed in (gpuwatchd/policy/actions/spec.py, Effects)."""
    graph = import_graph(PACKAGE)
    seen: set[str] = set()
    todo = ["gpuwatchd.policy.actions"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    impure = sorted(m for m in seen if not m.startswith(PURE_PREFIXES) and m not in PURE_CORE)
    assert impure == [], f"the action modules reach modules that do I/O: {impure}"
    for path in ACTIONS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in IO_MODULES, f"{path.name} imports {name}"
