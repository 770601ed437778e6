"""The runtime config: the types the sidecar's packages take, built once from a validated `ConfigFile`.

Their shapes are what the code needs (a model's policy with its inheritance resolved, limits as
`LimitSpec`, the feed subscriber's settings), not the file's; their defaults are the schema's
(extproc/config/schema.py), so `Config()` is the config of an empty file. The feed's settings
(`FeedbackConfig`) are the subscriber's own type (extproc/kvfeed/subscriber/settings.py): config converts
into them, and the schema takes its defaults from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.admission.paths import DEFAULT_TABLE, PathTable
from extproc.admission.policy import ModelPolicy, StepBounds
from extproc.config import schema
from extproc.core.limiter import LimitSpec
from extproc.kvfeed.subscriber.settings import FeedbackConfig

DEFAULT_MODEL = "*"
"""Key of the `models` / `limits.models` entry that applies to every model not named explicitly."""
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


@dataclass(frozen=True)
class TenantConfig:
    """Where the tenant id comes from: a trusted header, or dynamic metadata set by an earlier filter."""

    header: str | None = _TENANT.header
    metadata_namespace: str | None = _TENANT.metadata.namespace
    metadata_key: str = _TENANT.metadata.key
    default: str = _TENANT.default


DEFAULT_CLASS = "default"
"""The single class every request belongs to when no classes are configured."""


@dataclass(frozen=True)
class ClassConfig:
    """A priority class. Order in the config is priority: the first class is the most important."""

    name: str
    max_wait_seconds: float = 0.0  # 0: answer 429 at once instead of waiting for capacity
    max_queued: int = 0
    shadow: bool = False
    cut_streams_above_kv: float | None = None
    # Written into the body's `priority` (vLLM/SGLang priority scheduling); None: the client's is removed.
    backend_priority: int | None = None

    @property
    def queues(self) -> bool:
        return self.max_wait_seconds > 0 and self.max_queued > 0


@dataclass(frozen=True)
class AdmissionConfig:
    """`admission`, with `tenant` flattened and `per_step` as the `StepBounds` admission takes."""

    max_body_bytes: int = _ADMISSION.max_body_bytes
    tokenizer_threads: int = _ADMISSION.tokenizer_threads
    inject_include_usage: bool = _ADMISSION.inject_include_usage
    reject_unknown_models: bool = _ADMISSION.reject_unknown_models
    tenant: TenantConfig = field(default_factory=TenantConfig)
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


@dataclass(frozen=True)
class StoreConfig:
    """`store`, flattened for the store factory. Read at start only: switching stores orphans leases."""

    backend: str = _STORE.backend  # local | redis
    redis_url: str = _STORE.redis.url
    key_prefix: str = _STORE.redis.key_prefix
    lease_ttl_seconds: float = _STORE.redis.lease_ttl_seconds
    timeout_ms: float = _STORE.redis.timeout_ms
    on_unavailable: str = _STORE.on_unavailable  # local | reject
    fallback_share: float = _STORE.fallback_share
    redis_mode: str = _STORE.redis.mode  # standalone | cluster
    redis_username: str | None = _STORE.redis.username
    redis_password_file: str | None = _STORE.redis.password_file  # a mounted Secret; never logged
    redis_password_env: str | None = _STORE.redis.password_env
    tls_ca_file: str | None = _STORE.redis.tls.ca_file
    tls_cert_file: str | None = _STORE.redis.tls.cert_file
    tls_key_file: str | None = _STORE.redis.tls.key_file
    tls_verify: str = _STORE.redis.tls.verify  # full | ca | none


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    models: Mapping[str, ModelPolicy] = field(default_factory=lambda: {DEFAULT_MODEL: DEFAULT_POLICY})
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    classes: tuple[ClassConfig, ...] = (ClassConfig(DEFAULT_CLASS),)
    default_class: str = DEFAULT_CLASS
    tenant_classes: Mapping[str, str] = field(default_factory=dict)
    shadow: bool = _ROOT.shadow
    tenant_metrics: frozenset[str] = frozenset()
    log_level: str = _ROOT.log_level
    paths: PathTable = DEFAULT_TABLE

    def class_of(self, tenant: str) -> ClassConfig:
        """The class of a tenant; unknown tenants fall into the default class."""
        name = self.tenant_classes.get(tenant, self.default_class)
        return self.class_config(name)

    def class_config(self, name: str) -> ClassConfig:
        for klass in self.classes:
            if klass.name == name:
                return klass
        return self.classes[-1]

    @property
    def priority(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def tenant_label(self, tenant: str) -> str:
        """Tenant as a metric label: only allow-listed tenants get their own series."""
        return tenant if tenant in self.tenant_metrics else "other"

    def model_policy(self, model: str) -> ModelPolicy | None:
        """Policy for a served model name; None when unknown and unknown models are refused."""
        policy = self.models.get(model)
        if policy is not None:
            return policy
        if self.admission.reject_unknown_models:
            return None
        return self.models.get(DEFAULT_MODEL) or DEFAULT_POLICY

    def names_model(self, model: str) -> bool:
        """Whether `models` or `limits.models` names `model` itself (not through `models."*"`)."""
        return model != DEFAULT_MODEL and (model in self.models or model in self.limits.models)

    def pool_of(self, model: str) -> str:
        """The pool a model name's requests count against (its `model:<pool>` key and KV budget).

        A configured model is its own pool unless `pool` names another (an alias, a LoRA adapter of the same
        base model). Every name the config does not know shares the single pool of `models."*"` (its `pool`,
        else `*`): a client cannot mint fresh limits or escape the KV budget by inventing model names.
        """
        policy = self.models.get(model)
        if model != DEFAULT_MODEL and policy is not None:
            return policy.pool or model
        if model != DEFAULT_MODEL and model in self.limits.models:
            return model
        default = self.models.get(DEFAULT_MODEL)
        return default.pool if default is not None and default.pool else DEFAULT_MODEL

    def model_label(self, pool: str) -> str:
        """A pool as the `model` metric label: configured pools by name, the unknown-name pool as `other`."""
        return pool if pool != DEFAULT_MODEL else "other"

    def model_labels(self) -> list[str]:
        """Every `model` label value requests can be counted under (bounded by the config)."""
        pools = {self.pool_of(name) for name in [*self.models, *self.limits.models]}
        return sorted({self.model_label(pool) for pool in pools} | {"other"})

    def limit_specs(self) -> tuple[dict[str, LimitSpec], dict[str, LimitSpec]]:
        """Keys with explicit limits, and per-prefix defaults for keys first seen at run time."""
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
