"""The sidecar's configuration: one YAML file, which becomes the Kubernetes ConfigMap.

Everything is validated when the file is loaded, and every error names the key path that is wrong
(`limits.models.llama.max_concurrency: must be an integer >= 0`), because the operator reading the log line
is usually editing a ConfigMap under pressure. Unknown keys are errors too: a misspelt limit that silently
falls back to a default is worse than a refused reload.

`ConfigWatcher` polls the file for changes. A ConfigMap volume replaces a `..data` symlink atomically, which
inotify on the file itself misses, so the watcher compares the resolved target and its stat on every poll.
A new file that fails validation is refused with a log line and the running config stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from extproc.admission.paths import DEFAULT_TABLE, PathRule, PathTable, RouteKind, normalize_path
from extproc.admission.policy import MediaCosts, MissingMaxTokens, ModelPolicy, StepBounds, TemplateCosts
from extproc.admission.tokens import DEFAULT_ENCODING, get_encoding
from extproc.core.adaptive import AdaptiveConfig
from extproc.core.limiter import LimitSpec
from extproc.feed.targets import Target, target_from_mapping
from extproc.feedback.settings import SubscriberConfig

log = logging.getLogger(__name__)

_IntFields = TypeVar("_IntFields", TemplateCosts, MediaCosts)

DEFAULT_MODEL = "*"
"""Key of the `models` / `limits.models` entry that applies to every model not named explicitly."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message starts with the offending key path."""


@dataclass(frozen=True)
class TenantConfig:
    """Where the tenant id comes from: a trusted header, or dynamic metadata set by an earlier filter."""

    header: str | None = None
    metadata_namespace: str | None = None
    metadata_key: str = "tenant"
    default: str = "default"


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
    max_body_bytes: int = 1 << 20
    tokenizer_threads: int = 2
    inject_include_usage: bool = True
    reject_unknown_models: bool = False
    tenant: TenantConfig = field(default_factory=TenantConfig)
    allow_request_chat_template: bool = False
    # Requests that prepend a stored conversation (Responses `previous_response_id`, SGLang sessions): their
    # prompt size is unknown, so they are refused unless allowed, and then charged as opaque.
    allow_stored_context: bool = False
    # Large prompts of one tenant (or one anonymous client address) counted at the same time, and waiting.
    tokenizer_per_client: int = 1
    tokenizer_backlog_per_client: int = 4
    tokenizer_max_wait_seconds: float = 0.5
    # Prompts with at most this many bytes of text are counted on the event loop, without a thread hop.
    inline_count_bytes: int = 8 * 1024
    # Admit on the prompt's byte-length bound where it decides, and count exactly after (provisional.py).
    bound_admission: bool = True
    # Per-sequence decode rate assumed for a pool until its completed streams teach the real one; bounds the
    # charge of answers nobody saw (a client that left before the response headers).
    assumed_decode_tokens_per_second: float = 100.0
    # Envoy's ext_proc max_message_timeout in the shipped configs; a queue wait must fit under it.
    envoy_max_message_timeout_seconds: float = 30.0
    # Lean profile: how long after a request ended its end report may arrive before the lease expires.
    end_report_wait_seconds: float = 2.0
    # The most per-step work (stop strings, bad words, logit bias, logprobs) one request may ask for.
    per_step: StepBounds = field(default_factory=StepBounds)


@dataclass(frozen=True)
class LimitsConfig:
    global_: LimitSpec = field(default_factory=LimitSpec)
    models: Mapping[str, LimitSpec] = field(default_factory=dict)
    tenant_default: LimitSpec = field(default_factory=LimitSpec)
    tenants: Mapping[str, LimitSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    grpc_listen: str = "127.0.0.1:50051"
    admin_listen: str = "127.0.0.1:9464"
    max_receive_message_bytes: int = 16 << 20
    shutdown_grace_seconds: float = 30.0
    config_poll_seconds: float = 1.0


@dataclass(frozen=True)
class StoreConfig:
    """Where limiter state lives. Read at start only: switching stores would orphan open leases."""

    backend: str = "local"  # local | redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "extproc:"
    lease_ttl_seconds: float = 60.0
    timeout_ms: float = 50.0
    on_unavailable: str = "local"  # local | reject
    fallback_share: float = 1.0
    redis_mode: str = "standalone"  # standalone | cluster
    redis_username: str | None = None
    redis_password_file: str | None = None  # a mounted Secret; never logged
    redis_password_env: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: str = "full"  # full | ca | none


@dataclass(frozen=True)
class KvBudgetConfig:
    enabled: bool = False
    target_utilization: float = 0.9
    capacity_share: float = 1.0
    booking: str = "forecast"  # forecast | lifetime (extproc.core.kv_budget.Booking)


@dataclass(frozen=True)
class FeedbackConfig:
    """KV-cache feedback: where samples come from and how each pool's limits react to them."""

    subscriber: SubscriberConfig | None = None
    kv_aggregation: str = "max"
    unserved_models: str = "refuse"  # refuse | admit: names a listing engine does not serve
    adaptive_default: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    adaptive_pools: Mapping[str, AdaptiveConfig] = field(default_factory=dict)
    kv_budget: KvBudgetConfig = field(default_factory=KvBudgetConfig)

    @property
    def enabled(self) -> bool:
        return self.subscriber is not None


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    models: Mapping[str, ModelPolicy] = field(
        default_factory=lambda: {DEFAULT_MODEL: ModelPolicy(context_window=8192)}
    )
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    classes: tuple[ClassConfig, ...] = (ClassConfig(DEFAULT_CLASS),)
    default_class: str = DEFAULT_CLASS
    tenant_classes: Mapping[str, str] = field(default_factory=dict)
    shadow: bool = False
    tenant_metrics: frozenset[str] = frozenset()
    log_level: str = "INFO"
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
        return self.models.get(DEFAULT_MODEL) or ModelPolicy(context_window=8192)

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


# -- parsing helpers ---------------------------------------------------------------------------------------


class _Section:
    """A mapping being read, which remembers its path and refuses keys nobody asked for."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or '<root>'}: must be a mapping, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str) -> Any:
        self.seen.add(name)
        return self.data.get(name)

    def section(self, name: str) -> _Section:
        return _Section(self.get(name), self.key(name))

    def integer(self, name: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.key(name)}: must be an integer >= {minimum}, got {value!r}")
        return value

    def required_integer(self, name: str, default: int, minimum: int = 0) -> int:
        value = self.integer(name, default, minimum)
        assert value is not None
        return value

    def number(self, name: str, default: float, minimum: float = 0.0) -> float:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise ConfigError(f"{self.key(name)}: must be a number >= {minimum}, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: must be true or false, got {value!r}")
        return value

    def string(self, name: str, default: str | None) -> str | None:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.key(name)}: must be a non-empty string, got {value!r}")
        return value

    def string_list(self, name: str) -> tuple[str, ...]:
        value = self.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{self.key(name)}: must be a list of non-empty strings, got {value!r}")
        return tuple(value)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ConfigError(f"{self.key(str(unknown[0]))}: unknown key")


def _listen(section: _Section, name: str, default: str) -> str:
    value = section.string(name, default)
    assert value is not None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{section.key(name)}: must be host:port (port 0 picks a free port), got {value!r}")
    return value


def _limit_spec(section: _Section, classes: Sequence[str] = (), nested: bool = True) -> LimitSpec:
    guaranteed: list[tuple[str, LimitSpec]] = []
    if nested:
        gsec = section.section("guaranteed")
        for name in gsec.data:
            if name not in classes:
                raise ConfigError(f"{gsec.key(str(name))}: not a class (classes: {', '.join(classes)})")
            guaranteed.append((str(name), _limit_spec(gsec.section(str(name)), nested=False)))
        gsec.done()
    max_concurrency = section.integer("max_concurrency", None, minimum=0)
    tokens_per_minute = section.integer("tokens_per_minute", None, minimum=1)
    try:
        spec = LimitSpec(
            max_concurrency=max_concurrency, tokens_per_minute=tokens_per_minute, guaranteed=tuple(guaranteed)
        )
    except ValueError as exc:
        raise ConfigError(f"{section.key('guaranteed')}: {exc}") from None
    section.done()
    return spec


def _limit_map(section: _Section, classes: Sequence[str] = ()) -> dict[str, LimitSpec]:
    out: dict[str, LimitSpec] = {}
    for name in section.data:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{section.path}: names must be non-empty strings, got {name!r}")
        out[name] = _limit_spec(section.section(name), classes)
    section.done()
    return out


def _classes(root: _Section) -> tuple[ClassConfig, ...]:
    raw = root.get("classes")
    if raw is None:
        return (ClassConfig(DEFAULT_CLASS),)
    if not isinstance(raw, list) or not raw:
        raise ConfigError("classes: must be a non-empty list, highest priority first")
    out: list[ClassConfig] = []
    for i, item in enumerate(raw):
        sec = _Section(item, f"classes[{i}]")
        name = sec.string("name", None)
        if name is None:
            raise ConfigError(f"{sec.key('name')}: required")
        if any(c.name == name for c in out):
            raise ConfigError(f"{sec.key('name')}: duplicate class {name!r}")
        queue = sec.section("queue")
        max_wait = queue.number("max_wait_seconds", 0.0)
        if max_wait > 3600:
            raise ConfigError(f"{queue.key('max_wait_seconds')}: must be at most 3600 (Envoy's limit)")
        max_queued = queue.required_integer("max_queued", 100 if max_wait else 0, minimum=0)
        queue.done()
        cut = sec.get("cut_streams_above_kv")
        if cut is not None and (
            isinstance(cut, bool) or not isinstance(cut, int | float) or not 0 < cut <= 1
        ):
            raise ConfigError(
                f"{sec.key('cut_streams_above_kv')}: must be a KV usage ratio in (0, 1], got {cut!r}"
            )
        out.append(
            ClassConfig(
                name=name,
                max_wait_seconds=max_wait,
                max_queued=max_queued,
                shadow=sec.boolean("shadow", False),
                cut_streams_above_kv=float(cut) if cut is not None else None,
                backend_priority=_signed_integer(sec, "backend_priority"),
            )
        )
        sec.done()
    return tuple(out)


def _signed_integer(section: _Section, name: str) -> int | None:
    value = section.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{section.key(name)}: must be an integer, got {value!r}")
    return value


def _paths(root: _Section) -> PathTable:
    """The path table: the built-in rows, minus `paths.deny`, plus `paths.free` ("[METHOD ]/path")."""
    sec = root.section("paths")
    deny = set()
    for raw in sec.string_list("deny"):
        path = normalize_path(raw)
        if path not in DEFAULT_TABLE.rules:
            raise ConfigError(f"paths.deny: {raw!r} is not a built-in path (see docs/admission.md)")
        deny.add(path)
    rules = {p: r for p, r in DEFAULT_TABLE.rules.items() if p not in deny}
    for raw in sec.string_list("free"):
        method, _, path = raw.rpartition(" ")
        method = method.strip().upper() or "GET"
        if not path.startswith("/") or not method.isalpha():
            raise ConfigError(f"paths.free: entries are '[METHOD ]/path', got {raw!r}")
        normal = normalize_path(path)
        if normal in rules and rules[normal].kind is RouteKind.METERED:
            raise ConfigError(f"paths.free: {raw!r} is a metered path; it cannot be made free")
        rules[normal] = PathRule(normal, frozenset({method}), RouteKind.FREE, None, "configured free path")
    sec.done()
    return PathTable(rules)


def _check_queue_waits(classes: Sequence[ClassConfig], envoy_max: float) -> None:
    """A queued request holds Envoy's ext_proc timer, which the sidecar extends to ceil(wait) + 1 s; past
    Envoy's max_message_timeout Envoy ignores the extension and answers 504 after its 1 s message_timeout."""
    for i, klass in enumerate(classes):
        extended = math.ceil(klass.max_wait_seconds) + 1
        if klass.queues and extended > envoy_max:
            raise ConfigError(
                f"classes[{i}].queue.max_wait_seconds: {klass.max_wait_seconds:g} s plus the 1 s the sidecar "
                f"adds exceeds admission.envoy_max_message_timeout_seconds ({envoy_max:g} s, Envoy's "
                "ext_proc max_message_timeout); shorten the wait or raise both"
            )


def _model_policy(section: _Section, base: ModelPolicy | None) -> ModelPolicy:
    context_window = section.integer("context_window", base.context_window if base else None, minimum=1)
    if context_window is None:
        raise ConfigError(f"{section.key('context_window')}: required")
    encoding = section.string("encoding", base.encoding if base else DEFAULT_ENCODING)
    assert encoding is not None
    try:
        get_encoding(encoding)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{section.key('encoding')}: unknown tiktoken encoding {encoding!r}") from exc
    default_max = section.required_integer(
        "default_max_tokens", base.default_max_tokens if base else 1024, minimum=1
    )
    inherited = base.missing_max_tokens if base else MissingMaxTokens.RESERVE_WINDOW
    missing = section.string("missing_max_tokens", inherited.value)
    if missing not in set(MissingMaxTokens):
        choices = ", ".join(m.value for m in MissingMaxTokens)
        raise ConfigError(f"{section.key('missing_max_tokens')}: must be one of {choices}, got {missing!r}")
    template = _integers(section.section("template"), base.template if base else TemplateCosts())
    media = _integers(section.section("media"), base.media if base else MediaCosts())
    pool = section.string("pool", None)
    section.done()
    return ModelPolicy(
        context_window=context_window,
        encoding=encoding,
        default_max_tokens=default_max,
        missing_max_tokens=MissingMaxTokens(missing),
        template=template,
        media=media,
        pool=pool,
    )


def _integers(section: _Section, base: _IntFields) -> _IntFields:
    """A section of non-negative integer fields over `base` (its dataclass fields are the allowed keys)."""
    values = {}
    for name in base.__dataclass_fields__:
        value = section.integer(name, None, minimum=0)
        if value is not None:
            values[name] = value
    section.done()
    return replace(base, **values)


_ADAPTIVE_KEYS = (
    "low_watermark",
    "high_watermark",
    "min_scale",
    "waiting_low",
    "waiting_high",
    "recovery_per_second",
    "stale_after_seconds",
    "stale_scale",
)


def _adaptive(section: _Section, base: AdaptiveConfig) -> AdaptiveConfig:
    values: dict[str, Any] = {}
    for key in _ADAPTIVE_KEYS:
        value = section.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{section.key(key)}: must be a number, got {value!r}")
        values[key] = float(value)
    try:
        config = replace(base, **values)
    except ValueError as exc:
        # AdaptiveConfig names the field as "adaptive.<key>"; put it under this section's path.
        message = str(exc).removeprefix("adaptive.")
        raise ConfigError(f"{section.path}.{message}") from None
    return config


def _feedback(root: _Section) -> FeedbackConfig:
    fb = root.section("feedback")
    targets: list[Target] = []
    raw_targets = fb.get("direct_targets") or []
    if not isinstance(raw_targets, list):
        raise ConfigError(f"{fb.key('direct_targets')}: must be a list of {{url, kind, model}} mappings")
    for i, item in enumerate(raw_targets):
        if not isinstance(item, Mapping):
            raise ConfigError(f"{fb.key('direct_targets')}[{i}]: must be a mapping with url, kind, model")
        try:
            targets.append(target_from_mapping(dict(item)))
        except ValueError as exc:
            raise ConfigError(f"{fb.key('direct_targets')}[{i}]: {exc}") from None
    exporters = fb.string_list("exporters")
    service = fb.string("service", None)
    aggregation = fb.string("kv_aggregation", "max") or "max"
    if aggregation not in ("max", "mean"):
        raise ConfigError(f"{fb.key('kv_aggregation')}: must be max or mean, got {aggregation!r}")
    unserved = fb.string("unserved_models", "refuse") or "refuse"
    if unserved not in ("refuse", "admit"):
        raise ConfigError(f"{fb.key('unserved_models')}: must be refuse or admit, got {unserved!r}")
    resolve = fb.number("resolve_interval_seconds", 10.0, minimum=0.1)
    subscriber: SubscriberConfig | None = None
    if exporters or service or targets:
        try:
            subscriber = SubscriberConfig(
                exporters=exporters,
                service=service,
                resolve_interval=resolve,
                direct_targets=tuple(targets),
                scrape_interval=fb.number("scrape_interval_seconds", 1.0, minimum=0.05),
            )
        except ValueError as exc:
            message = str(exc).replace("subscriber: ", "exporters: ", 1).removeprefix("subscriber.")
            raise ConfigError(f"feedback.{message}") from None
    else:
        fb.get("scrape_interval_seconds")
    fb.done()

    ad = root.section("adaptive")
    pools_section = ad.section("pools")
    default = _adaptive(ad, AdaptiveConfig())
    pools: dict[str, AdaptiveConfig] = {}
    for name in pools_section.data:
        pool = pools_section.section(str(name))
        pools[str(name)] = _adaptive(pool, default)
        pool.done()
    pools_section.done()
    ad.done()

    kb = root.section("kv_budget")
    target = kb.number("target_utilization", 0.9, minimum=0.01)
    share = kb.number("capacity_share", 1.0, minimum=0.01)
    if target > 1:
        raise ConfigError(f"kv_budget.target_utilization: must be in (0, 1], got {target}")
    if share > 1:
        raise ConfigError(f"kv_budget.capacity_share: must be in (0, 1], got {share}")
    booking = kb.string("booking", "forecast") or "forecast"
    if booking not in ("forecast", "lifetime"):
        raise ConfigError(f"{kb.key('booking')}: must be forecast or lifetime, got {booking!r}")
    budget = KvBudgetConfig(
        enabled=kb.boolean("enabled", False),
        target_utilization=target,
        capacity_share=share,
        booking=booking,
    )
    kb.done()
    if budget.enabled and subscriber is None:
        raise ConfigError(
            "kv_budget.enabled: needs a KV feed (feedback.exporters, service or direct_targets)"
        )
    return FeedbackConfig(
        subscriber=subscriber,
        kv_aggregation=aggregation,
        unserved_models=unserved,
        adaptive_default=default,
        adaptive_pools=pools,
        kv_budget=budget,
    )


def _store(root: _Section) -> StoreConfig:
    sec = root.section("store")
    backend = sec.string("backend", "local") or "local"
    if backend not in ("local", "redis"):
        raise ConfigError(f"store.backend: must be local or redis, got {backend!r}")
    red = sec.section("redis")
    url = red.string("url", StoreConfig.redis_url) or StoreConfig.redis_url
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"store.redis.url: must be a redis://, rediss:// or unix:// URL, got {url!r}")
    config = StoreConfig(
        backend=backend,
        redis_url=url,
        key_prefix=red.string("key_prefix", StoreConfig.key_prefix) or StoreConfig.key_prefix,
        lease_ttl_seconds=red.number("lease_ttl_seconds", StoreConfig.lease_ttl_seconds, minimum=1.0),
        timeout_ms=red.number("timeout_ms", StoreConfig.timeout_ms, minimum=1.0),
        on_unavailable=sec.string("on_unavailable", "local") or "local",
        fallback_share=sec.number("fallback_share", 1.0, minimum=0.001),
        **_redis_connection(red, url),
    )
    red.done()
    if config.on_unavailable not in ("local", "reject"):
        raise ConfigError(f"store.on_unavailable: must be local or reject, got {config.on_unavailable!r}")
    if config.fallback_share > 1:
        raise ConfigError(f"store.fallback_share: must be in (0, 1], got {config.fallback_share}")
    sec.done()
    return config


def _redis_connection(red: _Section, url: str) -> dict[str, Any]:
    """`store.redis` mode, ACL user and TLS; files named here must be readable now (mounted Secrets)."""
    mode = red.string("mode", "standalone") or "standalone"
    if mode not in ("standalone", "cluster"):
        raise ConfigError(f"store.redis.mode: must be standalone or cluster, got {mode!r}")
    if mode == "cluster" and url.startswith("unix://"):
        raise ConfigError("store.redis.url: cluster mode needs a redis:// or rediss:// URL of any node")
    if mode == "cluster" and urlsplit(url).path.strip("/") not in ("", "0"):
        raise ConfigError(f"store.redis.url: a Redis Cluster has only database 0, got {urlsplit(url).path!r}")
    out: dict[str, Any] = {
        "redis_mode": mode,
        "redis_username": red.string("username", None),
        "redis_password_file": _readable(red, "password_file"),
        "redis_password_env": red.string("password_env", None),
    }
    if out["redis_password_file"] and out["redis_password_env"]:
        raise ConfigError("store.redis.password_env: give password_file or password_env, not both")
    env = out["redis_password_env"]
    if env is not None and env not in os.environ:
        raise ConfigError(f"store.redis.password_env: environment variable {env} is not set")
    tls = red.section("tls")
    if tls.data and not url.startswith("rediss://"):
        raise ConfigError("store.redis.tls: TLS settings need a rediss:// URL")
    verify = tls.string("verify", "full") or "full"
    if verify not in ("full", "ca", "none"):
        raise ConfigError(f"store.redis.tls.verify: must be full, ca or none, got {verify!r}")
    out |= {
        "tls_ca_file": _readable(tls, "ca_file"),
        "tls_cert_file": _readable(tls, "cert_file"),
        "tls_key_file": _readable(tls, "key_file"),
        "tls_verify": verify,
    }
    if bool(out["tls_cert_file"]) != bool(out["tls_key_file"]):
        raise ConfigError("store.redis.tls.key_file: a client certificate needs both cert_file and key_file")
    tls.done()
    return out


def _readable(section: _Section, name: str) -> str | None:
    path = section.string(name, None)
    if path is not None and not os.access(path, os.R_OK):
        raise ConfigError(f"{section.key(name)}: cannot read {path!r}")
    return path


def parse_config(data: Any) -> Config:
    """Build a validated `Config` from parsed YAML."""
    root = _Section(data, "")

    srv = root.section("server")
    server = ServerConfig(
        grpc_listen=_listen(srv, "grpc_listen", ServerConfig.grpc_listen),
        admin_listen=_listen(srv, "admin_listen", ServerConfig.admin_listen),
        max_receive_message_bytes=srv.required_integer(
            "max_receive_message_bytes", ServerConfig.max_receive_message_bytes, minimum=1024
        ),
        shutdown_grace_seconds=srv.number("shutdown_grace_seconds", ServerConfig.shutdown_grace_seconds),
        config_poll_seconds=srv.number("config_poll_seconds", ServerConfig.config_poll_seconds, minimum=0.05),
    )
    srv.done()

    adm = root.section("admission")
    ten = adm.section("tenant")
    meta = ten.section("metadata")
    tenant = TenantConfig(
        header=(ten.string("header", None) or "").lower() or None,
        metadata_namespace=meta.string("namespace", None),
        metadata_key=meta.string("key", "tenant") or "tenant",
        default=ten.string("default", "default") or "default",
    )
    meta.done()
    ten.done()
    step, bound = adm.section("per_step"), StepBounds()
    per_step = StepBounds(
        stop=step.required_integer("stop", bound.stop, minimum=0),
        bad_words=step.required_integer("bad_words", bound.bad_words, minimum=0),
        logit_bias=step.required_integer("logit_bias", bound.logit_bias, minimum=0),
        logprobs=step.required_integer("logprobs", bound.logprobs, minimum=0),
        prompt_logprobs_tokens=step.required_integer(
            "prompt_logprobs_tokens", bound.prompt_logprobs_tokens, minimum=0
        ),
    )
    step.done()
    admission = AdmissionConfig(
        max_body_bytes=adm.required_integer("max_body_bytes", AdmissionConfig.max_body_bytes, minimum=1),
        tokenizer_threads=adm.required_integer("tokenizer_threads", 2, minimum=1),
        inject_include_usage=adm.boolean("inject_include_usage", True),
        reject_unknown_models=adm.boolean("reject_unknown_models", False),
        tenant=tenant,
        allow_request_chat_template=adm.boolean("allow_request_chat_template", False),
        allow_stored_context=adm.boolean("allow_stored_context", False),
        tokenizer_per_client=adm.required_integer("tokenizer_per_client", 1, minimum=1),
        tokenizer_backlog_per_client=adm.required_integer("tokenizer_backlog_per_client", 4, minimum=0),
        tokenizer_max_wait_seconds=adm.number("tokenizer_max_wait_seconds", 0.5, minimum=0.0),
        inline_count_bytes=adm.required_integer(
            "inline_count_bytes", AdmissionConfig.inline_count_bytes, minimum=0
        ),
        bound_admission=adm.boolean("bound_admission", AdmissionConfig.bound_admission),
        assumed_decode_tokens_per_second=adm.number(
            "assumed_decode_tokens_per_second", AdmissionConfig.assumed_decode_tokens_per_second, minimum=1.0
        ),
        envoy_max_message_timeout_seconds=adm.number("envoy_max_message_timeout_seconds", 30.0, minimum=1.0),
        end_report_wait_seconds=adm.number("end_report_wait_seconds", 2.0, minimum=0.05),
        per_step=per_step,
    )
    adm.done()
    # grpc drops a message larger than its receive limit without telling the handler; Envoy then times out.
    if admission.max_body_bytes + 64 * 1024 > server.max_receive_message_bytes:
        raise ConfigError(
            "server.max_receive_message_bytes: must exceed admission.max_body_bytes by at least 64 KiB "
            f"({server.max_receive_message_bytes} <= {admission.max_body_bytes} + 65536)"
        )

    mdl = root.section("models")
    default_policy = (
        _model_policy(mdl.section(DEFAULT_MODEL), None)
        if DEFAULT_MODEL in mdl.data
        else ModelPolicy(context_window=8192)
    )
    models: dict[str, ModelPolicy] = {DEFAULT_MODEL: default_policy}
    for name in mdl.data:
        if name == DEFAULT_MODEL:
            continue
        if not isinstance(name, str) or not name:
            raise ConfigError(f"models: names must be non-empty strings, got {name!r}")
        models[name] = _model_policy(mdl.section(name), default_policy)
    mdl.done()

    classes = _classes(root)
    _check_queue_waits(classes, admission.envoy_max_message_timeout_seconds)
    names = [c.name for c in classes]
    default_class = root.string("default_class", names[-1] if DEFAULT_CLASS not in names else DEFAULT_CLASS)
    if default_class not in names:
        raise ConfigError(f"default_class: {default_class!r} is not a class (classes: {', '.join(names)})")
    tenant_classes: dict[str, str] = {}
    tsec = root.section("tenants")
    for tenant_id in tsec.data:
        entry = tsec.section(str(tenant_id))
        klass = entry.string("class", None)
        if klass not in names:
            raise ConfigError(f"{entry.key('class')}: {klass!r} is not a class (classes: {', '.join(names)})")
        tenant_classes[str(tenant_id)] = klass
        entry.done()
    tsec.done()
    msec = root.section("metrics")
    tenant_metrics = frozenset(msec.string_list("tenant_allowlist"))
    msec.done()

    lim = root.section("limits")
    limits = LimitsConfig(
        global_=_limit_spec(lim.section("global"), names),
        models=_limit_map(lim.section("models"), names),
        tenant_default=_limit_spec(lim.section("tenant_default")),
        tenants=_limit_map(lim.section("tenants")),
    )
    lim.done()

    feedback = _feedback(root)
    store = _store(root)
    paths = _paths(root)
    shadow = root.boolean("shadow", False)
    log_level = (root.string("log_level", "INFO") or "INFO").upper()
    if log_level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"log_level: must be one of debug, info, warning, error, got {log_level!r}")
    root.done()
    return Config(
        server=server,
        admission=admission,
        models=models,
        limits=limits,
        feedback=feedback,
        store=store,
        classes=classes,
        default_class=default_class,
        tenant_classes=tenant_classes,
        shadow=shadow,
        tenant_metrics=tenant_metrics,
        log_level=log_level,
        paths=paths,
    )


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"<file>: cannot read {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"<file>: invalid YAML in {path}: {exc}") from exc
    return parse_config(data)


def _fingerprint(path: Path) -> tuple[str, bytes] | None:
    try:
        real = os.path.realpath(path)
        return real, hashlib.sha256(Path(real).read_bytes()).digest()
    except OSError:
        return None


class ReloadResult(StrEnum):
    """What became of one changed config file: every outcome is reported, so a refused edit is visible."""

    APPLIED = "applied"
    REFUSED = "refused"  # the file is invalid (YAML or a key): nothing applied
    FAILED = "failed"  # valid, but applying it raised: the running config stays
    UNREADABLE = "unreadable"  # the file vanished or cannot be read (reported once until it is back)


class ConfigWatcher:
    """Polls a config file and hands each valid new version to `on_change`; keeps the old one otherwise.

    `on_result` hears the outcome of every change (the sidecar counts them in `extproc_config_reloads_total`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[Config], Awaitable[None]],
        interval_s: float,
        on_result: Callable[[ReloadResult], None] = lambda _result: None,
    ) -> None:
        self.path = Path(path)
        self.on_change = on_change
        self.on_result = on_result
        self.interval_s = interval_s
        self._last = _fingerprint(self.path)
        self._unreadable = False
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="config-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self) -> bool:
        """Reload if the file changed; returns True when a new config was applied."""
        current = _fingerprint(self.path)
        if current is None:
            if not self._unreadable:
                self._unreadable = True
                self._refused(ReloadResult.UNREADABLE, f"cannot read {self.path}")
            return False
        self._unreadable = False
        if current == self._last:
            return False
        self._last = current
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            self._refused(ReloadResult.REFUSED, str(exc))
            return False
        try:
            await self.on_change(config)
        except Exception as exc:
            self._refused(ReloadResult.FAILED, f"{type(exc).__name__}: {exc}", exc)
            return False
        self.reloads += 1
        self.on_result(ReloadResult.APPLIED)
        log.info("config reloaded", extra={"path": str(self.path)})
        return True

    def _refused(self, result: ReloadResult, error: str, exc: BaseException | None = None) -> None:
        self.failures += 1
        self.on_result(result)
        log.error(
            "config reload not applied, keeping the running config",
            extra={"result": result.value, "error": error},
            exc_info=exc,
        )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("config reload failed, keeping the running config")
