"""The runtime config: the types the sidecar's packages take, built once from a validated `ConfigFile`.

Their shapes are what the code needs (a model's policy with its inheritance resolved, limits as
`LimitSpec`, the feed subscriber's settings), not the file's; their defaults are the schema's
(extproc/config/schema.py), so `Config()` is the config of an empty file. Where a package defines the type
it takes (admission's `ClassPolicy`, `TenantSource` and `AdmissionRules`, the store's `StoreSettings`), this
module converts into it, and that package imports nothing of the config's. The feed's settings
(`FeedbackConfig`) are the subscriber's own type (extproc/kvfeed/subscriber/settings.py), and the schema
takes its defaults from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.admission.intake.paths import DEFAULT_TABLE, PathTable
from extproc.admission.intake.rules import (
    BACKLOG_BODIES,
    DEFAULT_MODEL,
    AdmissionRules,
    PoolHeaders,
    TenantSource,
    Tokenizing,
)
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy, StepBounds
from extproc.config import schema
from extproc.core.limiter import split
from extproc.core.limiter.limiter import LimitSpec
from extproc.kvfeed.subscriber.settings import FeedbackConfig
from extproc.store.backends import backend_settings
from extproc.store.settings import StoreSettings

_MODEL = schema.DEFAULT_MODEL_ENTRY
assert _MODEL.context_window is not None and _MODEL.encoding is not None
assert _MODEL.default_max_tokens is not None and _MODEL.missing_max_tokens is not None
DEFAULT_POLICY = ModelPolicy(
    context_window=_MODEL.context_window,
    encoding=_MODEL.encoding,
    default_max_tokens=_MODEL.default_max_tokens,
    missing_max_tokens=_MODEL.missing_max_tokens,
)
"""The `models."*"` defaults (docs/configuration.md): what an absent or partial entry falls back to."""

_SERVER = schema.Server()
_ADMISSION = schema.Admission()
_TENANT = schema.Tenant()
_STORE = schema.Store()
_ROOT = schema.ConfigFile()


def tenant_source(tenant: schema.Tenant) -> TenantSource:
    """`admission.tenant` as admission reads it (the header lower-cased, as HTTP/2 sends it)."""
    return TenantSource(
        header=tenant.header.lower() if tenant.header else None,
        metadata_namespace=tenant.metadata.namespace,
        metadata_key=tenant.metadata.key,
        default=tenant.default,
    )


DEFAULT_CLASS = "default"
"""The single class every request belongs to when no classes are configured."""


def class_policy(klass: schema.Class) -> ClassPolicy:
    """One `classes[]` entry as admission takes it; the defaults are the schema's."""
    wait = klass.queue.max_wait_seconds
    queued = klass.queue.max_queued
    return ClassPolicy(
        name=klass.name,
        max_wait_seconds=wait,
        max_queued=queued if queued is not None else (klass.queue.QUEUED_WHEN_WAITING if wait else 0),
        shadow=klass.shadow,
        cut_streams_above_kv=klass.cut_streams_above_kv,
        backend_priority=klass.backend_priority,
    )


DEFAULT_CLASSES = (class_policy(schema.Class(name=DEFAULT_CLASS)),)


@dataclass(frozen=True)
class AdmissionConfig:
    """`admission`, with `tenant` flattened and `per_step` as the `StepBounds` admission takes."""

    max_body_bytes: int = _ADMISSION.max_body_bytes
    tokenizer_threads: int = _ADMISSION.tokenizer_threads
    inject_include_usage: bool = _ADMISSION.inject_include_usage
    reject_unknown_models: bool = _ADMISSION.reject_unknown_models
    tenant: TenantSource = field(default_factory=lambda: tenant_source(_TENANT))
    allow_request_chat_template: bool = _ADMISSION.allow_request_chat_template
    allow_stored_context: bool = _ADMISSION.allow_stored_context
    tokenizer_per_client: int = _ADMISSION.tokenizer_per_client
    tokenizer_backlog_per_client: int = _ADMISSION.tokenizer_backlog_per_client
    tokenizer_max_wait_seconds: float = _ADMISSION.tokenizer_max_wait_seconds
    inline_count_bytes: int = _ADMISSION.inline_count_bytes
    bound_admission: bool = _ADMISSION.bound_admission
    assumed_decode_tokens_per_second: float = _ADMISSION.assumed_decode_tokens_per_second
    envoy_max_message_timeout_seconds: float = _ADMISSION.envoy_max_message_timeout_seconds
    end_report_wait_seconds: float = _ADMISSION.end_report_wait_seconds
    per_step: StepBounds = field(default_factory=StepBounds)
    max_request_seconds: float = _ADMISSION.max_request_seconds
    proxy_buffer_bytes: int = _ADMISSION.proxy_buffer_bytes
    max_queue_wait_seconds: float | None = _ADMISSION.max_queue_wait_seconds
    inference_pool: PoolHeaders = field(default_factory=PoolHeaders)
    cached_prompt_token_weight: float = _ADMISSION.cached_prompt_token_weight


@dataclass(frozen=True)
class LimitsConfig:
    global_: LimitSpec = field(default_factory=LimitSpec)
    models: Mapping[str, LimitSpec] = field(default_factory=dict)
    tenant_default: LimitSpec = field(default_factory=LimitSpec)
    tenants: Mapping[str, LimitSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    grpc_listen: str = _SERVER.grpc_listen
    admin_listen: str = _SERVER.admin_listen
    max_receive_message_bytes: int = _SERVER.max_receive_message_bytes
    shutdown_grace_seconds: float = _SERVER.shutdown_grace_seconds
    config_poll_seconds: float = _SERVER.config_poll_seconds


def store_settings(store: schema.Store) -> StoreSettings:
    """`store` as the store factory takes it (extproc/store/settings.py); checked in build.py first. The
    backend's own section (`store.<backend>`, none for `local`) is read by the parser that backend registers
    (extproc/store/backends.py), so a new backend needs no line here."""
    section = getattr(store, store.backend, None)
    return StoreSettings(
        backend=store.backend,
        options=backend_settings(store.backend, section.model_dump() if section is not None else {}),
        on_unavailable=store.on_unavailable,
        fallback_share=store.fallback_share,
    )


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    models: Mapping[str, ModelPolicy] = field(default_factory=lambda: {DEFAULT_MODEL: DEFAULT_POLICY})
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    store: StoreSettings = field(default_factory=lambda: store_settings(_STORE))
    classes: tuple[ClassPolicy, ...] = DEFAULT_CLASSES
    default_class: str = DEFAULT_CLASS
    tenant_classes: Mapping[str, str] = field(default_factory=dict)
    shadow: bool = _ROOT.shadow
    tenant_metrics: frozenset[str] = frozenset()
    log_level: str = _ROOT.log_level
    paths: PathTable = DEFAULT_TABLE
    admission_rules: AdmissionRules = field(init=False, repr=False, compare=False)
    """What admission reads per request, converted once when the config is built (a reload builds a new
    `Config`, so new rules); the sidecar swaps them with the config in one assignment."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "admission_rules", admission_rules(self))

    @property
    def priority(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def model_labels(self) -> list[str]:
        """Every `model` label value requests can be counted under (bounded by the config)."""
        return self.admission_rules.model_labels()

    def limit_specs(self) -> tuple[dict[str, LimitSpec], dict[str, LimitSpec]]:
        """Keys with explicit limits, and per-prefix defaults for keys first seen at run time, with the
        derived keys of split input/output limits (extproc/core/limiter/split.py)."""
        return split.expand(*self.configured_limits())

    def configured_limits(self) -> tuple[dict[str, LimitSpec], dict[str, LimitSpec]]:
        """Keys with explicit limits, and per-prefix defaults, as the file names them."""
        specs: dict[str, LimitSpec] = {"global": self.limits.global_}
        for name, spec in self.limits.models.items():
            if name != DEFAULT_MODEL:
                specs[f"model:{name}"] = spec
        for name, spec in self.limits.tenants.items():
            specs[f"tenant:{name}"] = spec
        defaults: dict[str, LimitSpec] = {"tenant:": self.limits.tenant_default}
        if DEFAULT_MODEL in self.limits.models:
            defaults["model:"] = self.limits.models[DEFAULT_MODEL]
        return specs, defaults


def admission_rules(config: Config) -> AdmissionRules:
    """The one conversion from the runtime config to admission's policy (extproc/admission/intake/rules.py).

    It shares the config's tables instead of copying them (`models`, `tenant_classes`, the keys of
    `limits.models`, the allow-list), so its cost does not grow with the number of tenants.
    """
    adm = config.admission
    return AdmissionRules(
        models=config.models,
        default_model=config.models.get(DEFAULT_MODEL) or DEFAULT_POLICY,
        limited_models=config.limits.models,  # a mapping: its keys, and picklable (a reload crosses a pipe)
        reject_unknown_models=adm.reject_unknown_models,
        classes=config.classes,
        default_class=config.default_class,
        tenant_classes=config.tenant_classes,
        tenant=adm.tenant,
        tenant_metrics=config.tenant_metrics,
        paths=config.paths,
        tokenizing=Tokenizing(
            threads=adm.tokenizer_threads,
            per_client=adm.tokenizer_per_client,
            backlog_per_client=adm.tokenizer_backlog_per_client,
            max_wait_seconds=adm.tokenizer_max_wait_seconds,
            inline_count_bytes=adm.inline_count_bytes,
            backlog_bytes_per_client=BACKLOG_BODIES * adm.max_body_bytes,
        ),
        per_step=adm.per_step,
        max_body_bytes=adm.max_body_bytes,
        inject_include_usage=adm.inject_include_usage,
        allow_request_chat_template=adm.allow_request_chat_template,
        allow_stored_context=adm.allow_stored_context,
        bound_admission=adm.bound_admission,
        shadow=config.shadow,
        end_report_wait_seconds=adm.end_report_wait_seconds,
        cached_prompt_token_weight=adm.cached_prompt_token_weight,
        proxy_buffer_bytes=adm.proxy_buffer_bytes,
        split_keys=split.SplitIndex.of(*config.configured_limits()),
        refuse_unserved=config.feedback.unserved_models == "refuse",
        max_queue_wait_seconds=adm.max_queue_wait_seconds,
        pool_headers=adm.inference_pool,
    )
