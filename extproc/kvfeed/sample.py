"""The in-process form of one feed sample, its validation, and its conversion to and from the KvFeed protobuf.

Components pass `FeedSample` (a frozen dataclass with plain Python types) and convert at the gRPC edge
only, so the parser, hub, aggregation and tests never depend on generated code.

`checked(sample)` is the one rule for readings that cannot be true (NaN, ±inf, a negative usage or count, a
capacity of 0 or beyond `MAX_KV_CAPACITY_TOKENS`): such a sample becomes a down sample with reason
`invalid`, so its endpoint counts as missing (stale), never as a reading. A decode pace that cannot be true
is dropped alone, as is an impossible generation counter (both only bound what an unreported request is
charged; losing the KV reading over them would lose protection). Both ends apply it: the exporter after
parsing a page, the sidecar on every sample off the wire (it does not trust the wire).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from extproc.kvfeed.engines import PROFILES, ServerKind
from extproc.kvfeed.pace import plausible_pace
from extproc.kvfeed.parse import ModelSignals
from extproc.kvfeed.proto import feedback_pb2

SampleKey = tuple[str, str, str]  # (node, endpoint, model)

# The most KV tokens one endpoint can hold: 2^40 (1.1e12). The largest memory one inference server can front
# today is a 72-GPU NVLink rack (GB200 NVL72, 72 x 192 GB = 13.8 TB of HBM); 2^40 tokens of it leave 12.6
# bytes per token, while one token's K and V of even a one-layer model with a single 8-dim fp8 head take 16
# bytes (2 x layers x kv_heads x head_dim x bytes). A capacity above this is a bug or a lie (2^64 - 1 made
# the budget's headroom 7.4e18, so it never refused); it stays exact in a float (< 2^53) when summed.
MAX_KV_CAPACITY_TOKENS = 2**40
MAX_KV_BLOCK_TOKENS = 2**20  # vLLM's blocks are 16 (GPU) to 256 tokens; a larger one is not a block size
MAX_MODEL_NAME = 256  # the bound the sidecar puts on a request's model name (limiter keys, metric labels)
MAX_SERVED_NAMES = 1024  # per model and endpoint: aliases and LoRA adapters, far more than a server loads
_COUNTS = ("requests_waiting", "requests_running", "preemptions_total", "admission_rejections_total")

_KIND_TO_PB: dict[ServerKind, int] = {
    kind: feedback_pb2.ServerKind.Value(profile.wire) for kind, profile in PROFILES.items()
}
"""Each engine's wire number, from its profile's `wire` name (an unknown name fails at import)."""
_PB_TO_KIND: dict[int, ServerKind] = {v: k for k, v in _KIND_TO_PB.items()}


def _wire_kind(kind: ServerKind | None) -> int:
    """The wire number of `kind` (0: no kind known); a kind with no profile raises rather than go out as
    SERVER_KIND_UNSPECIFIED, which every receiver would read as "not said"."""
    return 0 if kind is None else _KIND_TO_PB[kind]


@dataclass(frozen=True, slots=True)
class FeedSample:
    """One scrape of one model on one endpoint. `sample_time` is the exporter's wall clock (unix s)."""

    node: str
    endpoint: str
    model: str
    server_kind: ServerKind | None
    kv_usage: float | None
    requests_waiting: float | None
    requests_running: float | None
    preemptions_total: float | None
    kv_capacity_tokens: int | None
    sample_time: float
    up: bool
    error: str = ""
    scrape_duration_seconds: float = 0.0
    served_names: tuple[str, ...] = ()  # from the server's /v1/models: this model, aliases, adapters
    # Tokens per second per running sequence since the endpoint's previous scrape (kvfeed.pace); None unknown.
    decode_tokens_per_second: float | None = None
    kv_block_tokens: int | None = None  # tokens per KV block; None unknown
    # Counter of requests the server refused for want of queue room (vLLM's queue bounds); None unknown.
    admission_rejections_total: float | None = None
    # Counter of tokens the engine generated (what the pace is timed from); None unknown.
    generation_tokens_total: float | None = None
    prefix_caching: bool | None = None  # whether the engine shares prompt prefixes; None unknown
    # Counter of prompt tokens the engine has prefilled (grown as each prefill completes); None unknown.
    prompt_tokens_total: float | None = None

    @property
    def key(self) -> SampleKey:
        return (self.node, self.endpoint, self.model)

    @classmethod
    def from_signals(
        cls,
        node: str,
        endpoint: str,
        signals: ModelSignals,
        sample_time: float,
        duration: float,
        served_names: tuple[str, ...] = (),
        decode_tokens_per_second: float | None = None,
    ) -> FeedSample:
        return cls(
            node=node,
            endpoint=endpoint,
            model=signals.model,
            server_kind=signals.kind,
            kv_usage=signals.kv_usage,
            requests_waiting=signals.requests_waiting,
            requests_running=signals.requests_running,
            preemptions_total=signals.preemptions_total,
            kv_capacity_tokens=signals.kv_capacity_tokens,
            sample_time=sample_time,
            up=True,
            scrape_duration_seconds=duration,
            served_names=served_names,
            decode_tokens_per_second=decode_tokens_per_second,
            kv_block_tokens=signals.kv_block_tokens,
            admission_rejections_total=signals.admission_rejections_total,
            generation_tokens_total=signals.generation_tokens_total,
            prefix_caching=signals.prefix_caching,
            prompt_tokens_total=signals.prompt_tokens_total,
        )

    @classmethod
    def down(
        cls,
        node: str,
        endpoint: str,
        model: str,
        kind: ServerKind | None,
        error: str,
        sample_time: float,
        duration: float = 0.0,
    ) -> FeedSample:
        """A failed scrape: sent like any sample so subscribers stop trusting the endpoint at once."""
        return cls(
            node=node,
            endpoint=endpoint,
            model=model,
            server_kind=kind,
            kv_usage=None,
            requests_waiting=None,
            requests_running=None,
            preemptions_total=None,
            kv_capacity_tokens=None,
            sample_time=sample_time,
            up=False,
            error=error,
            scrape_duration_seconds=duration,
        )


def problem(sample: FeedSample) -> str | None:
    """Why an up sample's readings cannot be true (bounded text naming the field), None when plausible.

    A KV usage above 1 is not a problem: it reads as a full cache (`checked` clamps it), the safe side.
    """
    if not sample.up:
        return None
    usage = sample.kv_usage
    if usage is not None and not (math.isfinite(usage) and usage >= 0.0):
        return f"kv_usage {usage!r}"
    for field in _COUNTS:
        value = getattr(sample, field)
        if value is not None and not _countable(value):
            return f"{field} {value!r}"
    capacity = sample.kv_capacity_tokens
    if capacity is not None and not 0 < capacity <= MAX_KV_CAPACITY_TOKENS:
        return f"kv_capacity_tokens {capacity} outside 1..2^40"
    return None


def _countable(value: float) -> bool:
    """Whether a count or counter reading can be true: finite and not below 0."""
    return math.isfinite(value) and value >= 0.0


def checked(sample: FeedSample) -> FeedSample:
    """The sample if its readings are plausible (a usage above 1 clamped to 1, an impossible decode pace
    dropped), else a down sample whose error is `invalid: <field> <value>`: its endpoint is then missing
    from the pool, as after a failed scrape."""
    why = problem(sample)
    if why is not None:
        return FeedSample.down(
            sample.node,
            sample.endpoint,
            sample.model,
            sample.server_kind,
            f"invalid: {why}",
            sample.sample_time,
            sample.scrape_duration_seconds,
        )
    if sample.kv_usage is not None and sample.kv_usage > 1.0:
        sample = replace(sample, kv_usage=1.0)
    pace = sample.decode_tokens_per_second
    if pace is not None and plausible_pace(pace) is None:  # the wire's own bound (see `plausible_pace`)
        sample = replace(sample, decode_tokens_per_second=None)  # advisory: dropped alone, the rest stands
    block = sample.kv_block_tokens
    if block is not None and not 0 < block <= MAX_KV_BLOCK_TOKENS:
        sample = replace(sample, kv_block_tokens=None)  # likewise
    generated = sample.generation_tokens_total
    if generated is not None and not _countable(generated):
        sample = replace(sample, generation_tokens_total=None)  # likewise
    prompted = sample.prompt_tokens_total
    if prompted is not None and not _countable(prompted):
        sample = replace(sample, prompt_tokens_total=None)  # likewise
    names = plausible_names(sample.served_names)
    return sample if names == sample.served_names else replace(sample, served_names=names)


def plausible_names(names: Iterable[str]) -> tuple[str, ...]:
    """Served names that can be model names (1..256 printable characters, the sidecar's own bound on a
    request's model), without repeats, at most `MAX_SERVED_NAMES`: a server cannot grow the sidecar's
    memory by listing."""
    out: dict[str, None] = {}
    for name in names:
        if 0 < len(name) <= MAX_MODEL_NAME and name.isprintable():
            out[name] = None
            if len(out) == MAX_SERVED_NAMES:
                break
    return tuple(out)


def to_proto(sample: FeedSample) -> feedback_pb2.KvSample:
    msg = feedback_pb2.KvSample(
        node=sample.node,
        endpoint=sample.endpoint,
        model=sample.model,
        server_kind=_wire_kind(sample.server_kind),  # type: ignore[arg-type]
        up=sample.up,
        error=sample.error,
        scrape_duration_seconds=sample.scrape_duration_seconds,
        served_names=list(sample.served_names),
    )
    for field in (
        "kv_usage",
        *_COUNTS,
        "decode_tokens_per_second",
        "generation_tokens_total",
        "prompt_tokens_total",
    ):
        value = getattr(sample, field)
        if value is not None:
            setattr(msg, field, value)
    if sample.kv_capacity_tokens is not None and 0 <= sample.kv_capacity_tokens < 2**64:
        msg.kv_capacity_tokens = sample.kv_capacity_tokens
    if sample.kv_block_tokens is not None and 0 <= sample.kv_block_tokens < 2**32:
        msg.kv_block_tokens = sample.kv_block_tokens
    if sample.prefix_caching is not None:
        msg.prefix_caching = sample.prefix_caching
    seconds = math.floor(sample.sample_time)
    msg.sample_time.seconds = seconds
    msg.sample_time.nanos = min(999_999_999, int((sample.sample_time - seconds) * 1e9))
    return msg


def from_proto(msg: feedback_pb2.KvSample) -> FeedSample:
    """The sample as sent, impossible values included: pass it through `checked` before trusting it."""

    def opt(field: str) -> float | None:
        return float(getattr(msg, field)) if msg.HasField(field) else None

    return FeedSample(
        node=msg.node,
        endpoint=msg.endpoint,
        model=msg.model,
        server_kind=_PB_TO_KIND.get(msg.server_kind),
        kv_usage=opt("kv_usage"),
        requests_waiting=opt("requests_waiting"),
        requests_running=opt("requests_running"),
        preemptions_total=opt("preemptions_total"),
        kv_capacity_tokens=int(msg.kv_capacity_tokens) if msg.HasField("kv_capacity_tokens") else None,
        sample_time=msg.sample_time.seconds + msg.sample_time.nanos / 1e9,
        up=msg.up,
        error=msg.error,
        scrape_duration_seconds=msg.scrape_duration_seconds,
        served_names=tuple(msg.served_names),
        decode_tokens_per_second=opt("decode_tokens_per_second"),
        kv_block_tokens=int(msg.kv_block_tokens) if msg.HasField("kv_block_tokens") else None,
        admission_rejections_total=opt("admission_rejections_total"),
        generation_tokens_total=opt("generation_tokens_total"),
        prefix_caching=bool(msg.prefix_caching) if msg.HasField("prefix_caching") else None,
        prompt_tokens_total=opt("prompt_tokens_total"),
    )
