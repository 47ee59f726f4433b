"""The package's layout stays navigable (issue 21: tests of what the old line-count rule was
meant to protect): no import cycle (imports inside functions included); no private name
imported across modules, nor a private attribute of another module's object read; no class
assembled from bases that only declare attributes a subclass sets; the layering of
docs/design.md (the pure core does no I/O and imports only the core; the hook imports no
daemon code); every control op has its own module and test; every policy action is one
registered module, and no other module writes its name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpuwatchd"
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()
"""Import cycles that exist today and are to be broken (issue 21); none may be added."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def running_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``path``, anywhere in it (inside functions too), except
    those in ``if TYPE_CHECKING:`` blocks: they do not run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip
    ]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (inside functions too;
    ``if TYPE_CHECKING:`` blocks excluded: they do not run)."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in running_imports(path):
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
    "COMMANDS": "gpuwatchd.cli.",  # each CLI's command registry (gpuwatchctl, gpuwatchd)
}
"""Names every module of a package defines by its convention: one per module, not one value."""
KNOWN_DUPLICATES: dict[str, frozenset[str]] = {
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


ACTIONS_DIR = PACKAGE / "policy" / "actions"
ACTION_HELPERS = frozenset({"__init__", "spec", "params", "ladder"})
"""Modules of gpuwatchd/policy/actions/ that are not actions: the registry, the spec and
the interfaces, the param parsers, the ladder both parallelism actions move."""
ACTION_NAME_HOMES = ("policy/action_names.py", "control/protocol.py")
"""Where an action's name is written as a string: gpuwatchd/policy/action_names.py (its
module's ``SPEC.name`` and everyone else's use), and the control protocol, whose
``set_knob`` op shares the action's name."""


def literal_action_uses(package: Path, actions: set[str]) -> list[str]:
    """``path:line: 'text'`` for every string constant of ``package`` (outside
    :data:`ACTION_NAME_HOMES`) that is an action's name or quotes one (``action =
    'set_knob'`` in SQL): the dispatchers (engine, schema, actuator) go through the registry,
    the action modules and the single-purpose places (config check, install, replay,
    events, restore, the journal's SQL) name an action by its constant in
    :mod:`gpuwatchd.policy.action_names`."""
    root = package.parent
    found: list[str] = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where.startswith(ACTION_NAME_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            text = node.value
            if text in actions or any(f"'{a}'" in text or f'"{a}"' in text for a in actions):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: {text!r}")
    return found


def test_every_policy_action_is_one_registered_module_with_its_own_test() -> None:
    """Adding an action is one module in gpuwatchd/policy/actions/ (its SPEC: params,
    decide, carry_out; its docstring the contract), one line in MODULES, and its test
    tests/test_action_<name>.py; its name is written once, in
    gpuwatchd/policy/action_names.py (issue 21: the names were strings in 12 files)."""
    from gpuwatchd.policy import action_names
    from gpuwatchd.policy.actions import ACTIONS, MODULES

    files = {p.stem for p in ACTIONS_DIR.glob("*.py")} - ACTION_HELPERS
    registered = [m.__name__.rpartition(".")[2] for m in MODULES]
    assert sorted(registered) == sorted(files), "an action module missing from MODULES"
    assert list(ACTIONS) == registered, "an action's SPEC.name differs from its module's name"
    for module in MODULES:
        assert module.__doc__ and module.SPEC.decide.__module__ == module.__name__
    missing = [n for n in registered if not (REPO / "tests" / f"test_action_{n}.py").is_file()]
    assert missing == [], f"actions without tests/test_action_<name>.py: {missing}"
    named = {getattr(action_names, constant) for constant in action_names.__all__}
    assert named == set(ACTIONS), "action_names.py names other actions than the registry's"
    assert literal_action_uses(PACKAGE, set(ACTIONS)) == [], "use gpuwatchd.policy.action_names"


def test_the_action_name_check_finds_literal_names(tmp_path: Path) -> None:
    text = (
        "def fmt(d):\n"
        '    if d.action == "log":\n'
        '        return "a log line"\n'
        "    return db.execute(\"SELECT 1 FROM decisions WHERE action = 'set_knob'\")\n"
        'HELP = "set_knob and tune_loader move knobs"\n'
    )
    package = fake_package(
        tmp_path,
        {
            "cli/events.py": text,
            "policy/action_names.py": 'LOG = "log"\n',
            "policy/actions/log.py": 'SPEC = ActionSpec("log")\n',
            "control/protocol.py": 'SET_KNOB = "set_knob"\n',
        },
    )
    assert literal_action_uses(package, {"log", "set_knob", "tune_loader"}) == [
        "gpuwatchd/cli/events.py:2: 'log'",
        "gpuwatchd/cli/events.py:4: \"SELECT 1 FROM decisions WHERE action = 'set_knob'\"",
        "gpuwatchd/policy/actions/log.py:1: 'log'",
    ]


# -- private names across modules ---------------------------------------------------------

KNOWN_PRIVATE_IMPORTS: frozenset[tuple[str, str]] = frozenset(
    {
        # issue 24 branch breaks these (the `replay` helper's part of issue 21)
        ("gpuwatchd.backtest_arrays", "gpuwatchd.backtest._order"),
        ("gpuwatchd.backtest_arrays", "gpuwatchd.policy.engine._Compiled"),
        ("gpuwatchd.sampling.replay_arrow", "gpuwatchd.sampling.replay._ALIASES"),
        ("gpuwatchd.sampling.replay_arrow", "gpuwatchd.sampling.replay._DEFAULT_NAME"),
        ("gpuwatchd.sampling.replay_arrow", "gpuwatchd.sampling.replay._DEFAULT_UNIT"),
        ("gpuwatchd.sampling.replay_arrow", "gpuwatchd.sampling.replay._HEADER_CELL"),
        ("gpuwatchd.sampling.replay_arrow", "gpuwatchd.sampling.replay._UNITS"),
    }
)
"""(importing module, private name) pairs allowed for now; none may be added."""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(package: Path) -> set[tuple[str, str]]:
    """(module, ``other.module._name``) for every private name one module of ``package``
    takes from another: ``from pkg.other import _name`` (relative and multi-line imports
    too), and ``alias._name`` where ``alias`` is a module of the package imported by name.
    ``import pkg.other.public as _alias`` is fine: the name imported is public."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    found: set[tuple[str, str]] = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> a module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join([*base, source] if source else base)
                if not source.startswith(package.name):
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    if _is_private(alias.name) and source != name:
                        found.add((name, f"{source}.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = ast.unparse(node.value)
                target = aliases.get(owner, owner if owner in modules else None)
                if target is not None and target != name:
                    found.add((name, f"{target}.{node.attr}"))
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    """A ``_name`` is its module's own: another module that needs it gets a public name
    with a docstring, or the code moves to where it is used."""
    found = private_imports(PACKAGE)
    assert found - KNOWN_PRIVATE_IMPORTS == set(), sorted(found - KNOWN_PRIVATE_IMPORTS)


def test_the_private_name_check_finds_each_form(tmp_path: Path) -> None:
    package = tmp_path / "gpuwatchd"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("_x = 1\ny = 2\n_z = 3\n\ndef _f():\n    return _x\n")
    (package / "b.py").write_text("from gpuwatchd.a import (\n    y,\n    _x,\n)\n")
    (package / "c.py").write_text("from gpuwatchd.a import y as _y\nimport gpuwatchd.a as _a\n")
    (package / "d.py").write_text("from gpuwatchd import a\n\ndef g():\n    return a._z\n")
    (package / "sub" / "e.py").write_text("from ..a import _f\n")
    (package / "f.py").write_text("import gpuwatchd.a\nprint(gpuwatchd.a._x, _a._z)\n")
    assert private_imports(package) == {
        ("gpuwatchd.b", "gpuwatchd.a._x"),
        ("gpuwatchd.d", "gpuwatchd.a._z"),
        ("gpuwatchd.sub.e", "gpuwatchd.a._f"),
        ("gpuwatchd.f", "gpuwatchd.a._x"),
    }


# -- private attributes of other modules' objects -----------------------------------------

OUTSIDE_PRIVATE_ATTRIBUTES: frozenset[str] = frozenset(
    {
        # PyTorch: a DataLoader with persistent workers keeps them in _iterator; dropping
        # it is how its workers restart with a changed num_workers (no public way)
        "gpuwatchd.hook._loader: loader._iterator",
        # the standard library's documented exit without cleanup handlers or teardown
        # (Python docs, os._exit): `gpuwatchd replay` ends with it once its output is out
        "gpuwatchd.cli.main: os._exit",
    }
)
"""``module: expression`` reading a private attribute of the standard library's or a
third-party library's object, where that library offers no public name for it."""
KNOWN_PRIVATE_ATTRIBUTES: frozenset[str] = frozenset()
"""Private attributes of the package's own objects read from another module, allowed for
now; none may be added (the hook has none)."""


def _own_private_members(tree: ast.Module) -> set[str]:
    """Private names a module's classes define: methods, class-level names, ``__slots__``
    entries and ``self._x``/``cls._x`` assignments."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                named = {t.id for t in targets if isinstance(t, ast.Name)}
                names.update(named)
                if "__slots__" in named:
                    names.update(
                        str(c.value) for c in ast.walk(stmt.value) if isinstance(c, ast.Constant)
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


def private_attribute_uses(package: Path) -> set[str]:
    """``module: expression`` for every ``X._name`` in ``package`` where ``X`` is not
    ``self``/``cls`` and no class of the same module defines ``_name``: a private member of
    another module's object (or of a library's), read or set from outside."""
    root = package.parent
    found: set[str] = set()
    for path in package.rglob("*.py"):
        name = _module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _own_private_members(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                found.add(f"{name}: {ast.unparse(node)}")
    return found


def test_no_private_attribute_of_another_module_is_used() -> None:
    """An adapter or a helper drives another module's object through its public API
    (e.g. the hook's adapters through ``Watch``'s, docs/hook-internals.md); ``obj._name``
    is for the module whose class defines ``_name``."""
    found = private_attribute_uses(PACKAGE)
    allowed = OUTSIDE_PRIVATE_ATTRIBUTES | KNOWN_PRIVATE_ATTRIBUTES
    assert sorted(found - allowed) == []
    assert sorted(allowed - found) == [], "an allowed use that is gone: drop it from the list"
    hook = sorted(f for f in found if f.startswith("gpuwatchd.hook"))
    assert hook == ["gpuwatchd.hook._loader: loader._iterator"]


def test_the_private_attribute_check_finds_another_modules_private(tmp_path: Path) -> None:
    package = fake_package(
        tmp_path,
        {
            "watch.py": (
                "class Watch:\n"
                "    __slots__ = ('_slot',)\n"
                "    def __init__(self):\n"
                "        self._attention = False\n"
                "    def _begin(self):\n"
                "        return self._attention\n"
                "class Scope:\n"
                "    def __init__(self, watch):\n"
                "        self.watch = watch\n"
                "    def enter(self):\n"
                "        return self.watch._begin(), self.watch._slot\n"
            ),
            "hook/adapter.py": (
                "import os\n"
                "def on_batch(watch, trainer):\n"
                "    if watch._attention:\n"
                "        trainer._stop = True\n"
                "    os._exit(watch.public)\n"
                "class Callback:\n"
                "    def __init__(self, watch):\n"
                "        self._watch = watch\n"
                "    def on_epoch(self):\n"
                "        self._watch._set_epoch(self._watch.epoch)\n"
            ),
        },
    )
    assert private_attribute_uses(package) == {
        "gpuwatchd.hook.adapter: watch._attention",
        "gpuwatchd.hook.adapter: trainer._stop",
        "gpuwatchd.hook.adapter: os._exit",
        "gpuwatchd.hook.adapter: self._watch._set_epoch",
    }


# -- classes assembled from bases that only declare attributes ----------------------------

KNOWN_DECLARING_BASES: frozenset[str] = frozenset()
"""Bases allowed for now to declare state their subclass sets; none may be added."""

_FIELD_BASES = frozenset({"NamedTuple", "TypedDict", "Protocol", "Enum", "IntEnum", "StrEnum"})


def _assigned(cls: ast.ClassDef) -> set[str]:
    """Names a class sets: at class level, or as ``self.name`` anywhere in its body."""
    out: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            out.add(ast.unparse(stmt.target))
        elif isinstance(stmt, ast.Assign):
            out.update(ast.unparse(t) for t in stmt.targets)
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    out.add(sub.attr)
    return out


def _declared_only(cls: ast.ClassDef) -> set[str]:
    """Class-level annotations without a value, not ``ClassVar``, that the class never
    sets; none for dataclasses, NamedTuples, TypedDicts, Protocols and enums (their
    annotations are fields or an interface)."""
    bases = {ast.unparse(b).rpartition(".")[2].partition("[")[0] for b in cls.bases}
    if bases & _FIELD_BASES or any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
        return set()
    declared = {
        ast.unparse(stmt.target)
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign)
        and stmt.value is None
        and "ClassVar" not in ast.unparse(stmt.annotation)
    }
    return declared - _assigned(cls)


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b).rpartition(".")[2].partition("[")[0] for b in cls.bases]


def declaring_bases(package: Path) -> set[tuple[str, str, str]]:
    """(base, subclass, attribute) for every class of ``package`` whose ancestor (another
    class of the package, matched by name, any number of levels up) declares an attribute
    it never sets and the subclass sets: one object's state split across classes."""
    root = package.parent
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in package.rglob("*.py"):
        module = _module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((f"{module}.{node.name}", node))
    found: set[tuple[str, str, str]] = set()
    for defs in classes.values():
        for qualified, cls in defs:
            seen: set[str] = set()
            todo = _base_names(cls)
            while todo:
                name = todo.pop()
                if name in seen:
                    continue
                seen.add(name)
                for base_qualified, base in classes.get(name, []):
                    todo.extend(_base_names(base))
                    for attr in _declared_only(base) & _assigned(cls):
                        found.add((base_qualified, qualified, attr))
    return found


def test_no_class_is_assembled_from_bases_that_only_declare_attributes() -> None:
    """A class lives in one place with its state: a base that annotates ``x: T`` and leaves
    ``x`` for its subclass to set is half an object (issue 21: ``Watch`` from mixins)."""
    found = {f for f in declaring_bases(PACKAGE) if f[0] not in KNOWN_DECLARING_BASES}
    assert found == set(), sorted(found)


def test_the_declaring_base_check_finds_a_split_object(tmp_path: Path) -> None:
    package = tmp_path / "gpuwatchd"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text(
        "from dataclasses import dataclass\nfrom typing import ClassVar\n\n"
        "class Half:\n    conn: object\n    name: ClassVar[str]\n    kept: int\n"
        "    def __init__(self):\n        self.kept = 0\n\n"
        "@dataclass\nclass Fields:\n    x: int\n"
    )
    (package / "sub.py").write_text(
        "from gpuwatchd.base import Fields, Half\n\n"
        "class Whole(Half):\n    name = 'whole'\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.conn = object()\n        self.kept = 1\n\n"
        "class More(Fields):\n    def __post_init__(self):\n        self.x = 2\n\n"
        "class Middle(Half):\n    pass\n\n"
        "class Leaf(Middle):\n    conn = None\n"
    )
    assert declaring_bases(package) == {
        ("gpuwatchd.base.Half", "gpuwatchd.sub.Whole", "conn"),
        ("gpuwatchd.base.Half", "gpuwatchd.sub.Leaf", "conn"),
    }


# -- layers (docs/design.md "Layers") -----------------------------------------------------

CORE: frozenset[str] = frozenset(
    {
        "gpuwatchd",
        "gpuwatchd.errors",
        "gpuwatchd.model",
        "gpuwatchd.units",
        "gpuwatchd.xid",
        "gpuwatchd.crash",
        "gpuwatchd.yamlsrc",
        "gpuwatchd.windows",
        "gpuwatchd.windows_arrays",
        "gpuwatchd.detectors",
        "gpuwatchd.detectors.*",
        "gpuwatchd.policy",
        "gpuwatchd.policy.accounting",
        "gpuwatchd.policy.action_names",
        "gpuwatchd.policy.actions",
        "gpuwatchd.policy.actions.*",
        "gpuwatchd.policy.decisions",
        "gpuwatchd.policy.engine",
        "gpuwatchd.policy.grouping",
        "gpuwatchd.policy.holds",
        "gpuwatchd.policy.policies",
        "gpuwatchd.policy.schema",
        "gpuwatchd.policy.tuner",
        "gpuwatchd.control.knobmemory",
        "gpuwatchd.control.messages",
        "gpuwatchd.control.protocol",
    }
)
"""The pure core: no I/O, a clock passed in, testable without sockets, threads or NVML
(docs/design.md "Layers"; ``pkg.*``: every module under ``pkg``)."""

IO_MODULES: frozenset[str] = frozenset(
    {
        "asyncio",
        "fcntl",
        "glob",
        "http",
        "io",
        "multiprocessing",
        "os",
        "pathlib",
        "psutil",
        "pynvml",
        "select",
        "selectors",
        "shutil",
        "socket",
        "socketserver",
        "sqlite3",
        "subprocess",
        "tempfile",
        "threading",
        "urllib",
    }
)
"""Modules (and their submodules) the pure core never imports."""

HOOK_NEVER_IMPORTS: tuple[str, ...] = (
    "gpuwatchd.daemon",
    "gpuwatchd.jobs",
    "gpuwatchd.control.server",
)
"""The daemon's code, which the hook (inside the training job) never imports, even through
another module."""


def _in(module: str, patterns: frozenset[str]) -> bool:
    return any(module == p or (p.endswith(".*") and module.startswith(p[:-1])) for p in patterns)


def external_imports(path: Path) -> set[str]:
    """Top-level names of the modules outside ``gpuwatchd`` that ``path`` imports, anywhere
    in it (``if TYPE_CHECKING:`` blocks excluded)."""
    names: set[str] = set()
    for node in running_imports(path):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names - {"gpuwatchd", "__future__"}


def layer_violations(package: Path) -> list[str]:
    """Every import that breaks the layers: a core module importing an I/O module or a
    package module outside the core; a hook module reaching daemon code (transitively)."""
    root = package.parent
    graph = import_graph(package)
    paths = {_module_name(p, root): p for p in package.rglob("*.py")}
    out = []
    for module in sorted(m for m in graph if _in(m, CORE)):
        for name in sorted(external_imports(paths[module]) & IO_MODULES):
            out.append(f"{module} imports {name} (the core does no I/O)")
        for target in sorted(t for t in graph[module] if not _in(t, CORE)):
            out.append(f"{module} imports {target} (outside the core)")
    for module in sorted(
        m for m in graph if _in(m, frozenset({"gpuwatchd.hook", "gpuwatchd.hook.*"}))
    ):
        seen, stack = {module}, [module]
        while stack:
            for target in graph[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        for target in sorted(seen):
            if target.startswith(HOOK_NEVER_IMPORTS):
                out.append(f"{module} reaches {target} (the hook never imports daemon code)")
    return out


def test_the_layers_hold() -> None:
    """The pure core (windows, detectors, policy engine, protocol messages) imports no I/O
    module and nothing outside the core; the hook imports no daemon code (docs/design.md)."""
    assert {m for m in import_graph(PACKAGE) if _in(m, CORE)} >= {
        "gpuwatchd.windows",
        "gpuwatchd.detectors.gpu",
        "gpuwatchd.policy.engine",
        "gpuwatchd.control.messages",
    }
    assert layer_violations(PACKAGE) == []


def test_the_layer_check_finds_io_in_the_core_and_daemon_code_in_the_hook(
    tmp_path: Path,
) -> None:
    package = tmp_path / "gpuwatchd"
    for sub in ("detectors", "hook", "daemon", "policy"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "windows.py").write_text("def load():\n    import sqlite3\n")
    (package / "detectors" / "gpu.py").write_text("from gpuwatchd.config import X\n")
    (package / "policy" / "engine.py").write_text(
        "from typing import TYPE_CHECKING\nfrom gpuwatchd import windows\n"
        "if TYPE_CHECKING:\n    from pathlib import Path\n"
    )
    (package / "config.py").write_text("import os\n")
    (package / "hook" / "watch.py").write_text("from gpuwatchd import helper\n")
    (package / "helper.py").write_text("def f():\n    from gpuwatchd.daemon import tick\n")
    (package / "daemon" / "tick.py").write_text("")
    assert layer_violations(package) == [
        "gpuwatchd.detectors.gpu imports gpuwatchd.config (outside the core)",
        "gpuwatchd.windows imports sqlite3 (the core does no I/O)",
        "gpuwatchd.hook.watch reaches gpuwatchd.daemon.tick (the hook never imports daemon code)",
    ]


def test_every_cli_command_is_one_module_with_its_contract() -> None:
    """``gpuwatchd`` and ``gpuwatchctl`` alike: one module per command, listed in its
    package's ``COMMANDS``, its docstring the command's contract."""
    from gpuwatchd.cli import commands, daemon_commands

    for package, functions in (
        (daemon_commands, ("add_parser", "run")),
        (commands, ("add_arguments", "execute")),
    ):
        folder = Path(package.__file__).parent
        modules = {p.stem for p in folder.glob("*.py") if not p.name.startswith("_")}
        assert modules == set(package.COMMANDS), folder
        for name in package.COMMANDS:
            module = importlib.import_module(f"{package.__name__}.{name}")
            assert len((module.__doc__ or "").strip()) > 40, f"{module.__name__}: no contract"
            missing = [f for f in functions if not callable(getattr(module, f, None))]
            assert missing == [], f"{module.__name__} lacks {missing}"
