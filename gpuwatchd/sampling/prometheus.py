"""dcgm-exporter's series read back from Prometheus (``gpuwatchd replay --prometheus``).

``query_range`` over HTTP (requests), in chunks of at most :data:`CHUNK_STEPS` steps
per series, every response bounded and checked; the series become one trace per
``Hostname`` as the Parquet reader makes them (GPUs named ``host/index``), read whole
(:func:`read_prometheus`) or chunk by chunk (:func:`stream_prometheus`).
Specification: docs/backtests.md#backtest-from-prometheus.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final
from urllib.parse import urlsplit

from gpuwatchd.errors import ReplayError
from gpuwatchd.sampling.trace import DCGM_COLUMNS, Trace

__all__ = [
    "CHUNK_STEPS",
    "DCGM_SERIES",
    "GPUWATCHD_SERIES",
    "MAX_REPLAY_POINTS",
    "MAX_RESPONSE_BYTES",
    "POINTS_PER_REQUEST",
    "SERIES",
    "ProfilingSeries",
    "PrometheusRange",
    "check_match",
    "check_url",
    "gpu_indexes",
    "parse_time",
    "read_prometheus",
    "stream_prometheus",
]

_MIB: Final = 2**20

DCGM_SERIES: Final[Mapping[str, tuple[str, float]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("utilization_gpu_pct", 1.0),
    "DCGM_FI_DEV_FB_USED": ("memory_used_bytes", float(_MIB)),
    "DCGM_FI_DEV_FB_FREE": ("memory_free_bytes", float(_MIB)),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_gpu_c", 1.0),
    "DCGM_FI_DEV_POWER_USAGE": ("power_draw_w", 1.0),
    **{name: field for name, field in DCGM_COLUMNS.items() if name.startswith("DCGM_FI_PROF_")},
}
"""dcgm-exporter's series read -> (GpuSample field, factor from the value to its unit).
Units as dcgm-exporter's default counters (etc/default-counters.csv) give them: %, MiB
(``memory_total_bytes`` is FB_USED + FB_FREE), °C, W, and the ``DCGM_FI_PROF_*`` ratios
0..1 (x 100, as gpuwatchd/sampling/trace.py DCGM_COLUMNS reads them from a CSV)."""

GPUWATCHD_SERIES: Final[Mapping[str, tuple[str, float]]] = {
    "gpuwatchd_gpu_utilization_ratio": ("utilization_gpu_pct", 100.0),
    "gpuwatchd_gpu_memory_used_bytes": ("memory_used_bytes", 1.0),
    "gpuwatchd_gpu_memory_total_bytes": ("memory_total_bytes", 1.0),
    "gpuwatchd_gpu_temperature_celsius": ("temperature_gpu_c", 1.0),
    "gpuwatchd_gpu_power_draw_watts": ("power_draw_w", 1.0),
    **{
        f"gpuwatchd_gpu_{name}_ratio": (f"{name}_pct", 100.0)
        for name in ("sm_active", "sm_occupancy", "tensor_active", "dram_active")
    },
}
"""gpuwatchd's own per-GPU series (gpuwatchd/metrics/collector.py, docs/metrics.md) ->
(GpuSample field, factor): ratios 0..1 x 100, bytes, °C, W; the same four labels as
dcgm-exporter's once contrib/prometheus/scrape.yml renames ``model_name``."""

SERIES: Final[Mapping[str, Mapping[str, tuple[str, float]]]] = {
    "dcgm-exporter": DCGM_SERIES,
    "gpuwatchd": GPUWATCHD_SERIES,
}
"""``--series`` -> the series read."""

_PROFILING_FIELDS: Final = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct",
                             "dram_active_pct")  # fmt: skip
"""GpuSample's fields from DCGM profiling (NVML GPM): a host with any is replayed as
samples, for the per-sample engine."""

MAX_POINTS_PER_SERIES: Final = 11_000
"""Prometheus refuses a ``query_range`` of more points per series (its error: "exceeded
maximum resolution of 11,000 points per timeseries", in the upstream repository
prometheus/prometheus, its HTTP API's query_range handler)."""
CHUNK_STEPS: Final = 10_000
"""Steps asked for per ``query_range`` (under :data:`MAX_POINTS_PER_SERIES`)."""
POINTS_PER_REQUEST: Final = 100_000
"""Points asked for per request, all series together: the steps per request are this over
the number of series the selector names (``/api/v1/series``), at most
:data:`CHUNK_STEPS`. About 2 MiB of JSON (~19 bytes a point) and 17 MiB of Python
objects while parsed (~170 bytes a point: a list, an int and a str), the most a streamed
read holds at once; 500,000 made a replay's peak RSS 65 MiB higher, and for no less wall
time (docs/benchmarks.md, "Replay from Prometheus")."""
MAX_STEPS: Final = 50_000_000
"""Most steps one replay asks for (a year at 1 s; 23 years at 15 s)."""
MAX_REPLAY_POINTS: Final = 20_000_000
"""Most points one whole read (:func:`read_prometheus`) may hold, all series together
(series the selector names x steps): each is kept as 16 bytes (time, value) until the
host's frames are built, then 8 more bytes a field, so about 0.5 GiB at the cap. A wider
read is refused before any point is fetched, with advice to narrow ``--match`` or
lengthen ``--step``. A streamed read (:func:`stream_prometheus`) holds one request's
points at a time and has no such cap."""
MAX_RESPONSE_BYTES: Final = 64 * _MIB
"""Largest response body read (a request of :data:`POINTS_PER_REQUEST` points is about
2 MiB; a series list of 64 MiB is about 300,000 series); a larger one is refused with
advice to narrow ``--match``."""
TIMEOUT_S: Final = (10.0, 120.0)
"""(connect, read) timeouts of one request, seconds."""
MAX_MATCH_CHARS: Final = 2000
"""Longest ``--match`` selector."""
_EARLIEST_S: Final = 0.0
_LATEST_S: Final = 4102444800.0  # 2100-01-01T00:00:00Z


class ProfilingSeries(Exception):
    """Raised by :func:`stream_prometheus` before any ``query_range`` when a host has a
    ``DCGM_FI_PROF_*`` (``*_ratio``) series: its samples need the per-sample engine,
    read it whole (:func:`read_prometheus`)."""


@dataclass(frozen=True)
class PrometheusRange:
    """What to read: ``url`` (http/https, no query), ``start_s``/``end_s`` (UTC seconds,
    start <= end), ``step_s`` (> 0, whole milliseconds), ``match`` (a label selector
    ``{...}`` or ``""``), ``series`` (a key of :data:`SERIES`). Build it with
    :func:`check_url`, :func:`parse_time`, :func:`check_match`."""

    url: str
    start_s: float
    end_s: float
    step_s: float
    match: str = ""
    series: str = "dcgm-exporter"


def check_url(url: str) -> str:
    """``url`` without a trailing ``/``; ReplayError unless it is ``http://`` or
    ``https://`` with a host and without query or fragment (Prometheus's base URL, e.g.
    ``http://prometheus:9090`` or a Thanos/Mimir prefix ``https://mimir/prometheus``)."""
    if len(url) > 2000:
        raise ReplayError("--prometheus: URL longer than 2000 characters")
    parts = urlsplit(url)
    shown = _redacted(url, url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplayError(f"--prometheus {shown!r}: not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ReplayError(f"--prometheus {shown!r}: give the base URL, without ?query or #fragment")
    return url.rstrip("/")


def _redacted(text: str, url: str) -> str:
    """``text`` with ``url``'s user information (``user:password@``) shown as ``***@``:
    error messages never carry the credentials."""
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    return text.replace(userinfo + at, "***@") if at else text


def parse_time(text: str, option: str) -> float:
    """``text`` (RFC 3339, ``2025-07-26T23:53:30Z``, a zone offset or none meaning UTC; or
    Unix seconds) as UTC seconds between 1970 and 2100; ReplayError naming ``option``."""
    try:
        value = float(text)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(text.strip())
        except ValueError:
            raise ReplayError(
                f"{option} {text!r}: not a time (RFC 3339 like 2025-07-26T23:53:30Z, "
                "or Unix seconds)"
            ) from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        value = parsed.timestamp()
    if not (math.isfinite(value) and _EARLIEST_S <= value < _LATEST_S):
        raise ReplayError(f"{option} {text!r}: outside 1970-2100")
    return value


def check_match(match: str | None) -> str:
    """The ``--match`` selector (``{Hostname=~"gpu-.*"}``): ``""`` for None, else
    ``{...}`` of at most :data:`MAX_MATCH_CHARS` characters (Prometheus parses the
    matchers and says what is wrong with them); ReplayError otherwise."""
    if match is None or not match.strip():
        return ""
    match = match.strip()
    if len(match) > MAX_MATCH_CHARS or not (match.startswith("{") and match.endswith("}")):
        raise ReplayError(
            f"--match {match[:80]!r}: give label matchers in braces, e.g. "
            "'{Hostname=~\"gpu-.*\"}' (at most 2000 characters)"
        )
    if "__name__" in match:
        raise ReplayError("--match: the series read are fixed; match on other labels")
    return match


def _selector(match: str, series: Mapping[str, tuple[str, float]]) -> str:
    names = "|".join(series)
    inner = match[1:-1].strip().rstrip(",") if match else ""
    return "{" + f'__name__=~"{names}"' + (f",{inner}" if inner else "") + "}"


def _chunks(start_ms: int, end_ms: int, step_ms: int, steps: int) -> Iterator[tuple[int, int]]:
    """(first, last) evaluation times (ms) of each request, ``steps`` steps each."""
    first = start_ms
    while first <= end_ms:
        last = min(first + (steps - 1) * step_ms, end_ms)
        yield first, last
        first = last + step_ms


def _fetch(session: Any, url: str, form: dict[str, str]) -> bytes:
    """The body of one POST (at most :data:`MAX_RESPONSE_BYTES`); ReplayError otherwise."""
    import requests

    try:
        with session.post(url, data=form, timeout=TIMEOUT_S, stream=True) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
                raise ReplayError(_too_large(url))
            body = bytearray()
            for piece in response.iter_content(chunk_size=1 << 20):
                body += piece
                if len(body) > MAX_RESPONSE_BYTES:
                    raise ReplayError(_too_large(url))
            status = response.status_code
    except requests.RequestException as exc:
        raise ReplayError(f"{url}: {type(exc).__name__}: {exc}") from None
    if status != 200:
        detail = _error_text(bytes(body))
        raise ReplayError(f"{url}: HTTP {status}" + (f": {detail}" if detail else ""))
    return bytes(body)


def _too_large(url: str) -> str:
    return (
        f"{url}: response over {MAX_RESPONSE_BYTES // _MIB} MiB; select fewer GPUs with "
        "--match or use a longer --step"
    )


def _error_text(body: bytes) -> str:
    """Prometheus's ``errorType: error`` of an error body, or its first 200 characters."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace").strip()
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return f"{doc.get('errorType', 'error')}: {doc['error'][:500]}"
    return ""


def _matrix(body: bytes, url: str) -> list[tuple[dict[str, str], list[Any]]]:
    """The ``(labels, [[t, "v"], ...])`` of a query_range answer; ReplayError for any
    other shape (https://prometheus.io/docs/prometheus/latest/querying/api/)."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ReplayError(f"{url}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        detail = doc.get("error") if isinstance(doc, dict) else None
        raise ReplayError(f"{url}: query failed: {detail or 'no status success'}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise ReplayError(f"{url}: the answer is not a range vector (resultType matrix)")
    result = data.get("result")
    if not isinstance(result, list):
        raise ReplayError(f"{url}: data.result is not a list")
    out = []
    for series in result:
        labels = series.get("metric") if isinstance(series, dict) else None
        values = series.get("values") if isinstance(series, dict) else None
        if not (isinstance(labels, dict) and isinstance(values, list)) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ReplayError(f"{url}: a series without metric labels or values")
        out.append((labels, values))
    return out


@dataclass
class _Series:
    """The points of one GPU's metric, a numpy array per request: times (ms, int64) and
    values (float64, in GpuSample's unit)."""

    times_ms: list[Any] = dataclasses.field(default_factory=list)
    values: list[Any] = dataclasses.field(default_factory=list)


@dataclass
class _Gpu:
    uuid: str
    name: str
    series: dict[str, _Series] = dataclasses.field(default_factory=dict)


def _points(values: list[Any], factor: float, url: str) -> tuple[Any, Any]:
    """``values`` (``[[t, "v"], ...]``) as (times ms, int64; values x ``factor``,
    float64): arrays of 16 bytes a point instead of the answer's ~180 (a list, an int and
    a str). ReplayError for a point that is not ``[time, "value"]``, a value that is not
    a number, a time outside 1970-2100."""
    import numpy as np

    # the types as sets (map and set in C; a check per point in Python was most of the
    # read's CPU): JSON gives exact types, a bool's is not int's
    shape_ok = set(map(type, values)) <= {list} and set(map(len, values)) <= {2}
    times = [p[0] for p in values] if shape_ok else []
    texts = [p[1] for p in values] if shape_ok else []
    if not (shape_ok and set(map(type, times)) <= {int, float} and set(map(type, texts)) <= {str}):
        raise ReplayError(f'{url}: a point that is not [time, "value"] (a number, a string)')
    try:
        numbers = np.array(texts, dtype=np.float64)
    except ValueError:
        raise ReplayError(f"{url}: a point whose value is not a number") from None
    try:
        stamps = np.array(times, dtype=np.float64)
    except OverflowError:  # a JSON integer beyond a double's range
        stamps = np.array([np.inf])
    if stamps.size and not (
        np.isfinite(stamps).all() and stamps.min() >= 0 and stamps.max() < _LATEST_S
    ):
        raise ReplayError(f"{url}: a point whose time is not within 1970-2100")
    return np.round(stamps * 1000.0).astype(np.int64), numbers * factor


def _add_points(gpu: _Gpu, field: str, times_ms: Any, values: Any) -> None:
    """Append one answer's points (:func:`_points`) to ``gpu``'s ``field``."""
    series = gpu.series.setdefault(field, _Series())
    series.times_ms.append(times_ms)
    series.values.append(values)


def _series_list(session: Any, query: PrometheusRange, selector: str) -> list[dict[str, str]]:
    """The label sets of the series ``selector`` names in the range (``/api/v1/series``,
    the index only); ReplayError as :func:`_fetch` and for a malformed answer."""
    url = f"{query.url}/api/v1/series"
    form = {"match[]": selector, "start": f"{query.start_s:.3f}", "end": f"{query.end_s:.3f}"}
    try:
        doc = json.loads(_fetch(session, url, form))
    except ValueError as exc:
        raise ReplayError(f"{url}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        raise ReplayError(f"{url}: query failed: {_error_text(json.dumps(doc).encode())}")
    data = doc.get("data")
    if not isinstance(data, list) or not all(
        isinstance(labels, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        for labels in data
    ):
        raise ReplayError(f"{url}: data is not a list of series")
    return data


def read_prometheus(query: PrometheusRange, session: Any = None) -> list[Any]:
    """One trace per ``Hostname`` of ``query.series`` (dcgm-exporter's
    :data:`DCGM_SERIES` or gpuwatchd's :data:`GPUWATCHD_SERIES`) in ``query``'s range, in
    host order: a :class:`~gpuwatchd.sampling.columns.TraceColumns` (path the host, GPUs
    named ``host/<gpu label>``, uuid from ``UUID``, model from ``modelName`` or
    ``model_name``), or a :class:`~gpuwatchd.sampling.trace.Trace` with SM activity where
    a ``DCGM_FI_PROF_*`` (``*_ratio``) series is present (the per-sample engine judges
    it). Frames are the evaluation times (``start + k * step``) where any series of the
    host has a value; a metric without a value at a frame is NA. ``session``: a
    ``requests.Session`` (default a new one). Raises :class:`~gpuwatchd.errors.ReplayError`
    for a server that cannot be reached, an error answer, a malformed or oversized answer,
    more than :data:`MAX_REPLAY_POINTS` points, or no series; its message shows the URL without
    user information."""
    try:
        return _read(query, session)
    except ReplayError as exc:
        raise ReplayError(_redacted(str(exc), query.url)) from None


def _read(query: PrometheusRange, session: Any) -> list[Any]:
    """:func:`read_prometheus`, with the URL as given in its errors."""
    hosts: dict[str, dict[str, _Gpu]] = {}
    with _session(session) as own:
        _, answers = _requests(query, own, whole=True)
        for answer in answers:
            for host, label, uuid, model, field, times_ms, values in answer:
                gpu = hosts.setdefault(host, {}).setdefault(label, _Gpu(uuid, model))
                _add_points(gpu, field, times_ms, values)
    if not hosts:
        raise ReplayError(_no_series(query))
    return [_host_trace(host, hosts[host]) for host in sorted(hosts)]


def stream_prometheus(
    query: PrometheusRange, session: Any = None
) -> Generator[dict[str, Any], None, None]:
    """The series of :func:`read_prometheus`, one ``query_range`` request at a time (a
    range of at most :data:`CHUNK_STEPS` steps, :data:`POINTS_PER_REQUEST` points): for
    each, ``{host: TraceColumns}`` of the frames of each host within it (hosts with no
    value there left out), in time order, so that memory does not grow with the range.
    Each host's GPUs are those the series list (``/api/v1/series``) names for it, the
    same in every chunk (NA where a GPU has no value); uuid and model from the first
    series listed of each GPU. Raises :class:`ProfilingSeries` (before any
    ``query_range``) when a host has SM activity, and ReplayError as
    :func:`read_prometheus`, but for :data:`MAX_REPLAY_POINTS`, which a streamed read
    does not need."""
    try:
        with _session(session) as own:
            listed, answers = _requests(query, own, whole=False)
            gpus = _listed_gpus(listed, SERIES[query.series])
            if not gpus:
                raise ReplayError(_no_series(query))
            # map: no loop variable keeps an answer while the next one is read
            yield from map(functools.partial(_chunk_traces, gpus), answers)
    except ReplayError as exc:
        raise ReplayError(_redacted(str(exc), query.url)) from None


def _chunk_traces(gpus: Mapping[str, Mapping[str, _Gpu]], answer: list[Point]) -> dict[str, Any]:
    """``{host: TraceColumns}`` of one answer's points, for :func:`stream_prometheus`:
    each host's listed ``gpus`` (a series not listed is left out: it came after the list)."""
    found: dict[str, dict[str, _Gpu]] = {}
    for host, label, _, _, field, times_ms, values in answer:
        known = gpus.get(host, {}).get(label)
        if known is not None:
            gpu = found.setdefault(host, {}).setdefault(label, _Gpu(known.uuid, known.name))
            _add_points(gpu, field, times_ms, values)
    return {
        host: _host_trace(host, {**_empty(gpus[host]), **found[host]}) for host in sorted(found)
    }


def _empty(gpus: Mapping[str, _Gpu]) -> dict[str, _Gpu]:
    """``gpus`` without points (a chunk's GPUs that have no value in it)."""
    return {label: _Gpu(gpu.uuid, gpu.name) for label, gpu in gpus.items()}


def _listed_gpus(
    listed: Sequence[Mapping[str, str]], wanted: Mapping[str, tuple[str, float]]
) -> dict[str, dict[str, _Gpu]]:
    """``{host: {gpu label: _Gpu}}`` of the series list; :class:`ProfilingSeries` when a
    series of SM activity (DCGM profiling) is among them."""
    out: dict[str, dict[str, _Gpu]] = {}
    for labels in listed:
        series = _series_of(labels, wanted)
        if series is None:
            continue
        host, gpu, uuid, model, field = series
        if field[0] in _PROFILING_FIELDS:
            raise ProfilingSeries(labels["__name__"])
        out.setdefault(host, {}).setdefault(gpu, _Gpu(uuid, model))
    return out


SeriesLabels = tuple[str, str, str, str, tuple[str, float]]
"""(host, gpu label, uuid, model, (GpuSample field, factor)) of one series."""


def _series_of(
    labels: Mapping[str, str], wanted: Mapping[str, tuple[str, float]]
) -> SeriesLabels | None:
    """The :data:`SeriesLabels` of a series' labels, or None unless its metric is one of
    ``wanted`` and it has a ``gpu`` label (the series list and every ``query_range``
    answer are read alike)."""
    metric = labels.get("__name__", "")
    if metric not in wanted or "gpu" not in labels:
        return None
    host = labels.get("Hostname") or labels.get("instance") or "prometheus"
    model = labels.get("modelName") or labels.get("model_name", "")
    return host, labels["gpu"], labels.get("UUID", ""), model, wanted[metric]


def _query_url(query: PrometheusRange) -> str:
    return f"{query.url}/api/v1/query_range"


def _no_series(query: PrometheusRange) -> str:
    wanted = SERIES[query.series]
    return (
        f"{query.url}: no {query.series} series ({', '.join(wanted)}) with a gpu "
        f"label{' matching ' + query.match if query.match else ''} in that range"
    )


@contextlib.contextmanager
def _session(session: Any) -> Iterator[Any]:
    """``session``, or a new ``requests.Session`` closed at the end."""
    if session is not None:
        yield session
        return
    import requests

    with requests.Session() as own:
        own.headers["User-Agent"] = "gpuwatchd-replay"
        own.max_redirects = 3
        yield own


Point = tuple[str, str, str, str, str, Any, Any]
"""One series in one ``query_range`` answer: host, gpu label, uuid, model, GpuSample
field, and its points as arrays (:func:`_points`: times ms, values in the field's unit)."""


def _requests(
    query: PrometheusRange, session: Any, whole: bool
) -> tuple[list[dict[str, str]], Iterator[list[Point]]]:
    """The series list of ``query`` (fetched now) and its ``query_range`` answers, one
    per request as they are iterated; ``whole``: refuse more than
    :data:`MAX_REPLAY_POINTS` points. ReplayError for bad bounds."""
    start_ms, end_ms = round(query.start_s * 1000), round(query.end_s * 1000)
    step_ms = round(query.step_s * 1000)
    if step_ms < 1 or abs(query.step_s * 1000 - step_ms) > 1e-6:
        raise ReplayError("--step: must be a positive whole number of milliseconds")
    if end_ms < start_ms:
        raise ReplayError("--end is before --start")
    all_steps = (end_ms - start_ms) // step_ms + 1
    if all_steps > MAX_STEPS:
        raise ReplayError(f"--start..--end / --step: more than {MAX_STEPS:,} steps")
    url = _query_url(query)
    wanted = SERIES.get(query.series)
    if wanted is None:
        raise ReplayError(f"--series {query.series!r}: one of {', '.join(SERIES)}")
    selector = _selector(query.match, wanted)
    listed = _series_list(session, query, selector)
    count = len(listed)
    if whole and count * all_steps > MAX_REPLAY_POINTS:
        raise ReplayError(
            f"{query.url}: {count:,} series x {all_steps:,} steps is more than "
            f"{MAX_REPLAY_POINTS:,} points; select fewer GPUs with --match, use a longer "
            "--step or a shorter --start..--end"
        )
    steps = max(1, min(CHUNK_STEPS, POINTS_PER_REQUEST // max(count, 1)))

    def answers() -> Iterator[list[Point]]:
        for first, last in _chunks(start_ms, end_ms, step_ms, steps):
            form = {
                "query": selector,
                "start": f"{first / 1000:.3f}",
                "end": f"{last / 1000:.3f}",
                "step": f"{step_ms / 1000:.3f}",
            }
            yield _answer(session, url, form, wanted)

    return listed, answers()


def _answer(
    session: Any, url: str, form: dict[str, str], wanted: Mapping[str, tuple[str, float]]
) -> list[Point]:
    """One ``query_range`` request's series of ``wanted`` as arrays; each series' JSON is
    let go once it is converted, and nothing of the answer is kept past the return (the
    next request is not read while this one's JSON is held). ReplayError as
    :func:`_fetch`, :func:`_matrix`, :func:`_points`."""
    matrix = _matrix(_fetch(session, url, form), url)
    matrix.reverse()
    answer: list[Point] = []
    while matrix:
        labels, values = matrix.pop()
        series = _series_of(labels, wanted)
        if series is not None:
            host, gpu, uuid, model, (field, factor) = series
            answer.append((host, gpu, uuid, model, field, *_points(values, factor, url)))
    return answer


def gpu_indexes(host: str, labels: Iterable[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The ``gpu`` labels of ``host``'s series in NVML order and the index each names:
    a label of at most 9 ASCII digits is its index (numbered GPUs first, by index); any
    other label (a UUID, ``²``) gets the next index after every numbered GPU's, in label
    order. Raises :class:`~gpuwatchd.errors.ReplayError` for two labels naming one
    index (``1`` and ``01``)."""
    numbered: dict[str, int] = {}
    others: list[str] = []
    for label in labels:
        if label.isascii() and label.isdigit() and len(label) <= 9:
            numbered[label] = int(label)
        else:
            others.append(label)
    ordered = sorted(numbered, key=lambda g: (numbered[g], g))
    indexes = [numbered[g] for g in ordered]
    if len(set(indexes)) != len(indexes):
        raise ReplayError(f"{host}: two GPUs with one index")
    spare = max(indexes, default=-1) + 1
    others.sort()
    return (
        (*ordered, *others),
        (*indexes, *range(spare, spare + len(others))),
    )


def _host_trace(host: str, gpus: dict[str, _Gpu]) -> Any:
    """The frames of one host's GPUs (see :func:`read_prometheus`)."""
    import numpy as np

    from gpuwatchd.sampling.columns import TraceColumns

    labels, indexes = gpu_indexes(host, gpus)
    uuids = tuple(gpus[g].uuid or f"GPU-replay-{host}-{g}" for g in labels)
    if len(set(uuids)) != len(uuids):
        raise ReplayError(f"{host}: two GPUs with one UUID")
    every = [t for g in labels for s in gpus[g].series.values() for t in s.times_ms]
    times_ms = np.unique(np.concatenate(every))
    shape = (times_ms.shape[0], len(labels))
    arrays: dict[str, Any] = {}
    for k, label in enumerate(labels):
        for field, series in gpus[label].series.items():
            column = arrays.setdefault(field, np.full(shape, np.nan))
            for stamps, values in zip(series.times_ms, series.values, strict=True):
                column[np.searchsorted(times_ms, stamps), k] = values
    nan = np.full(shape, np.nan)
    used = arrays.get("memory_used_bytes", nan)
    total = arrays.get("memory_total_bytes", used + arrays.get("memory_free_bytes", nan))
    columns = TraceColumns(
        host,
        uuids,
        indexes,
        tuple(f"{host}/{g}" for g in labels),
        times_ms.astype(np.float64) / 1000.0,
        arrays.get("utilization_gpu_pct", nan),
        used,
        total,
        arrays.get("temperature_gpu_c", nan),
        arrays.get("power_draw_w", nan),
        np.zeros(shape),
    )
    profiling = {f: a for f, a in arrays.items() if f in _PROFILING_FIELDS}
    return columns if not profiling else _with_profiling(columns, profiling)


def _with_profiling(columns: Any, profiling: Mapping[str, Any]) -> Trace:
    """``columns`` as frames whose samples carry the DCGM profiling fields (NA for NaN)."""
    from gpuwatchd.model import NA

    trace: Trace = columns.to_trace()
    frames = []
    for row, frame in enumerate(trace.frames):
        samples: Sequence[Any] = frame.samples
        samples = tuple(
            dataclasses.replace(
                s,
                **{
                    f: (NA if math.isnan(v := float(a[row, k])) else v)
                    for f, a in profiling.items()
                },
            )
            for k, s in enumerate(samples)
        )
        frames.append(dataclasses.replace(frame, samples=samples))
    return dataclasses.replace(trace, frames=tuple(frames))
