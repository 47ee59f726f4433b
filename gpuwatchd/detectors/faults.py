"""Hardware-fault detectors: ``xid``, ``ecc_dbe``, ``row_remap``, ``gpu_lost``,
``gpu_throttled`` and ``gpu_recovered`` (pure: the snapshot's GPU samples and Xid errors
in, findings out; time is the snapshot's).

Each finds a fault **once per incident**, not at every tick while it lasts: an Xid event
(the same code on the same GPU within ``dedup`` is one incident), a rise of the volatile
double-bit ECC count, a row remap turning pending or failed, a GPU turning lost, a
throttle held for ``for:``. A policy acts on it once (``cordon_gpu`` keeps the GPU out of
placement until it is lifted); ``gpu_recovered`` finds the end of a fault that a GPU reset
clears, for ``uncordon_gpu``.

Sources: GpuHealth's fields (:class:`gpuwatchd.model.GpuHealth`: NVML field values
``NVML_FI_DEV_ECC_DBE_VOL_TOTAL``, ``NVML_FI_DEV_REMAPPED_PENDING`` /
``_FAILURE``, ``nvmlDeviceGetCurrentClocksEventReasons``), the NVML API reference
("Clocks Event Reasons": ``nvmlClocksEventReasonHwSlowdown`` 0x8,
``nvmlClocksEventReasonSwThermalSlowdown`` 0x20, ``nvmlClocksEventReasonHwThermalSlowdown``
0x40, ``nvmlClocksEventReasonHwPowerBrakeSlowdown`` 0x80, ``nvmlClocksEventReasonSwPowerCap``
0x4; the same values in pynvml and in tests/data/gpu/h100_nvml_probe.json), NVIDIA's
row-remapping guide (a pending remap needs a GPU reset; a failure needs service) and
the Xid table of :mod:`gpuwatchd.xid`. ``NVML_ERROR_GPU_IS_LOST``'s text is ``"GPU is
lost"`` (``nvmlErrorString``). Specification: docs/modules.md#gpuwatchddetectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from gpuwatchd.detectors.base import EPS_S, Detector
from gpuwatchd.detectors.params import Fail, ParamSpec, for_param, parse_bool
from gpuwatchd.model import NA, Finding, GpuSample
from gpuwatchd.units import format_duration, parse_duration
from gpuwatchd.windows import Scope, Windows
from gpuwatchd.xid import (
    XID_CLASSES,
    XID_MAX,
    XidInfo,
    cause_of,
    merged_table,
    parse_overrides,
)

__all__ = [
    "THROTTLE_BITS",
    "EccDbe",
    "GpuLost",
    "GpuRecovered",
    "GpuThrottled",
    "RowRemap",
    "Xid",
]

THROTTLE_BITS: Final[Mapping[str, int]] = {
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "sw_power_cap": 0x4,
}
"""``gpu_throttled``'s reasons -> their ``nvmlClocksEventReason*`` bit (NVML API
reference; pynvml): ``HwSlowdown``, ``SwThermalSlowdown``, ``HwThermalSlowdown``,
``HwPowerBrakeSlowdown``, ``SwPowerCap``."""

_DEFAULT_THROTTLE: Final = ("hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")
"""The slowdowns that mean heat or power trouble; ``sw_power_cap`` (the GPU at its power
limit, normal under full load) is left out unless asked for."""

LOST_TEXTS: Final = ("gpu is lost", "fallen off the bus")
"""Device errors (lower case) that mean the GPU is gone: ``NVML_ERROR_GPU_IS_LOST``'s
``nvmlErrorString`` and the driver's Xid 79 wording."""

_MAX_TRACKED: Final = 4096
"""Per-GPU or per-(GPU, code) entries kept at most (bounded memory on GPU churn)."""


def _names(value: object, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f"expected a {what} or a list of them ({', '.join(allowed)})")
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {what} {item!r} (known: {', '.join(allowed)})")
    return tuple(sorted(set(items)))


def _parse_classes(value: object) -> tuple[str, ...]:
    return _names(value, XID_CLASSES, "class")


def _parse_codes(value: object) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list) or not items or len(items) > 256:
        raise ValueError(f"expected an Xid code or a list of 1..256 of them, got {value!r}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= XID_MAX:
            raise ValueError(f"an Xid code must be an integer in 1..{XID_MAX}, got {item!r}")
    return tuple(sorted(set(items)))


def _parse_kinds(value: object) -> tuple[str, ...]:
    return _names(value, ("pending", "failure"), "kind")


def _parse_reasons(value: object) -> tuple[str, ...]:
    return _names(value, tuple(THROTTLE_BITS), "reason")


def _parse_min_new(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def _parse_dedup(value: object) -> float:
    seconds = parse_duration(value)
    if seconds > 86400:
        raise ValueError(f"at most 1d, got {value!r}")
    return seconds


def _gpu_finding(
    name: str, g: GpuSample, now: float, since: float, value: float, message: str
) -> Finding:
    return Finding(name, "gpu:" + g.uuid, now, since, value, 0.0, message, g.uuid, g.index, None)


def _bounded(state: dict[Any, Any]) -> None:
    if len(state) > _MAX_TRACKED:
        state.clear()


class _Incident(Detector):
    """A GPU fault found once per incident, from the latest GPU samples; no ``for:``."""

    scope: ClassVar[Scope] = "gpu"
    event: ClassVar[bool] = True

    def on_gap(self) -> None:
        """Keep the per-GPU state: a pause loses no fault (the counters are cumulative)."""


class Xid(_Incident):
    """An Xid error NVML reported for a GPU (``nvmlEventSetWait``; :mod:`gpuwatchd.xid`)
    whose code is of one of ``class`` (application, hardware, driver; the table's class,
    as ``table:`` reclassifies it) or is listed in ``codes``, and not in ``exclude``.
    Without ``class`` and ``codes``: the hardware class. One finding per incident: the
    same code on the same GPU again within ``dedup`` is the same incident. An Xid on a
    GPU the sampler does not know (index -1) is not found. Value: the Xid code.
    Replayed CSV traces carry no Xid errors."""

    name = "xid"
    description = "an Xid error of the given classes or codes on a GPU (NVIDIA's Xid catalog)"
    params = (
        ParamSpec(
            "class",
            _parse_classes,
            unit="list",
            help="Xid classes that match: application, hardware, driver (default: hardware "
            "when codes is not given either)",
        ),
        ParamSpec(
            "codes", _parse_codes, unit="list", help="Xid codes that match whatever their class"
        ),
        ParamSpec("exclude", _parse_codes, unit="list", help="Xid codes that never match"),
        ParamSpec(
            "table",
            parse_overrides,
            unit="mapping",
            help="reclassify or add codes: {'CODE': CLASS} or {'CODE': {class, name, action}} "
            "(action: none, restart_app, reset_gpu, reboot_node, rma; at most 64 rows)",
        ),
        ParamSpec(
            "dedup",
            _parse_dedup,
            default="1m",
            unit="duration",
            help="the same code on the same GPU within this is one incident (at most 1d)",
        ),
    )

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """Without ``class`` and ``codes``, ``class`` is ``[hardware]``."""
        if "class" not in parsed and "codes" not in parsed:
            parsed["class"] = ("hardware",)

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.classes: frozenset[str] = frozenset(params.get("class", ()))
        self.codes: frozenset[int] = frozenset(params.get("codes", ()))
        self.exclude: frozenset[int] = frozenset(params.get("exclude", ()))
        overrides: tuple[XidInfo, ...] = tuple(params.get("table", ()))
        self.table = merged_table(overrides)
        self.dedup_s = float(params.get("dedup", 60.0))
        self._seen: dict[tuple[str, int], float] = {}

    def reset(self) -> None:
        """Forget the incidents seen."""
        self._seen = {}

    def matches(self, code: int) -> bool:
        """Whether Xid ``code`` is one this detector finds."""
        if code in self.exclude:
            return False
        return code in self.codes or cause_of(code, self.table) in self.classes

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per new incident among the snapshot's Xid errors."""
        now = windows.now
        if now is None or not windows.xids:
            return []
        out: list[Finding] = []
        seen = self._seen
        for event in windows.xids:
            if event.gpu_index < 0 or not event.gpu_uuid or not self.matches(event.xid):
                continue
            key = (event.gpu_uuid, event.xid)
            last = seen.get(key)
            if last is not None and 0 <= now - last < self.dedup_s:
                seen[key] = now
                continue
            _bounded(seen)
            seen[key] = now
            info = self.table.get(event.xid)
            cause = cause_of(event.xid, self.table)
            text = "not in the table" if info is None else info.description
            action = "unknown" if info is None else info.action
            message = (
                f"GPU {event.gpu_index} Xid {event.xid} ({cause}; recommended: {action}): {text}"
            )
            out.append(
                Finding(
                    self.name,
                    "gpu:" + event.gpu_uuid,
                    now,
                    event.timestamp_s,
                    float(event.xid),
                    0.0,
                    message,
                    event.gpu_uuid,
                    event.gpu_index,
                    None,
                )
            )
        return out


class EccDbe(_Incident):
    """The GPU's volatile double-bit (uncorrectable) ECC count rose by at least
    ``min_new`` (``NVML_FI_DEV_ECC_DBE_VOL_TOTAL``; ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``).
    The count starts at 0 when the driver loads, so a GPU first seen with errors is
    found once; a count that falls (a GPU reset, a driver reload) is the new baseline;
    NA keeps the last known count. Value: the count; the message says by how much it
    rose. NVIDIA's catalog: a DBE needs a GPU reset (Xid 48)."""

    name = "ecc_dbe"
    description = "the volatile double-bit ECC error count of a GPU rose"
    params = (
        ParamSpec(
            "min_new",
            _parse_min_new,
            default=1,
            unit="count",
            help="new double-bit errors since the last sample that make an incident",
        ),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.min_new = int(params.get("min_new", 1))
        self._count: dict[str, int] = {}

    def reset(self) -> None:
        """Forget the counts (the next sample of each GPU is judged against 0)."""
        self._count = {}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per GPU whose count rose by ``min_new`` or more since its last."""
        now = windows.now
        if now is None:
            return []
        out: list[Finding] = []
        counts = self._count
        for g in windows.samples:
            count = g.health.ecc_dbe_volatile_total
            if count is NA:
                continue
            before = counts.get(g.uuid, 0)
            if g.uuid not in counts:
                _bounded(counts)
            counts[g.uuid] = count
            if count - before >= self.min_new:
                message = (
                    f"GPU {g.index} double-bit ECC errors rose by {count - before} to {count} "
                    "(volatile; uncorrectable: reset the GPU)"
                )
                out.append(_gpu_finding(self.name, g, now, now, float(count), message))
        return out


class RowRemap(_Incident):
    """A GPU's row remapping turned pending (``NVML_FI_DEV_REMAPPED_PENDING`` 1: a row
    awaits remapping, which a GPU reset applies) or failed (``NVML_FI_DEV_REMAPPED_FAILURE``
    1: no spare row was left; the GPU needs service), per ``kind``. Found when the flag
    turns 1 (a GPU first seen with it set too); again only after it was seen 0. Value 1;
    the message says which and what to do."""

    name = "row_remap"
    description = "a GPU's row remapping is pending (reset needed) or failed (service needed)"
    params = (
        ParamSpec(
            "kind",
            _parse_kinds,
            default=["pending", "failure"],
            unit="list",
            help="pending (a reset applies the remap) and/or failure (the GPU needs service)",
        ),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.kinds: tuple[str, ...] = tuple(params.get("kind", ("failure", "pending")))
        self._set: dict[tuple[str, str], bool] = {}

    def reset(self) -> None:
        """Forget the flags seen."""
        self._set = {}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per GPU and kind whose flag turned 1 at this tick."""
        now = windows.now
        if now is None:
            return []
        out: list[Finding] = []
        state = self._set
        for g in windows.samples:
            for kind in self.kinds:
                flag = (
                    g.health.row_remap_pending if kind == "pending" else g.health.row_remap_failure
                )
                if flag is NA:
                    continue
                key = (g.uuid, kind)
                was = state.get(key, False)
                if key not in state:
                    _bounded(state)
                state[key] = bool(flag)
                if flag and not was:
                    if kind == "pending":
                        message = (
                            f"GPU {g.index} has a row remap pending: reset the GPU to apply it"
                        )
                    else:
                        message = (
                            f"GPU {g.index} row remapping failed (no spare row): the GPU "
                            "needs service"
                        )
                    out.append(_gpu_finding(self.name, g, now, now, 1.0, message))
        return out


def _is_lost(error: str | None, any_error: bool) -> bool:
    if error is None:
        return False
    if any_error:
        return True
    text = error.lower()
    return any(t in text for t in LOST_TEXTS)


class GpuLost(_Incident):
    """NVML reports the GPU lost: the device's error is ``NVML_ERROR_GPU_IS_LOST`` ("GPU
    is lost") or says it fell off the bus (``any_error: true``: any NVML device error).
    Found when it turns lost (a GPU first seen lost too); again only after it answered.
    Value 1. Replayed CSV traces carry no device errors."""

    name = "gpu_lost"
    description = "NVML reports a GPU lost (NVML_ERROR_GPU_IS_LOST, fallen off the bus)"
    params = (
        ParamSpec(
            "any_error",
            parse_bool,
            default=False,
            unit="bool",
            help="any NVML error of the device counts, not only GPU is lost",
        ),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.any_error = bool(params.get("any_error", False))
        self._lost: dict[str, bool] = {}

    def reset(self) -> None:
        """Forget which GPUs were lost."""
        self._lost = {}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per GPU that turned lost at this tick."""
        now = windows.now
        if now is None:
            return []
        out: list[Finding] = []
        state = self._lost
        for g in windows.samples:
            lost = _is_lost(g.error, self.any_error)
            was = state.get(g.uuid, False)
            if g.uuid not in state:
                _bounded(state)
            state[g.uuid] = lost
            if lost and not was:
                message = f"GPU {g.index} is lost: {g.error} (reset the GPU or reboot the node)"
                out.append(_gpu_finding(self.name, g, now, now, 1.0, message))
        return out


class GpuThrottled(Detector):
    """A GPU's clocks slowed for one of ``reasons`` (``nvmlDeviceGetCurrentClocksEventReasons``
    bits, :data:`THROTTLE_BITS`: ``hw_slowdown``, ``hw_thermal``, ``sw_thermal``,
    ``hw_power_brake`` by default; ``sw_power_cap`` on request) at every sample for
    ``for:``. Found once per incident, when the streak reaches ``for:``; a sample without
    those bits ends the incident, an NA sample or a pause breaks the streak. Value: the
    reason bits seen; the message names them. Default ``for: 1m``."""

    name = "gpu_throttled"
    scope: ClassVar[Scope] = "gpu"
    description = "a GPU's clocks held down by thermal or power slowdown (clock event reasons)"
    params = (
        ParamSpec(
            "reasons",
            _parse_reasons,
            default=list(_DEFAULT_THROTTLE),
            unit="list",
            help="hw_slowdown, hw_thermal, sw_thermal, hw_power_brake, sw_power_cap",
        ),
        for_param("1m"),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.reasons: tuple[str, ...] = tuple(params.get("reasons", _DEFAULT_THROTTLE))
        mask = 0
        for reason in self.reasons:
            mask |= THROTTLE_BITS[reason]
        self.mask = mask
        self._start: dict[str, float] = {}
        self._fired: set[str] = set()

    def reset(self) -> None:
        """Forget the streaks and the incidents found."""
        self._start = {}
        self._fired = set()

    def streaks(self) -> dict[str, float]:
        """GPUs throttled now -> since when."""
        return {"gpu:" + uuid: t for uuid, t in self._start.items()}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per GPU whose throttle streak reached ``for:`` at this tick."""
        now = windows.now
        if now is None:
            return []
        out: list[Finding] = []
        start: dict[str, float] = {}
        fired: set[str] = set()
        for g in windows.samples:
            reasons = g.health.clocks_event_reasons
            if reasons is NA:
                continue  # not known: the streak breaks, the incident may begin again
            bits = reasons & self.mask
            if not bits:
                continue
            since = start[g.uuid] = self._start.get(g.uuid, now)
            if g.uuid in self._fired:
                fired.add(g.uuid)
                continue
            if now - since >= self.for_s - EPS_S:
                fired.add(g.uuid)
                names = [r for r, bit in THROTTLE_BITS.items() if bits & bit]
                message = (
                    f"GPU {g.index} clocks slowed by {', '.join(names)} for "
                    f"{format_duration(now - since)} (clocks event reasons 0x{reasons:x})"
                )
                out.append(_gpu_finding(self.name, g, now, since, float(bits), message))
        self._start = start
        self._fired = fired
        return out


class GpuRecovered(_Incident):
    """A fault that a GPU reset clears has cleared: a pending row remap went back to 0
    (the reset applied it), a lost GPU answers again, or the volatile double-bit ECC
    count fell back (the reset or a driver reload zeroed it). Found once when it
    happens; the default policies lift their own cordon with it (``uncordon_gpu``)."""

    name = "gpu_recovered"
    description = "a GPU reset cleared a fault: remap pending back to 0, a lost GPU answers"
    params = ()

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self._last: dict[str, tuple[object, bool, object]] = {}

    def reset(self) -> None:
        """Forget the GPUs' last states."""
        self._last = {}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per GPU whose fault cleared at this tick."""
        now = windows.now
        if now is None:
            return []
        out: list[Finding] = []
        last = self._last
        for g in windows.samples:
            pending = g.health.row_remap_pending
            lost = _is_lost(g.error, False)
            dbe = g.health.ecc_dbe_volatile_total
            before = last.get(g.uuid)
            if before is None:
                _bounded(last)
            else:
                was_pending, was_lost, was_dbe = before
                cleared = []
                if was_pending == 1 and pending == 0:
                    cleared.append("row remap pending cleared (the GPU was reset)")
                if was_lost and not lost and g.error is None:
                    cleared.append("the lost GPU answers again")
                if (
                    isinstance(was_dbe, int)
                    and isinstance(dbe, int)
                    and was_dbe > 0
                    and dbe < was_dbe
                ):
                    cleared.append(f"volatile double-bit ECC count reset ({was_dbe} -> {dbe})")
                if cleared:
                    message = f"GPU {g.index} recovered: {'; '.join(cleared)}"
                    out.append(_gpu_finding(self.name, g, now, now, 1.0, message))
            # NA keeps the last known value (an NA is not a recovery)
            last[g.uuid] = (
                pending if pending is not NA else (before[0] if before else NA),
                lost if g.error is None or lost else (before[1] if before else False),
                dbe if dbe is not NA else (before[2] if before else NA),
            )
        return out
