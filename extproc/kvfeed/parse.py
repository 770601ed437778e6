"""Normalize the Prometheus page of one inference server into per-model KV and queue signals.

Pure: text in, dataclasses out, and engine-agnostic: which series mean what comes from the engine's
`EngineProfile` (`extproc.kvfeed.engines`). Names are matched exactly: a prefix match on
`vllm:num_requests_waiting` would also count `vllm:num_requests_waiting_by_reason`.

Aggregation over the series of one model: breakdown series (non-empty breakdown label) are dropped; series
are grouped by the profile's replica labels (independent schedulers). Counts (waiting, running, preemptions,
generated tokens) are the max inside a group (tensor/pipeline ranks repeat the same queue) summed across
groups; KV usage is the max inside a group, then the max (default) or mean across groups; capacity comes
from the first capacity source of the profile that yields a value (see `engines.py`).

Garbage (an HTML error page, the JSON of trtllm-serve's `/metrics`, truncated lines) raises
`MetricsParseError`; a page that names no served model while no model was given raises its subclass
`ModelNameMissing`. These are the only exceptions this module raises for bad input. Comment lines (`#`),
HELP/TYPE lines and blank lines are skipped, as the text format allows.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from extproc.kvfeed.engines import (
    ALL_NAMES,
    PROFILES,
    BlocksTimesSize,
    CapacitySource,
    EngineProfile,
    InfoLabels,
    Match,
    Reading,
    ServerKind,
    Signal,
    TokensGauge,
    Unit,
    UsageRule,
)

KvAggregation = Literal["max", "mean"]
Group = tuple[str, ...]


class MetricsParseError(ValueError):
    """The page is not Prometheus text, or holds none of the metrics its server kind should expose."""


class ModelNameMissing(MetricsParseError):
    """The page's series carry no served model name (or only a placeholder) and none was given."""

    def __init__(self, profile: EngineProfile, detail: str) -> None:
        super().__init__(detail)
        self.profile = profile


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
    generation_tokens_total: float | None = None  # counter: the decode pace is its growth between scrapes
    kv_block_tokens: int | None = None  # tokens per KV block, where the capacity source names it
    # counter: requests the engine refused for want of queue room (vLLM's 503 past its queue bounds)
    admission_rejections_total: float | None = None
    prefix_caching: bool | None = None  # whether the engine shares prompt prefixes; None: it does not say
    prompt_tokens_total: float | None = None  # counter: prompt tokens prefilled, grown as each prefill ends


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


def parse_series(text: str, names: frozenset[str] = ALL_NAMES) -> list[Series]:
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


_NAME_BYTES_RE = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_ALL_NAMES_BYTES = frozenset(name.encode() for name in ALL_NAMES)


class PageFilter:
    """Reads a metrics page chunk by chunk as it arrives, keeping only the lines the parser reads.

    A page of many models, LoRA adapters and histograms runs to megabytes, of which the feed reads a few
    dozen series: the lines of other metrics are checked to start with a metric name and then dropped
    (each leaves an empty line, so line numbers in `parse_series` errors stay those of the page), except
    the first, kept so that a page with no series of the engine still parses to "no <kind> metrics". Memory
    is the kept lines plus the longest line, whatever the page size. `text()` after the last chunk.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for a newline
        self._out: list[bytes] = []
        self._kept_other = False
        self._lineno = 0

    def feed(self, chunk: bytes) -> None:
        if b"\x00" in chunk:
            raise MetricsParseError("binary data in metrics page")
        buf = self._buf
        buf.extend(chunk)
        start = 0
        while (end := buf.find(b"\n", max(start, self._scanned))) >= 0:
            self._line(bytes(buf[start:end]))
            start = end + 1
            self._scanned = start
        del buf[:start]
        self._scanned = len(buf)

    def text(self) -> str:
        """The kept page as text (raises `UnicodeDecodeError` when a kept line is not UTF-8)."""
        if self._buf:
            self._line(bytes(self._buf))
            self._buf.clear()
        return b"\n".join(self._out).decode("utf-8") + "\n"

    def _line(self, raw: bytes) -> None:
        self._lineno += 1
        line = raw.strip()
        if not line or line.startswith(b"#"):
            self._out.append(b"")
            return
        m = _NAME_BYTES_RE.match(line)
        if m is None:
            shown = line[:60].decode("utf-8", "replace")
            raise MetricsParseError(f"line {self._lineno}: not a metric line: {shown!r}")
        if m.group(0) in _ALL_NAMES_BYTES or not self._kept_other:
            self._kept_other = self._kept_other or m.group(0) not in _ALL_NAMES_BYTES
            self._out.append(line)
        else:
            self._out.append(b"")


def detect_kind(names: Iterable[str]) -> ServerKind:
    """The kind whose prefixes most metric names carry."""
    counts: dict[ServerKind, int] = defaultdict(int)
    for name in names:
        for profile in PROFILES.values():
            if name.startswith(profile.prefixes):
                counts[profile.kind] += 1
    if not counts:
        raise MetricsParseError("cannot detect the server kind: no known metric prefix")
    return max(counts, key=lambda k: counts[k])


def normalize_usage(value: float, unit: Unit) -> float:
    """KV usage as 0..1. Percent families are divided by 100 when above 1; ratio families above 1 are
    clamped (a ratio cannot exceed 1, but reading it as "full" is the safe side). A value no usage can have
    (NaN, ±inf, negative) comes back as NaN: the sample holding it is refused (`kvfeed.sample.checked`),
    never read as an empty cache."""
    if not (math.isfinite(value) and value >= 0.0):
        return math.nan
    if unit == "percent" and value > 1.0:
        value /= 100.0
    return min(1.0, value)


def _count(value: float) -> float:
    """A count as read, or NaN when no count can have it (NaN, ±inf, negative), so that it poisons its
    aggregate instead of being skipped or hidden under another rank's max."""
    return value if math.isfinite(value) and value >= 0.0 else math.nan


def _poisoned_max(values: Sequence[float]) -> float:
    """max() that is NaN when any value is (Python's max() is order-dependent with NaN)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _matches(series: Series, name: str, match: Match) -> bool:
    return series.name == name and all(series.labels.get(k) == v for k, v in match)


def _number(labels: Mapping[str, str], key: str) -> float | None:
    """A label holding a number (vLLM writes unset config fields as "None")."""
    try:
        value = float(labels[key])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


class _ModelView:
    """The series of one model, with the profile's grouping rules applied."""

    def __init__(self, profile: EngineProfile, series: Sequence[Series]) -> None:
        self.profile = profile
        self.series = series

    def group(self, s: Series) -> Group:
        return tuple(s.labels.get(label, "") for label in self.profile.replica_labels)

    def readings(self, signal: Signal) -> list[tuple[Reading, Series]]:
        """Series of the preferred (lowest priority number) reading of `signal` that has any."""
        found = [
            (r, s)
            for r in self.profile.readings
            if r.signal == signal
            for s in self.series
            if _matches(s, r.name, r.match)
        ]
        if not found:
            return []
        best = min(r.priority for r, _ in found)
        return [(r, s) for r, s in found if r.priority == best]

    def per_group(
        self, values: Iterable[tuple[Group, float]], pick: Literal["max", "min"] = "max"
    ) -> dict[Group, float]:
        """One value per replica group: max (repeated queues) or min (capacity) over its ranks. A NaN
        rank makes its group NaN: a reading that cannot be trusted is not outvoted by its neighbours."""
        groups: dict[Group, float] = {}
        for key, value in values:
            old = groups.get(key)
            if old is None or math.isnan(value):
                groups[key] = value
            elif not math.isnan(old):
                groups[key] = max(old, value) if pick == "max" else min(old, value)
        return groups

    def counted(self, signal: Signal) -> float | None:
        """A count summed over replicas (and over a reading's `parts`), the max over the ranks of one."""
        groups = self.per_group(
            (self.group(s) + tuple(s.labels.get(label, "") for label in r.parts), _count(s.value))
            for r, s in self.readings(signal)
        )
        return sum(groups.values()) if groups else None

    def kv_usage(self, aggregation: KvAggregation) -> float | None:
        pairs = self.readings("kv_usage")
        groups = self.per_group((self.group(s), normalize_usage(s.value, r.unit)) for r, s in pairs)
        if not groups:
            return None
        values = list(groups.values())
        return _poisoned_max(values) if aggregation == "max" else sum(values) / len(values)

    def capacity(self) -> int | None:
        for source in self.profile.capacity:
            total = self._capacity_from(source)
            if total is not None and total > 0:  # NaN or 0: unknown, try the next source
                return int(min(total, 2.0**64))  # +inf and any absurd value: refused by `checked`
        return None

    def prefix_caching(self) -> bool | None:
        """Whether the engine shares prompt prefixes, from the first capacity source that says: False when
        any of its series says "False" (one engine of the page that does not share is enough to book whole
        prompts), True when some say "True" and none "False", None when none says."""
        for source in self.profile.capacity:
            if not isinstance(source, InfoLabels) or source.prefix_caching_label is None:
                continue
            label = source.prefix_caching_label
            values = {s.labels.get(label) for s in self.series if s.name == source.name} - {None}
            if "False" in values:
                return False
            if "True" in values:
                return True
        return None

    def block_tokens(self) -> int | None:
        """Tokens per KV block from the first capacity source that names one (the largest over the
        page's series: a larger block rounds more, so it is the one the budget must assume)."""
        for source in self.profile.capacity:
            if isinstance(source, InfoLabels):
                sizes = [
                    v
                    for s in self.series
                    if s.name == source.name
                    if (v := _number(s.labels, source.size_label))
                ]
            elif isinstance(source, BlocksTimesSize):
                sizes = list(self._gauge(source.size, source.size_match).values())
            else:
                continue
            finite = [v for v in sizes if math.isfinite(v) and v >= 1]
            if finite:
                return int(min(max(finite), 2.0**32))
        return None

    def _capacity_from(self, source: CapacitySource) -> float | None:
        if isinstance(source, TokensGauge):
            groups = self._gauge(source.name, source.match)
            return sum(groups.values()) if groups else None
        if isinstance(source, BlocksTimesSize):
            return self._blocks_times_size(source)
        return self._info_labels(source)

    def _gauge(self, name: str, match: Match) -> dict[Group, float]:
        values = ((self.group(s), s.value) for s in self.series if _matches(s, name, match))
        return self.per_group(((k, v) for k, v in values if v > 0), pick="min")

    def _blocks_times_size(self, source: BlocksTimesSize) -> float | None:
        blocks = self._gauge(source.blocks, source.blocks_match)
        sizes = self._gauge(source.size, source.size_match)
        only_size = next(iter(sizes.values())) if len(sizes) == 1 else None
        products = [n * size for key, n in blocks.items() if (size := sizes.get(key, only_size)) is not None]
        return sum(products) if products else None

    def _info_labels(self, source: InfoLabels) -> float | None:
        infos = [s for s in self.series if s.name == source.name]
        if source.tokens_label is not None:
            label = source.tokens_label
            tokens = [(self.group(s), v) for s in infos if (v := _number(s.labels, label)) is not None]
            if tokens:
                return sum(self.per_group(tokens, pick="min").values())
        geometry = [
            (self.group(s), size * count)
            for s in infos
            if (size := _number(s.labels, source.size_label)) is not None
            and (count := _number(s.labels, source.count_label)) is not None
        ]
        if not geometry:
            return None
        if source.count_is_page_total:
            return max(value for _, value in geometry)
        return sum(self.per_group(geometry, pick="min").values())

    def signals(self, model: str, aggregation: KvAggregation) -> ModelSignals:
        capacity = self.capacity()
        if self.profile.usage_rule is UsageRule.RESERVED_OVER_CAPACITY:
            reserved = self.counted("kv_reserved_tokens")
            kv = normalize_usage(reserved / capacity, "ratio") if reserved is not None and capacity else None
        else:
            kv = self.kv_usage(aggregation)
        return ModelSignals(
            model=model,
            kind=self.profile.kind,
            kv_usage=kv,
            requests_waiting=self.counted("waiting"),
            requests_running=self.counted("running"),
            preemptions_total=self.counted("preemptions"),
            kv_capacity_tokens=capacity,
            series=len(self.series),
            generation_tokens_total=self.counted("generated"),
            kv_block_tokens=self.block_tokens(),
            admission_rejections_total=self.counted("rejections"),
            prefix_caching=self.prefix_caching(),
            prompt_tokens_total=self.counted("prompted"),
        )


def _model_of(profile: EngineProfile, labels: Mapping[str, str]) -> str | None:
    for label in profile.model_labels:
        value = labels.get(label)
        if value and value not in profile.placeholder_models:
            return value
    return None


def _is_breakdown(profile: EngineProfile, labels: Mapping[str, str]) -> bool:
    return any(labels.get(label) for label in profile.breakdown_labels)


def parse_metrics(
    text: str,
    kind: ServerKind | str | None = None,
    *,
    model: str | None = None,
    kv_aggregation: KvAggregation = "max",
) -> dict[str, ModelSignals]:
    """Per-model signals of one server's Prometheus page.

    `kind` None auto-detects from the metric prefixes. `model` set attributes every series to that name
    (for pages without a served name: TGI, trtllm-serve's "undefined", Triton's model repository name);
    otherwise the profile's model labels are used, and series without one (an info gauge) apply to every
    model on the page.
    """
    all_series = parse_series(text)
    profile = PROFILES[ServerKind(kind) if kind is not None else detect_kind(s.name for s in all_series)]
    series = [s for s in all_series if s.name in profile.names and not _is_breakdown(profile, s.labels)]
    if not series:
        hint = f" (the server needs {profile.requires})" if profile.requires else ""
        raise MetricsParseError(f"no {profile.kind.value} metrics on the page{hint}")

    by_model: dict[str | None, list[Series]] = defaultdict(list)
    for s in series:
        by_model[model if model is not None else _model_of(profile, s.labels)].append(s)
    unlabelled = by_model.pop(None, [])
    if not by_model:
        seen = sorted({s.labels[k] for s in series for k in profile.model_labels if k in s.labels})
        named = f" (model label values: {', '.join(seen)})" if seen else ""
        raise ModelNameMissing(
            profile, f"the {profile.title} page names no served model{named}: set model on the target"
        )
    return {
        name: _ModelView(profile, [*unlabelled, *own]).signals(name, kv_aggregation)
        for name, own in by_model.items()
        if name is not None
    }
