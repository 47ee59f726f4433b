"""FakeNvml held to the real ``pynvml`` module (issue 22, item 1), without a GPU.

Every GPU-side test runs on :class:`gpuwatchd.testing.nvml.FakeNvml`; this module checks
the fake against the ``pynvml`` that is installed (nvidia-ml-py, the module NVIDIA ships
as ``pynvml.py``; its definitions follow ``nvml.h`` and the NVML API reference,
https://docs.nvidia.com/deploy/nvml-api/). Reading pynvml's constants, signatures and
ctypes structs needs neither a driver nor a GPU. What is checked, by
:func:`fidelity_mismatches` (a list of mismatches, empty when the fake is faithful):

* **Names gpuwatchd reads.** An AST walk over ``gpuwatchd/`` collects every
  ``nvml*``/``NVML_*``/``NVMLError``/``c_nvml*`` name read as an attribute
  (``nvml.nvmlInit``, ``self._nvml.NVMLError``), through ``getattr``/``hasattr`` with a
  literal name, or as a literal subscript key (FakeNvml's ``calls["nvmlInit"]``). Each
  must exist in pynvml and on the fake; only names in :data:`OPTIONAL_IN_PYNVML`, read
  defensively, may be missing from pynvml.
* **Everything FakeNvml defines publicly** (class and instance attributes) exists in
  pynvml, except the test helpers of :data:`FAKE_ONLY`.
* **Functions**: the fake's parameter names, kinds, order and defaults equal those of
  pynvml's Python wrappers (``inspect.signature``, e.g. ``version=None`` of
  ``nvmlDeviceGetMemoryInfo``).
* **Constants and error codes**: same names, same ``int`` values, in FakeNvml and in
  ``gpuwatchd.testing.nvml.codes``; every ``NVML_ERROR_*`` of pynvml is in the fake (a
  script can raise any of them); ``str(NVMLError(code))`` is pynvml's text
  (``NVMLError._errcode_to_string``).
* **Struct fields**: each result object the fake returns (:data:`RESULTS`) has the
  fields of the ctypes struct pynvml returns (``_fields_``: names and order), each
  holding the Python type ctypes gives for that field (``int`` for ``c_uint``/
  ``c_ulonglong``; a device handle for ``c_nvmlDevice_t``). The struct named for each
  call is checked against the source of the pynvml wrapper, and every result class of
  ``gpuwatchd.testing.nvml`` must be covered.

The tests at the end break a fake on purpose (a misspelled field, function, parameter,
value or name) and require the checker to name the fault, so none of these checks
passes vacuously.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pynvml
import pytest

import gpuwatchd.testing.nvml as testing_nvml
from gpuwatchd.testing.nvml import (
    FakeDevice,
    FakeMemory,
    FakeMemoryV2,
    FakeNvml,
    FakeUtilization,
    codes,
)

PACKAGE = Path(__file__).resolve().parent.parent / "gpuwatchd"
FAKE_PACKAGE = "gpuwatchd/testing/nvml/"

API_NAME = re.compile(r"^(?:nvml[A-Z]\w*|NVML_[A-Z0-9_]*[A-Z0-9]|NVMLError\w*|c_nvml\w+)$")
"""What an NVML name looks like in pynvml: functions and ``nvmlEventType*``/
``nvmlMemory_v2`` constants, ``NVML_*`` constants, the ``NVMLError`` classes, structs."""

STRUCT_FIELDS_NAMED_LIKE_API: Mapping[str, str] = {
    "nvmlReturn": "field of c_nvmlFieldValue_t and c_nvmlGpmMetric_t (checked as a struct field)",
}
"""Struct fields whose names look like NVML API names; the AST walk skips them."""

OPTIONAL_IN_PYNVML: Mapping[str, str] = {}
"""Names gpuwatchd reads with ``getattr(module, name, default)`` that a supported
pynvml may lack, with the reason. None is needed against nvidia-ml-py >= 12.535 (the
floor in pyproject.toml): ``nvmlMemory_v2``, ``nvmlEventSetWait_v2``, the event API and
every ``NVML_ERROR_*`` the sampler reads are all in it, so each defensive read only
guards older or third-party bindings and must still find the name in the one installed.
An entry here whose name pynvml does have is reported as stale."""

FAKE_ONLY: Mapping[str, str] = {
    # Builders and fault injection: the fake's scripting API (docs/modules.md).
    "h100s": "builder of scripted H100s",
    "from_trace": "builder from a recorded nvidia-smi trace",
    "from_script": "builder from a JSON-able script",
    "from_json": "builder from a JSON script file",
    "inject_xid": "raises an Xid now, as the driver would",
    # State a test scripts or inspects.
    "devices": "the scripted FakeDevice objects",
    "calls": "calls per pynvml function name, to count what a tick costs",
    "init_count": "nvmlInit calls not yet undone by nvmlShutdown",
    "init_error": "the code nvmlInit raises (a driver fault)",
    "init_failures": "how many nvmlInit calls raise init_error",
    "memory_v2": "False plays a driver without nvmlDeviceGetMemoryInfo_v2",
    "driver_version": "what nvmlSystemGetDriverVersion answers",
    "event_wait_error": "the code every nvmlEventSetWait raises",
    "event_sets": "the event sets nvmlEventSetCreate made",
    "gpm_samples": "the GPM sample buffers nvmlGpmSampleAlloc made (to check they are freed)",
}
"""Public attributes of FakeNvml that are not pynvml's, with what they are for."""

NULLABLE: Mapping[tuple[str, str], str] = {
    ("c_nvmlProcessInfo_v3_t", "usedGpuMemory"): (
        "pynvml's nvmlDeviceGetComputeRunningProcesses_v3 sets it to None where NVML "
        "reports NVML_VALUE_NOT_AVAILABLE (WDDM on Windows, see its comment above "
        "c_nvmlProcessInfo_v2_t)"
    ),
}
"""Struct fields pynvml itself may hand back as ``None`` instead of the ctypes value."""


# -- the names gpuwatchd reads -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NameUse:
    """One read of an NVML name in gpuwatchd's source."""

    name: str
    where: str
    """``path:line``."""
    defensive: bool
    """Read with ``getattr(..., default)`` or tested with ``hasattr``."""


def package_sources(root: Path = PACKAGE) -> dict[str, str]:
    """``gpuwatchd/...py`` path -> text, for every module of the package."""
    return {
        f"gpuwatchd/{path.relative_to(root).as_posix()}": path.read_text(encoding="utf-8")
        for path in sorted(root.rglob("*.py"))
    }


def _own_names(tree: ast.Module) -> set[str]:
    """Names a module assigns at its top level."""
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def nvml_names_used(sources: Mapping[str, str]) -> list[NameUse]:
    """Every NVML name (:data:`API_NAME`) the given modules read from an NVML module.

    Counted: an attribute (``nvml.nvmlInit``, ``self._nvml.NVMLError``), the literal
    second argument of ``getattr``/``hasattr``, a literal subscript key
    (``self.calls["nvmlInit"]``). Names that gpuwatchd's own modules outside the fake
    define at top level (``NVML_RETRY_MAX_S`` of ``gpuwatchd.sampling.open``) are
    gpuwatchd's, not pynvml's, and are left out.
    """
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    own: set[str] = set()
    for path, tree in trees.items():
        if not path.startswith(FAKE_PACKAGE):
            own |= _own_names(tree)
    uses: list[NameUse] = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name: str | None = None
            defensive = False
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
                defensive = node.func.id == "hasattr" or len(node.args) == 3
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                name = node.slice.value
            if (
                name is not None
                and API_NAME.match(name)
                and name not in own
                and name not in STRUCT_FIELDS_NAMED_LIKE_API
            ):
                uses.append(NameUse(name, f"{path}:{getattr(node, 'lineno', 0)}", defensive))
    return uses


@functools.lru_cache(maxsize=1)
def package_uses() -> tuple[NameUse, ...]:
    """:func:`nvml_names_used` over all of ``gpuwatchd/`` (parsed once per test run)."""
    return tuple(nvml_names_used(package_sources()))


def check_names_used(
    uses: Iterable[NameUse],
    fake: ModuleType,
    real: ModuleType,
    optional: Mapping[str, str] = OPTIONAL_IN_PYNVML,
) -> list[str]:
    """Each name read must exist in ``real`` and on ``fake`` (see the module docstring)."""
    by_name: dict[str, list[NameUse]] = {}
    for use in uses:
        by_name.setdefault(use.name, []).append(use)
    problems: list[str] = []
    for name, places in sorted(by_name.items()):
        where = ", ".join(sorted({u.where for u in places}))
        if not hasattr(real, name):
            if name not in optional:
                problems.append(f"{name} (read at {where}) is not in pynvml")
            elif not all(u.defensive for u in places):
                problems.append(
                    f"{name} (read at {where}) may be missing from pynvml "
                    f"({optional[name]}) but is not always read with getattr(..., default)"
                )
        if not hasattr(fake, name) and name not in optional:
            problems.append(f"{name} (read at {where}) is not on FakeNvml")
    for name, reason in sorted(optional.items()):
        if hasattr(real, name):
            problems.append(f"OPTIONAL_IN_PYNVML entry {name} ({reason}) is stale: pynvml has it")
        elif name not in by_name:
            problems.append(f"OPTIONAL_IN_PYNVML entry {name} is stale: gpuwatchd never reads it")
    return problems


# -- functions, constants, error codes -----------------------------------------------


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter of ``fn`` (a bound method without self)."""
    return [
        (p.name, p.kind.name, p.default)
        for p in inspect.signature(fn).parameters.values()
    ]  # fmt: skip


def _show(parameters: Sequence[tuple[str, str, object]]) -> str:
    def one(name: str, kind: str, default: object) -> str:
        text = {"VAR_POSITIONAL": f"*{name}", "VAR_KEYWORD": f"**{name}"}.get(kind, name)
        return text if default is inspect.Parameter.empty else f"{text}={default!r}"

    return "(" + ", ".join(one(*p) for p in parameters) + ")"


def _is_ctypes_aggregate(value: object) -> bool:
    return inspect.isclass(value) and issubclass(value, (ctypes.Structure, ctypes.Union))


def compare_attribute(where: str, name: str, fake_value: object, real_value: object) -> list[str]:
    """The fake's ``name`` against pynvml's: a signature, an exception class, a struct a
    caller builds (``c_nvmlGpmMetricsGet_t()``: an instance of the fake's class has the
    struct's fields, see :func:`struct_problems`) or a value."""
    if _is_ctypes_aggregate(real_value):
        if not inspect.isclass(fake_value):
            return [f"{where}.{name} is not a class (pynvml's is the struct {name})"]
        return struct_problems(f"{where}.{name}()", fake_value(), real_value, object)
    if inspect.isclass(real_value) and issubclass(real_value, BaseException):
        if not (inspect.isclass(fake_value) and issubclass(fake_value, Exception)):
            return [f"{where}.{name} is not an exception class (pynvml's is)"]
        fake_params, real_params = _parameters(fake_value), _parameters(real_value)
        if fake_params != real_params:
            return [
                f"{where}.{name}{_show(fake_params)} does not construct like "
                f"pynvml.{name}{_show(real_params)}"
            ]
        return []
    if callable(real_value):
        if not callable(fake_value):
            return [f"{where}.{name} is not callable (pynvml's is)"]
        fake_params = _parameters(fake_value)
        real_params = _parameters(inspect.unwrap(real_value))
        if fake_params != real_params:
            return [
                f"{where}.{name}{_show(fake_params)} differs from pynvml.{name}{_show(real_params)}"
            ]
        return []
    if isinstance(real_value, int) and (
        not isinstance(fake_value, int) or isinstance(fake_value, bool)
    ):
        return [f"{where}.{name} = {fake_value!r}, pynvml has the int {real_value!r}"]
    if fake_value != real_value:
        return [f"{where}.{name} = {fake_value!r}, pynvml has {real_value!r}"]
    return []


def public_names(fake: ModuleType) -> list[str]:
    """What FakeNvml defines publicly: its class's attributes and the instance's."""
    names = {n for n in dir(type(fake)) if not n.startswith("_")} | {
        n for n in vars(fake) if not n.startswith("_")
    }
    return sorted(names)


def check_fake_surface(
    fake: ModuleType, real: ModuleType, fake_only: Mapping[str, str] = FAKE_ONLY
) -> list[str]:
    """Every public name of the fake is pynvml's (and matches it) or a listed helper."""
    problems: list[str] = []
    names = public_names(fake)
    for name in names:
        if name in fake_only:
            if hasattr(real, name):
                problems.append(f"FakeNvml.{name} is listed in FAKE_ONLY but pynvml has it")
            continue
        if not hasattr(real, name):
            problems.append(
                f"FakeNvml.{name} is not in pynvml (misspelled, or a helper missing from FAKE_ONLY)"
            )
            continue
        problems += compare_attribute("FakeNvml", name, getattr(fake, name), getattr(real, name))
    problems += [
        f"FAKE_ONLY entry {name} is stale: FakeNvml has no such attribute"
        for name in sorted(set(fake_only) - set(names))
    ]
    return problems


def check_codes(fake: ModuleType, codes_module: ModuleType, real: ModuleType) -> list[str]:
    """Constants of ``codes`` equal pynvml's; every pynvml error code is in the fake;
    ``NVMLError``'s texts are pynvml's."""
    problems: list[str] = []
    for name in sorted(vars(codes_module)):
        if not API_NAME.match(name) or name == "NVMLError":
            continue
        if not hasattr(real, name):
            problems.append(f"codes.{name} is not in pynvml")
            continue
        problems += compare_attribute(
            "codes", name, getattr(codes_module, name), getattr(real, name)
        )
    for name in sorted(n for n in dir(real) if n.startswith("NVML_ERROR_")):
        for where, module in (("FakeNvml", fake), ("codes", codes_module)):
            if not hasattr(module, name):
                problems.append(f"{where} lacks pynvml's error code {name}")
    error_class: Any = getattr(codes_module, "NVMLError", None)
    real_texts: Mapping[int, str] = real.NVMLError._errcode_to_string
    for code, text in sorted(real_texts.items()):
        got = str(error_class(code)) if error_class is not None else "<no NVMLError>"
        if got != text:
            problems.append(f"str(NVMLError({code})) is {got!r}, pynvml's is {text!r}")
    return problems


# -- struct fields -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResultSpec:
    """A fake call whose result stands for a pynvml struct."""

    call: str
    """The call, as the checker makes it (for messages)."""
    real_function: str
    """The pynvml wrapper that returns ``real_struct`` (from its source)."""
    real_struct: str
    produce: Callable[[Any, Any], object]
    """``(fake, handle) -> result`` on an initialised fake with one device."""
    built_by_caller: bool = False
    """The caller builds the struct and pynvml fills it (``nvmlGpmMetricsGet``): its
    wrapper's source does not name the struct."""


def _event(wait: str) -> Callable[[Any, Any], object]:
    def produce(fake: Any, handle: Any) -> object:
        event_set = fake.nvmlEventSetCreate()
        fake.nvmlDeviceRegisterEvents(handle, fake.nvmlEventTypeXidCriticalError, event_set)
        fake.inject_xid(0, 79)
        try:
            return getattr(fake, wait)(event_set, 0)
        finally:
            fake.nvmlEventSetFree(event_set)

    return produce


def _gpm_metrics(fake: Any, handle: Any) -> object:
    """SM activity between two GPM samples, as the sampler asks for it."""
    first, second = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    fake.nvmlGpmSampleGet(handle, first)
    fake.nvmlGpmSampleGet(handle, second)
    request = fake.c_nvmlGpmMetricsGet_t()
    request.version = fake.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = fake.NVML_GPM_METRIC_SM_UTIL
    return fake.nvmlGpmMetricsGet(request)


RESULTS: Sequence[ResultSpec] = (
    ResultSpec(
        "nvmlDeviceGetUtilizationRates(handle)",
        "nvmlDeviceGetUtilizationRates",
        "c_nvmlUtilization_t",
        lambda fake, h: fake.nvmlDeviceGetUtilizationRates(h),
    ),
    ResultSpec(
        "nvmlDeviceGetMemoryInfo(handle)",
        "nvmlDeviceGetMemoryInfo",
        "c_nvmlMemory_t",
        lambda fake, h: fake.nvmlDeviceGetMemoryInfo(h),
    ),
    ResultSpec(
        "nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)",
        "nvmlDeviceGetMemoryInfo",
        "c_nvmlMemory_v2_t",
        lambda fake, h: fake.nvmlDeviceGetMemoryInfo(h, version=fake.nvmlMemory_v2),
    ),
    ResultSpec(
        "nvmlDeviceGetComputeRunningProcesses(handle)[0]",
        "nvmlDeviceGetComputeRunningProcesses",
        "c_nvmlProcessInfo_v3_t",
        lambda fake, h: fake.nvmlDeviceGetComputeRunningProcesses(h)[0],
    ),
    ResultSpec(
        "nvmlEventSetWait_v2(eventSet, 0)",
        "nvmlEventSetWait_v2",
        "c_nvmlEventData_t",
        _event("nvmlEventSetWait_v2"),
    ),
    ResultSpec(
        "nvmlEventSetWait(eventSet, 0)",
        "nvmlEventSetWait",
        "c_nvmlEventData_t",
        _event("nvmlEventSetWait"),
    ),
    ResultSpec(
        "nvmlDeviceGetFieldValues(handle, [NVML_FI_DEV_ECC_DBE_VOL_TOTAL])[0]",
        "nvmlDeviceGetFieldValues",
        "c_nvmlFieldValue_t",
        lambda fake, h: fake.nvmlDeviceGetFieldValues(h, [fake.NVML_FI_DEV_ECC_DBE_VOL_TOTAL])[0],
    ),
    ResultSpec(
        "nvmlDeviceGetProcessUtilization(handle, 0)[0]",
        "nvmlDeviceGetProcessUtilization",
        "c_nvmlProcessUtilizationSample_t",
        lambda fake, h: fake.nvmlDeviceGetProcessUtilization(h, 0)[0],
    ),
    ResultSpec(
        "nvmlGpmQueryDeviceSupport(handle)",
        "nvmlGpmQueryDeviceSupport",
        "c_nvmlGpmSupport_t",
        lambda fake, h: fake.nvmlGpmQueryDeviceSupport(h),
    ),
    ResultSpec(
        "nvmlGpmMetricsGet(c_nvmlGpmMetricsGet_t())",
        "nvmlGpmMetricsGet",
        "c_nvmlGpmMetricsGet_t",
        lambda fake, h: _gpm_metrics(fake, h),
        built_by_caller=True,
    ),
)
"""The fake's struct results and the pynvml struct each stands for."""


def _real_source(real: ModuleType, function: str) -> str:
    """The source of pynvml's ``function`` and of the pynvml functions it calls."""
    text = inspect.getsource(inspect.unwrap(getattr(real, function)))
    parts = [text]
    for called in sorted(set(re.findall(r"\b(nvml\w+)\(", text)) - {function}):
        target = getattr(real, called, None)
        if inspect.isfunction(target):
            parts.append(inspect.getsource(inspect.unwrap(target)))
    return "\n".join(parts)


def _field_names(obj: object) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return [n for n in vars(obj) if not n.startswith("_")]


def fidelity_devices() -> list[FakeDevice]:
    """The one device the struct checks read: with a process, so every struct is made."""
    return [FakeDevice("GPU-fidelity", processes=[(4242, 3 * 2**30, 62.0)])]


def struct_problems(
    label: str, obj: object, struct: Any, handle_type: type, nullable: Sequence[str] = ()
) -> list[str]:
    """``obj`` against the ctypes ``struct`` (or union): field names and order, and each
    field's Python type as ctypes gives it; a nested struct or union field is checked
    the same way, an array field by its first element, a pointer field (a sample handle)
    and a device handle by ``handle_type``; ``c_char_p`` gives ``bytes`` or None.
    ``nullable`` fields may be None."""
    problems: list[str] = []
    real_fields: list[tuple[str, Any]] = [(f[0], f[1]) for f in struct._fields_]
    real_names = [name for name, _ in real_fields]
    fake_names = _field_names(obj)
    extra = [n for n in fake_names if n not in real_names]
    missing = [n for n in real_names if n not in fake_names]
    if extra:
        problems.append(
            f"{label} has field(s) {', '.join(map(repr, extra))} that "
            f"pynvml.{struct.__name__} lacks (its fields: {', '.join(real_names)})"
        )
    if missing:
        problems.append(
            f"{label} lacks pynvml.{struct.__name__} field(s) {', '.join(map(repr, missing))}"
        )
    if not extra and not missing and fake_names != real_names:
        problems.append(
            f"{label} fields in the order {', '.join(fake_names)}; "
            f"pynvml.{struct.__name__}: {', '.join(real_names)}"
        )
    blank = struct()
    for name, ctype in real_fields:
        if name not in fake_names:
            continue
        value = getattr(obj, name)
        where = f"{label}.{name}"
        if value is None and name in nullable:
            continue
        if _is_ctypes_aggregate(ctype):
            problems += struct_problems(where, value, ctype, handle_type)
            continue
        if inspect.isclass(ctype) and issubclass(ctype, ctypes.Array):
            if not isinstance(value, Sequence) or len(value) != ctype._length_:
                problems.append(f"{where} is not a sequence of {ctype._length_} entries")
            elif _is_ctypes_aggregate(ctype._type_):
                problems += struct_problems(f"{where}[0]", value[0], ctype._type_, handle_type)
            continue
        if ctype.__name__ in ("c_nvmlDevice_t", "LP_struct_c_nvmlDevice_t"):
            if not isinstance(value, handle_type):
                problems.append(
                    f"{where} is {type(value).__name__}; a device handle of the fake's kind"
                )
            continue
        if inspect.isclass(ctype) and issubclass(ctype, ctypes._Pointer):
            if isinstance(value, (int, float, str, bytes)):  # an opaque handle, or None
                problems.append(f"{where} is {type(value).__name__}; pynvml's is a pointer")
            continue
        expected: tuple[type, ...]
        if ctype is ctypes.c_char_p:
            expected = (bytes, type(None))
        else:
            expected = (type(getattr(blank, name)),)
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            problems.append(
                f"{where} is {type(value).__name__} {value!r}; pynvml's "
                f"{struct.__name__}.{name} ({ctype.__name__}) gives {expected[0].__name__}"
            )
    return problems


def check_results(
    make_fake: Callable[[Sequence[FakeDevice]], Any],
    real: ModuleType,
    results: Sequence[ResultSpec] = RESULTS,
    result_classes: Iterable[type] = (),
) -> list[str]:
    """Each result object has its pynvml struct's fields (names, order, Python types)."""
    problems: list[str] = []
    produced: set[type] = set()
    for spec in results:
        fake = make_fake(fidelity_devices())
        fake.nvmlInit()
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        struct = getattr(real, spec.real_struct, None)
        if struct is None:
            problems.append(f"pynvml has no {spec.real_struct} (for {spec.call})")
            continue
        if not spec.built_by_caller and not re.search(
            rf"\b{spec.real_struct}\b", _real_source(real, spec.real_function)
        ):
            problems.append(
                f"pynvml.{spec.real_function} does not build {spec.real_struct}: "
                "RESULTS names the wrong struct"
            )
        try:
            obj = spec.produce(fake, handle)
        except Exception as exc:  # a fake that cannot even answer is a mismatch too
            problems.append(f"{spec.call} on the fake raised {type(exc).__name__}: {exc}")
            continue
        produced.add(type(obj))
        label = f"{type(obj).__name__} (from {spec.call})"
        nullable = [f for (st, f) in NULLABLE if st == spec.real_struct]
        problems += struct_problems(label, obj, struct, type(handle), nullable)
    for cls in sorted(set(result_classes) - produced, key=lambda c: c.__name__):
        problems.append(f"result class {cls.__name__} is checked against no pynvml struct")
    return problems


def fake_result_classes() -> list[type]:
    """The pynvml result structs ``gpuwatchd.testing.nvml`` defines (its dataclasses)."""
    return [
        obj
        for name in testing_nvml.__all__
        if inspect.isclass(obj := getattr(testing_nvml, name)) and dataclasses.is_dataclass(obj)
    ]


# -- the checker ---------------------------------------------------------------------


def fidelity_mismatches(
    make_fake: Callable[[Sequence[FakeDevice]], Any] = FakeNvml,
    *,
    real: ModuleType = pynvml,
    sources: Mapping[str, str] | None = None,
    codes_module: ModuleType = codes,
    optional: Mapping[str, str] = OPTIONAL_IN_PYNVML,
    fake_only: Mapping[str, str] = FAKE_ONLY,
) -> list[str]:
    """Every way the fake made by ``make_fake`` differs from ``real`` (empty: none).

    ``sources`` (path -> text) are the modules whose NVML reads are checked; the default
    is all of ``gpuwatchd/``.
    """
    fake = make_fake(fidelity_devices())
    uses = package_uses() if sources is None else nvml_names_used(sources)
    return [
        *check_names_used(uses, fake, real, optional),
        *check_fake_surface(fake, real, fake_only),
        *check_codes(fake, codes_module, real),
        *check_results(make_fake, real, RESULTS, fake_result_classes()),
    ]


# -- the tests -----------------------------------------------------------------------


def test_fake_nvml_matches_the_installed_pynvml() -> None:
    assert fidelity_mismatches() == []


def test_the_names_checked_are_derived_from_gpuwatchds_source() -> None:
    """The walk finds the sampler's NVML reads (so the test above checks them)."""
    uses = package_uses()
    read = {u.name for u in uses if u.where.startswith("gpuwatchd/sampling/nvml.py:")}
    assert {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlEventSetWait",
        "nvmlEventSetFree",
        "nvmlEventTypeXidCriticalError",
        "nvmlMemory_v2",
        "NVMLError",
        "NVML_TEMPERATURE_GPU",
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_TIMEOUT",
        "NVML_ERROR_GPU_IS_LOST",
    } <= read
    defensive = {u.name for u in uses if u.defensive}
    assert {"nvmlMemory_v2", "nvmlEventSetWait_v2", "NVML_ERROR_GPU_IS_LOST"} <= defensive
    fake_keys = {u.name for u in uses if u.where.startswith(FAKE_PACKAGE)}
    assert "nvmlInit" in fake_keys  # calls["..."] in fake.py
    assert not {u.name for u in uses} & {"NVML_RETRY_FIRST_S", "NVML_RETRY_MAX_S"}


def test_every_result_class_is_held_to_a_pynvml_struct() -> None:
    classes = {c.__name__ for c in fake_result_classes()}
    assert classes == {
        "FakeUtilization",
        "FakeMemory",
        "FakeMemoryV2",
        "FakeProcessInfo",
        "FakeEventData",
        "FakeFieldValue",
        "FakeProcessUtilizationSample",
        "FakeGpmSupport",
    }
    assert check_results(FakeNvml, pynvml, RESULTS, fake_result_classes()) == []
    assert check_results(FakeNvml, pynvml, RESULTS[:1], fake_result_classes()) == [
        f"result class {name} is checked against no pynvml struct"
        for name in (
            "FakeEventData",
            "FakeFieldValue",
            "FakeGpmSupport",
            "FakeMemory",
            "FakeMemoryV2",
            "FakeProcessInfo",
            "FakeProcessUtilizationSample",
        )
    ]
    wrong = dataclasses.replace(RESULTS[0], real_struct="c_nvmlMemory_t")  # a wrong table
    assert check_results(FakeNvml, pynvml, [wrong])[0] == (
        "pynvml.nvmlDeviceGetUtilizationRates does not build c_nvmlMemory_t: "
        "RESULTS names the wrong struct"
    )


# -- a fake broken on purpose must be caught ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _MisspelledMemory:
    total: int
    free: int
    usedd: int


def _v1_memory_as(convert: Callable[[FakeMemory], object]) -> type[FakeNvml]:
    """A FakeNvml whose ``nvmlDeviceGetMemoryInfo(handle)`` (v1) returns ``convert`` of
    the right result; v2 is left alone."""

    class Broken(FakeNvml):
        def nvmlDeviceGetMemoryInfo(
            self, handle: FakeDevice, version: int | None = None
        ) -> FakeMemory | FakeMemoryV2:
            good = super().nvmlDeviceGetMemoryInfo(handle, version)
            if isinstance(good, FakeMemoryV2):
                return good
            return convert(good)  # type: ignore[return-value]

    return Broken


_MisspelledField = _v1_memory_as(lambda m: _MisspelledMemory(m.total, m.free, m.used))


def test_a_misspelled_fake_field_fails_and_the_real_one_passes() -> None:
    """Issue 22's acceptance: ``usedd`` for ``c_nvmlMemory_t.used`` is named."""
    assert check_results(FakeNvml, pynvml) == []
    problems = fidelity_mismatches(_MisspelledField)
    assert problems
    assert any("'usedd'" in p and "c_nvmlMemory_t" in p for p in problems), problems
    assert any("lacks pynvml.c_nvmlMemory_t field(s) 'used'" in p for p in problems), problems


@dataclasses.dataclass(frozen=True)
class _FloatUtilization:
    gpu: float
    memory: int


class _WrongFieldType(FakeNvml):
    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> FakeUtilization:
        good = super().nvmlDeviceGetUtilizationRates(handle)
        return _FloatUtilization(good.gpu + 0.5, good.memory)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class _OldMemory:  # the fake's v1 result before issue 22: v2's fields, its own order
    total: int
    used: int
    free: int
    reserved: int = 0
    version: int = 0


_V2FieldsOnV1 = _v1_memory_as(lambda m: _OldMemory(m.total, m.used, m.free))


class _WrongSignature(FakeNvml):
    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeDevice, ver: int | None = None
    ) -> FakeMemory | FakeMemoryV2:
        return super().nvmlDeviceGetMemoryInfo(handle, ver)


class _RequiredVersion(FakeNvml):
    def nvmlDeviceGetMemoryInfo(  # type: ignore[override]
        self, handle: FakeDevice, version: int | None
    ) -> FakeMemory | FakeMemoryV2:
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def _with(name: str, value: object) -> Callable[[Sequence[FakeDevice]], FakeNvml]:
    def make(devices: Sequence[FakeDevice]) -> FakeNvml:
        fake = FakeNvml(devices)
        setattr(fake, name, value)
        return fake

    return make


@pytest.mark.parametrize(
    ("make_fake", "expected"),
    [
        pytest.param(
            _WrongFieldType,
            "_FloatUtilization (from nvmlDeviceGetUtilizationRates(handle)).gpu is float",
            id="float-for-c_uint",
        ),
        pytest.param(
            _V2FieldsOnV1,
            "_OldMemory (from nvmlDeviceGetMemoryInfo(handle)) has field(s) 'reserved', "
            "'version' that pynvml.c_nvmlMemory_t lacks",
            id="v2-fields-on-v1",
        ),
        pytest.param(
            _WrongSignature,
            "FakeNvml.nvmlDeviceGetMemoryInfo(handle, ver=None) differs from "
            "pynvml.nvmlDeviceGetMemoryInfo(handle, version=None)",
            id="parameter-renamed",
        ),
        pytest.param(
            _RequiredVersion,
            "FakeNvml.nvmlDeviceGetMemoryInfo(handle, version) differs",
            id="default-dropped",
        ),
        pytest.param(
            _with("nvmlDeviceGetUtilisationRates", lambda handle: None),
            "FakeNvml.nvmlDeviceGetUtilisationRates is not in pynvml",
            id="misspelled-function",
        ),
        pytest.param(
            _with("NVML_ERROR_GPU_IS_LOST", 16),
            "FakeNvml.NVML_ERROR_GPU_IS_LOST = 16, pynvml has 15",
            id="wrong-error-code",
        ),
        pytest.param(
            _with("nvmlEventTypeXidCriticalError", True),
            "FakeNvml.nvmlEventTypeXidCriticalError = True, pynvml has the int 8",
            id="bool-for-int",
        ),
        pytest.param(
            _with("nvmlDeviceGetPowerUsage", lambda handle, scale=1: 0),
            "FakeNvml.nvmlDeviceGetPowerUsage(handle, scale=1) differs from "
            "pynvml.nvmlDeviceGetPowerUsage(handle)",
            id="extra-parameter",
        ),
    ],
)
def test_a_fake_broken_on_purpose_is_named(
    make_fake: Callable[[Sequence[FakeDevice]], Any], expected: str
) -> None:
    problems = fidelity_mismatches(make_fake)
    assert any(p.startswith(expected) for p in problems), problems


def test_a_misspelled_name_in_gpuwatchds_source_is_named() -> None:
    sources = {
        "gpuwatchd/sampling/broken.py": (
            "def read(nvml, handle):\n"
            "    return nvml.nvmlDeviceGetPowerUsag(handle), getattr(nvml, 'NVML_ERROR_GPU_LOST')\n"
        )
    }
    assert fidelity_mismatches(sources=sources) == [
        "NVML_ERROR_GPU_LOST (read at gpuwatchd/sampling/broken.py:2) is not in pynvml",
        "NVML_ERROR_GPU_LOST (read at gpuwatchd/sampling/broken.py:2) is not on FakeNvml",
        "nvmlDeviceGetPowerUsag (read at gpuwatchd/sampling/broken.py:2) is not in pynvml",
        "nvmlDeviceGetPowerUsag (read at gpuwatchd/sampling/broken.py:2) is not on FakeNvml",
    ]


def test_optional_names_must_be_read_defensively_and_not_stale() -> None:
    sources = {
        "gpuwatchd/sampling/old.py": (
            "def f(nvml):\n"
            "    return getattr(nvml, 'nvmlDeviceGetFancyThing', None), nvml.nvmlGone\n"
        )
    }
    optional = {
        "nvmlDeviceGetFancyThing": "only in a future binding",
        "nvmlGone": "removed upstream",
        "nvmlInit": "an entry that pynvml does have",
        "nvmlNeverRead": "an entry nothing reads",
    }
    assert check_names_used(nvml_names_used(sources), FakeNvml(), pynvml, optional) == [
        "nvmlGone (read at gpuwatchd/sampling/old.py:2) may be missing from pynvml "
        "(removed upstream) but is not always read with getattr(..., default)",
        "OPTIONAL_IN_PYNVML entry nvmlInit (an entry that pynvml does have) is stale: "
        "pynvml has it",
        "OPTIONAL_IN_PYNVML entry nvmlNeverRead is stale: gpuwatchd never reads it",
    ]


def test_fake_only_helpers_are_listed_exactly() -> None:
    fake = FakeNvml()
    assert check_fake_surface(fake, pynvml, {**FAKE_ONLY, "nvmlInit": "x", "gone": "y"}) == [
        "FakeNvml.nvmlInit is listed in FAKE_ONLY but pynvml has it",
        "FAKE_ONLY entry gone is stale: FakeNvml has no such attribute",
    ]
    trimmed = {k: v for k, v in FAKE_ONLY.items() if k != "inject_xid"}
    assert check_fake_surface(fake, pynvml, trimmed) == [
        "FakeNvml.inject_xid is not in pynvml (misspelled, or a helper missing from FAKE_ONLY)"
    ]


def test_a_missing_or_wrong_error_code_or_text_is_named() -> None:
    broken = ModuleType("codes")
    broken.__dict__.update(vars(codes))
    del broken.__dict__["NVML_ERROR_NOT_READY"]
    broken.__dict__["NVML_ERROR_IN_USE"] = 91

    class Untranslated(codes.NVMLError):
        def __str__(self) -> str:
            return "Unknown" if self.value == 15 else super().__str__()

    broken.__dict__["NVMLError"] = Untranslated
    assert check_codes(FakeNvml(), broken, pynvml) == [
        "codes.NVML_ERROR_IN_USE = 91, pynvml has 19",
        "codes lacks pynvml's error code NVML_ERROR_NOT_READY",
        "str(NVMLError(15)) is 'Unknown', pynvml's is 'GPU is lost'",
    ]
    assert check_codes(FakeNvml(), codes, pynvml) == []
