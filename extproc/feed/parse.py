"""Normalize the Prometheus page of one inference server into per-model KV and queue signals.

Pure: text in, dataclasses out. Every metric name the feedback path reads is listed once, in
`METRIC_TABLE` below (mirrored by the table in docs/feedback.md, checked by a test), and matched by exact
name: a prefix match on `vllm:num_requests_waiting` would also count `vllm:num_requests_waiting_by_reason`.

Multiple series per server: vLLM labels one series per data-parallel engine (`engine`), SGLang per rank
(`tp_rank`, `pp_rank`, `dp_rank`). Each server kind names its *replica labels*, the labels whose values are
independent schedulers with their own queue and KV pool (vLLM `engine`, SGLang `dp_rank`). Counts
(waiting, running, preemptions) and capacity are summed across replica groups; inside a group (tensor- or
pipeline-parallel ranks of the same scheduler, which report the same queue) the max is taken so a TP=8
server does not look eight times as busy. KV usage is the max over all series (mean on request): the
fullest engine is the one that preempts first.

Garbage (an HTML error page, JSON from trtllm-serve's `/metrics`, truncated lines) raises
`MetricsParseError`, the only exception this module raises for bad input.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class ServerKind(StrEnum):
    """Inference server flavours with a known metric vocabulary."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    TRTLLM = "trtllm"  # trtllm-serve, Prometheus page at /prometheus/metrics
    TRITON = "triton"  # Triton Inference Server with the TensorRT-LLM backend, port 8002 /metrics


class MetricsParseError(ValueError):
    """The page is not Prometheus text, or holds none of the metrics its server kind should expose."""


Signal = Literal[
    "kv_usage",
    "waiting",
    "running",
    "preemptions",
    "capacity_tokens",
    "capacity_info",
    "block_size",
    "num_blocks",
    "tgi_reserved_tokens",
    "tgi_max_tokens",
]
Unit = Literal["ratio", "percent", "requests", "count", "tokens", "blocks", "info"]


@dataclass(frozen=True, slots=True)
class MetricName:
    """One row of the metric table: which exact series feeds which signal.

    `match` narrows to series carrying these label values; `priority` orders alternatives for the same
    signal (0 preferred; a higher number is only read when no preferred series exists for the model).
    """

    kind: ServerKind
    signal: Signal
    name: str
    unit: Unit
    match: tuple[tuple[str, str], ...] = ()
    priority: int = 0
    note: str = ""


_V, _S, _G, _T, _X = ServerKind.VLLM, ServerKind.SGLANG, ServerKind.TGI, ServerKind.TRTLLM, ServerKind.TRITON
_KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
_REQS = "nv_trt_llm_request_metrics"

METRIC_TABLE: tuple[MetricName, ...] = (
    MetricName(_V, "kv_usage", "vllm:kv_cache_usage_perc", "ratio", note="V1 >= 0.9; 1 means 100 %"),
    MetricName(
        _V, "kv_usage", "vllm:gpu_cache_usage_perc", "ratio", priority=1, note="legacy, removed Nov 2025"
    ),
    MetricName(_V, "waiting", "vllm:num_requests_waiting", "requests", note="includes preempted requests"),
    MetricName(_V, "running", "vllm:num_requests_running", "requests"),
    MetricName(_V, "preemptions", "vllm:num_preemptions_total", "count", note="counter"),
    MetricName(
        _V, "capacity_info", "vllm:cache_config_info", "info", note="labels block_size x num_gpu_blocks"
    ),
    MetricName(_S, "kv_usage", "sglang:token_usage", "ratio", note="gauges lag up to 40 decode steps"),
    MetricName(_S, "waiting", "sglang:num_queue_reqs", "requests"),
    MetricName(_S, "running", "sglang:num_running_reqs", "requests"),
    MetricName(
        _S, "preemptions", "sglang:num_retracted_requests_total", "count", note="counter, newer SGLang"
    ),
    MetricName(_S, "capacity_tokens", "sglang:max_total_num_tokens", "tokens"),
    MetricName(
        _S,
        "capacity_info",
        "sglang:cache_config_info",
        "info",
        priority=1,
        note="labels page_size x num_pages",
    ),
    MetricName(
        _G, "tgi_reserved_tokens", "tgi_batch_current_max_tokens", "tokens", note="KV proxy numerator"
    ),
    MetricName(_G, "tgi_max_tokens", "tgi_batch_max_total_tokens", "tokens", note="KV proxy denominator"),
    MetricName(_G, "waiting", "tgi_queue_size", "requests"),
    MetricName(_G, "running", "tgi_batch_current_size", "requests"),
    MetricName(_T, "kv_usage", "trtllm_kv_cache_utilization", "ratio", note="usedNumBlocks / maxNumBlocks"),
    MetricName(_T, "waiting", "trtllm_num_requests_waiting", "requests"),
    MetricName(_T, "running", "trtllm_num_requests_running", "requests"),
    MetricName(_T, "num_blocks", "trtllm_kv_cache_max_blocks", "blocks"),
    MetricName(_T, "block_size", "trtllm_kv_cache_tokens_per_block", "tokens"),
    MetricName(_X, "kv_usage", _KV_BLOCKS, "ratio", match=(("kv_cache_block_type", "fraction"),)),
    MetricName(_X, "num_blocks", _KV_BLOCKS, "blocks", match=(("kv_cache_block_type", "max"),)),
    MetricName(_X, "block_size", _KV_BLOCKS, "tokens", match=(("kv_cache_block_type", "tokens_per"),)),
    MetricName(_X, "waiting", _REQS, "requests", match=(("request_type", "waiting"),)),
    MetricName(_X, "running", _REQS, "requests", match=(("request_type", "scheduled"),)),
)

# Labels that carry the served model name, per kind, in order of preference. Triton's `model` is the
# Triton model (often "tensorrt_llm"), so targets should set the served name explicitly.
MODEL_LABELS: Mapping[ServerKind, tuple[str, ...]] = {
    _V: ("model_name",),
    _S: ("model_name",),
    _G: (),
    _T: ("model_name",),
    _X: ("model",),
}

# Labels whose values are independent schedulers (own queue, own KV pool): summed across.
REPLICA_LABELS: Mapping[ServerKind, tuple[str, ...]] = {
    _V: ("engine",),
    _S: ("dp_rank",),
    _G: (),
    _T: (),
    _X: (),
}

# Name prefixes used to auto-detect the kind of a page.
KIND_PREFIXES: tuple[tuple[str, ServerKind], ...] = (
    ("vllm:", _V),
    ("sglang:", _S),
    ("nv_trt_llm_", _X),
    ("trtllm_", _T),
    ("tgi_", _G),
)

DEFAULT_METRICS_PATH: Mapping[ServerKind, str] = {
    _V: "/metrics",
    _S: "/metrics",
    _G: "/metrics",
    _T: "/prometheus/metrics",
    _X: "/metrics",
}

_WANTED: frozenset[str] = frozenset(m.name for m in METRIC_TABLE)
_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|(?=\}))')
_UNESCAPE_RE = re.compile(r"\\(.)")


@dataclass(frozen=True, slots=True)
class Series:
    """One sample line: exact metric name, its labels, its value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class ModelSignals:
    """Normalized signals of one model on one server. None means the server does not expose it."""

    model: str
    kind: ServerKind
    kv_usage: float | None
    requests_waiting: float | None
    requests_running: float | None
    preemptions_total: float | None
    kv_capacity_tokens: int | None
    series: int


def _unescape(value: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _parse_labels(text: str, lineno: int) -> tuple[dict[str, str], int]:
    """Parse `{a="b",...}` starting at text[0] == '{'; returns the labels and the index after '}'."""
    labels: dict[str, str] = {}
    pos = 1
    while True:
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and text[pos] == "}":
            return labels, pos + 1
        m = _LABEL_RE.match(text, pos)
        if m is None:
            raise MetricsParseError(f"line {lineno}: malformed label set")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()


def _parse_value(rest: str, lineno: int) -> float:
    parts = rest.split()
    if not 1 <= len(parts) <= 2:
        raise MetricsParseError(f"line {lineno}: expected a value and an optional timestamp")
    try:
        return float(parts[0])
    except ValueError:
        raise MetricsParseError(f"line {lineno}: value {parts[0][:40]!r} is not a number") from None


def parse_series(text: str, names: frozenset[str] = _WANTED) -> list[Series]:
    """Every sample line whose exact name is in `names`, validating all lines on the way.

    Lines of other metrics are only checked for shape (name, optional label set, number) so that a
    histogram-heavy page stays cheap to parse once a second.
    """
    if "\x00" in text:
        raise MetricsParseError("binary data in metrics page")
    out: list[Series] = []
    samples = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME_RE.match(line)
        if m is None:
            raise MetricsParseError(f"line {lineno}: not a metric line: {line[:60]!r}")
        name = m.group(0)
        rest = line[m.end() :]
        if rest.startswith("{"):
            if name in names:
                labels, end = _parse_labels(rest, lineno)
                rest = rest[end:]
            else:
                close = rest.rfind("}")
                if close < 0:
                    raise MetricsParseError(f"line {lineno}: unterminated label set")
                labels, rest = {}, rest[close + 1 :]
        elif rest[:1] in (" ", "\t"):
            labels = {}
        else:
            raise MetricsParseError(f"line {lineno}: not a metric line: {line[:60]!r}")
        value = _parse_value(rest, lineno)
        samples += 1
        if name in names:
            out.append(Series(name, labels, value))
    if samples == 0:
        raise MetricsParseError("no samples in metrics page")
    return out


def detect_kind(names: Iterable[str]) -> ServerKind:
    """The kind whose prefix most metric names carry."""
    counts: dict[ServerKind, int] = defaultdict(int)
    for name in names:
        for prefix, kind in KIND_PREFIXES:
            if name.startswith(prefix):
                counts[kind] += 1
                break
    if not counts:
        raise MetricsParseError("cannot detect the server kind: no known metric prefix")
    return max(counts, key=lambda k: counts[k])


def normalize_usage(value: float, unit: Unit) -> float | None:
    """KV usage as 0..1. Percent families are divided by 100 when above 1; ratio families above 1 are
    clamped (a ratio cannot exceed 1, but reading it as "full" is the safe side). NaN is dropped."""
    if math.isnan(value):
        return None
    if unit == "percent" and value > 1.0:
        value /= 100.0
    return min(1.0, max(0.0, value))


def _replica_key(labels: Mapping[str, str], replica_labels: Sequence[str]) -> tuple[str, ...]:
    return tuple(labels.get(label, "") for label in replica_labels)


def _sum_of_group_max(values: Iterable[tuple[tuple[str, ...], float]]) -> float | None:
    """Max within a replica group (TP/PP ranks repeat the same scheduler), sum across groups."""
    groups: dict[tuple[str, ...], float] = {}
    for key, value in values:
        if math.isnan(value):
            continue
        groups[key] = max(value, groups.get(key, value))
    return sum(groups.values()) if groups else None


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):
        return None


def parse_metrics(
    text: str,
    kind: ServerKind | str | None = None,
    *,
    model: str | None = None,
    kv_aggregation: Literal["max", "mean"] = "max",
) -> dict[str, ModelSignals]:
    """Per-model signals of one server's Prometheus page.

    `kind` None auto-detects from the metric prefixes. `model` set attributes every series to that name
    (for servers whose pages carry no served model name: TGI, Triton); otherwise the kind's model label
    is used and series without it (e.g. vLLM's cache config info) apply to every model on the page.
    """
    all_series = parse_series(text)
    server_kind = ServerKind(kind) if kind is not None else detect_kind(s.name for s in all_series)
    rows = [r for r in METRIC_TABLE if r.kind == server_kind]
    by_name: dict[str, list[MetricName]] = defaultdict(list)
    for row in rows:
        by_name[row.name].append(row)

    model_labels = MODEL_LABELS[server_kind]
    replica_labels = REPLICA_LABELS[server_kind]

    def model_of(labels: Mapping[str, str]) -> str | None:
        if model is not None:
            return model
        for label in model_labels:
            if labels.get(label):
                return labels[label]
        return None

    # (model or None) -> signal -> priority -> [(replica key, series)]
    found: dict[str | None, dict[str, dict[int, list[Series]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    matched = 0
    for s in all_series:
        for row in by_name.get(s.name, ()):
            if all(s.labels.get(k) == v for k, v in row.match):
                found[model_of(s.labels)][row.signal][row.priority].append(s)
                matched += 1
    if matched == 0:
        raise MetricsParseError(f"no {server_kind.value} metrics on the page")

    unlabelled = found.pop(None, {})
    models: list[str] = [m for m in found if m is not None] or [model or ""]
    units = {(r.signal, r.name): r.unit for r in rows}
    result: dict[str, ModelSignals] = {}
    for name in models:
        signals: dict[str, dict[int, list[Series]]] = defaultdict(dict)
        for source in (unlabelled, found.get(name, {})):
            for signal, prios in source.items():
                for prio, series in prios.items():
                    signals[signal].setdefault(prio, []).extend(series)

        def pick(signal: str, signals: Mapping[str, Mapping[int, list[Series]]] = signals) -> list[Series]:
            prios = signals.get(signal, {})
            return list(prios[min(prios)]) if prios else []

        def counted(signal: str) -> float | None:
            return _sum_of_group_max((_replica_key(s.labels, replica_labels), s.value) for s in pick(signal))

        usages = [
            u
            for s in pick("kv_usage")
            if (u := normalize_usage(s.value, units[("kv_usage", s.name)])) is not None
        ]
        kv: float | None = None
        if usages:
            kv = max(usages) if kv_aggregation == "max" else sum(usages) / len(usages)

        capacity = _capacity(server_kind, pick, replica_labels)
        if server_kind is ServerKind.TGI:
            reserved, total = counted("tgi_reserved_tokens"), counted("tgi_max_tokens")
            if reserved is not None and total:
                kv = normalize_usage(reserved / total, "ratio")
            if total:
                capacity = int(total)

        n_series = sum(len(v) for prios in signals.values() for v in prios.values())
        result[name] = ModelSignals(
            model=name,
            kind=server_kind,
            kv_usage=kv,
            requests_waiting=counted("waiting"),
            requests_running=counted("running"),
            preemptions_total=counted("preemptions"),
            kv_capacity_tokens=capacity,
            series=n_series,
        )
    return result


def _capacity(
    kind: ServerKind,
    pick: Callable[[str], list[Series]],
    replica_labels: Sequence[str],
) -> int | None:
    """KV capacity in tokens where the server publishes its cache geometry."""
    per_group: list[tuple[tuple[str, ...], float]] = []
    for s in pick("capacity_tokens"):
        per_group.append((_replica_key(s.labels, replica_labels), s.value))
    for s in pick("capacity_info"):
        size_key, count_key = (
            ("block_size", "num_gpu_blocks") if kind is ServerKind.VLLM else ("page_size", "num_pages")
        )
        page, pages = _int_label(s.labels, size_key), _int_label(s.labels, count_key)
        if page and pages:
            per_group.append((_replica_key(s.labels, replica_labels), float(page * pages)))
    if not per_group:
        sizes = {_replica_key(s.labels, replica_labels): s.value for s in pick("block_size")}
        for s in pick("num_blocks"):
            key = _replica_key(s.labels, replica_labels)
            block = sizes.get(key, next(iter(sizes.values())) if len(sizes) == 1 else None)
            if block is not None and not math.isnan(block):
                per_group.append((key, block * s.value))
    total = _sum_of_group_max(per_group)
    if total is None or total <= 0 or not math.isfinite(total):
        return None
    return int(total)
