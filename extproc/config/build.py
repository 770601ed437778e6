"""`parse_config`: parsed YAML -> validated `ConfigFile` -> the runtime `Config`, in one pass each.

The schema (extproc/config/schema.py) checks every key's type and range and reports every problem at once;
extproc/config/problems.py turns its errors into key-path sentences, unknown keys first (a later error may be
a consequence of the misspelling). This module then checks what spans keys (a queue wait
against Envoy's timeout, a tenant's class, a guarantee's class) and what needs the environment (readable
Secret files, a set variable), and builds the runtime types.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from extproc.admission.intake.paths import DEFAULT_TABLE, PathRule, PathTable, RouteKind, normalize_path
from extproc.admission.intake.rules import DEFAULT_MODEL, PoolHeaders
from extproc.admission.vocabulary.policy import (
    ClassPolicy,
    MediaCosts,
    MissingMaxTokens,
    ModelPolicy,
    StepBounds,
    TemplateCosts,
)
from extproc.admission.vocabulary.tokens import get_encoding
from extproc.config import schema
from extproc.config.errors import ConfigError
from extproc.config.problems import problems
from extproc.config.runtime import (
    DEFAULT_CLASS,
    DEFAULT_CLASSES,
    DEFAULT_POLICY,
    AdmissionConfig,
    Config,
    LimitsConfig,
    ServerConfig,
    class_policy,
    store_settings,
    tenant_source,
)
from extproc.config.walk import nulls_absent
from extproc.core.engine.adaptive import AdaptiveConfig, AdaptiveConfigError, watermarks_above
from extproc.core.kv.config import KvBudgetConfig
from extproc.core.limiter.limiter import LimitSpec
from extproc.kvfeed.subscriber.settings import (
    FeedbackConfig,
    SubscriberConfig,
    SubscriberConfigError,
)
from extproc.kvfeed.targets import Target, target_from_mapping
from extproc.store.settings import StoreSettings


def parse_config(data: Any) -> Config:
    """Build a validated `Config` from parsed YAML; every problem is a `ConfigError` naming its key path."""
    with collector_paused():
        return build(validate(data))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block, as it was after: for work that allocates a few objects
    per key and frees none, so that each generation-2 collection walks a heap that only grows. Validating a
    10^5-tenant file took three times as long with the collector on; a reload decoding its tenant table
    (load.py) paused three or four times for 0.1 s in the loop's turns. None of these objects form cycles,
    so nothing is left for the collector once it runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def validate(data: Any) -> schema.ConfigFile:
    """The file checked against the schema: every unknown key and every bad value, in one error."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"<root>: must be a mapping, got {type(data).__name__}")
    try:
        return schema.ConfigFile.model_validate(nulls_absent(data or {}))
    except ValidationError as exc:
        raise ConfigError(*problems(exc.errors(include_url=False, include_context=False))) from None


# -- the runtime config ------------------------------------------------------------------------------------


def build(file: schema.ConfigFile) -> Config:
    """The runtime `Config` of a validated file, after the checks that span keys."""
    admission = _admission(file.admission)
    # grpc drops a message larger than its receive limit without telling the handler; Envoy then times out.
    if admission.max_body_bytes + 64 * 1024 > file.server.max_receive_message_bytes:
        raise ConfigError(
            "server.max_receive_message_bytes: must exceed admission.max_body_bytes by at least 64 KiB "
            f"({file.server.max_receive_message_bytes} <= {admission.max_body_bytes} + 65536)"
        )
    classes = _classes(file.classes)
    _check_queue_waits(classes, admission.envoy_max_message_timeout_seconds)
    names = [c.name for c in classes]
    default_class = file.default_class or (names[-1] if DEFAULT_CLASS not in names else DEFAULT_CLASS)
    if default_class not in names:
        raise ConfigError(f"default_class: {default_class!r} is not a class (classes: {', '.join(names)})")
    _check_objectives(admission.inference_pool, names)
    return Config(
        server=ServerConfig(**file.server.model_dump()),
        admission=admission,
        models=_models(file.models),
        limits=_limits(file.limits, names),
        feedback=_feedback(file),
        store=_store(file.store),
        classes=classes,
        default_class=default_class,
        tenant_classes=_tenant_classes(file.tenants, names),
        shadow=file.shadow,
        tenant_metrics=frozenset(file.metrics.tenant_allowlist),
        log_level=file.log_level,
        paths=_paths(file.paths),
    )


def _overrides(section: BaseModel) -> dict[str, Any]:
    """The fields a section sets (the rest inherit)."""
    return {k: v for k, v in section.model_dump(exclude_none=True).items() if not isinstance(v, dict)}


def _admission(adm: schema.Admission) -> AdmissionConfig:
    tenant = tenant_source(adm.tenant)
    nested = ("tenant", "per_step", "inference_pool")
    fields = {k: v for k, v in adm.model_dump().items() if k not in nested}
    pool = adm.inference_pool
    headers = PoolHeaders(
        pool.trust_fairness_id,
        pool.trust_objective,
        dict(pool.objectives),
        pool.trust_destination_endpoint,
    )
    return AdmissionConfig(
        **fields,
        tenant=tenant,
        per_step=replace(StepBounds(), **_overrides(adm.per_step)),
        inference_pool=headers,
    )


def _check_objectives(headers: PoolHeaders, names: Sequence[str]) -> None:
    """Every objective must map to a class (a typo would silently leave its requests in their tenant's)."""
    for objective, klass in headers.objectives.items():
        if klass not in names:
            raise ConfigError(
                f"admission.inference_pool.objectives.{objective}: {klass!r} is not a class "
                f"(classes: {', '.join(names)})"
            )


def _models(models: Mapping[str, schema.Model]) -> dict[str, ModelPolicy]:
    star = models.get(DEFAULT_MODEL)
    default = _policy(star, DEFAULT_POLICY) if star is not None else DEFAULT_POLICY
    out = {DEFAULT_MODEL: default}
    out |= {name: _policy(entry, default) for name, entry in models.items() if name != DEFAULT_MODEL}
    for encoding in {policy.encoding for policy in out.values()}:
        get_encoding(encoding)  # loaded (and cached) with the config, not by the first request that counts
    return out


def _policy(entry: schema.Model, base: ModelPolicy) -> ModelPolicy:
    return ModelPolicy(
        context_window=entry.context_window or base.context_window,
        encoding=entry.encoding or base.encoding,
        default_max_tokens=entry.default_max_tokens or base.default_max_tokens,
        missing_max_tokens=MissingMaxTokens(entry.missing_max_tokens or base.missing_max_tokens),
        template=replace(base.template, **_overrides(entry.template)),
        media=replace(base.media, **_overrides(entry.media)),
        pool=entry.pool,
    )


assert TemplateCosts is not None and MediaCosts is not None  # the types `replace` builds above


def _limits(limits: schema.Limits, classes: Sequence[str]) -> LimitsConfig:
    return LimitsConfig(
        global_=_limit(limits.global_, "limits.global", classes),
        models={n: _limit(s, f"limits.models.{n}", classes) for n, s in limits.models.items()},
        tenant_default=_limit(limits.tenant_default, "limits.tenant_default", ()),
        tenants={n: _limit(s, f"limits.tenants.{n}", ()) for n, s in limits.tenants.items()},
    )


def _limit(limit: schema.Limit, path: str, classes: Sequence[str]) -> LimitSpec:
    for name in limit.guaranteed:
        if name not in classes:
            raise ConfigError(f"{path}.guaranteed.{name}: not a class (classes: {', '.join(classes)})")
    guaranteed = tuple(
        (name, LimitSpec(max_concurrency=g.max_concurrency, tokens_per_minute=g.tokens_per_minute))
        for name, g in limit.guaranteed.items()
    )
    try:
        return LimitSpec(
            max_concurrency=limit.max_concurrency,
            tokens_per_minute=limit.tokens_per_minute,
            guaranteed=guaranteed,
            input_tokens_per_minute=limit.input_tokens_per_minute,
            output_tokens_per_minute=limit.output_tokens_per_minute,
        )
    except ValueError as exc:
        raise ConfigError(f"{path}.guaranteed: {exc}") from None


def _classes(classes: Sequence[schema.Class] | None) -> tuple[ClassPolicy, ...]:
    if classes is None:
        return DEFAULT_CLASSES
    out: list[ClassPolicy] = []
    for i, klass in enumerate(classes):
        if any(c.name == klass.name for c in out):
            raise ConfigError(f"classes[{i}].name: duplicate class {klass.name!r}")
        out.append(class_policy(klass))
    return tuple(out)


def _check_queue_waits(classes: Sequence[ClassPolicy], envoy_max: float) -> None:
    """A queued request holds Envoy's ext_proc timer, which the sidecar extends to ceil(wait) + 1 s; past
    Envoy's max_message_timeout Envoy ignores the extension and answers 504 at its message_timeout (5 s)."""
    for i, klass in enumerate(classes):
        extended = math.ceil(klass.max_wait_seconds) + 1
        if klass.queues and extended > envoy_max:
            raise ConfigError(
                f"classes[{i}].queue.max_wait_seconds: {klass.max_wait_seconds:g} s plus the 1 s the sidecar "
                f"adds exceeds admission.envoy_max_message_timeout_seconds ({envoy_max:g} s, Envoy's "
                "ext_proc max_message_timeout); shorten the wait or raise both"
            )


def _tenant_classes(tenants: Mapping[str, schema.TenantEntry], names: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for tenant, entry in tenants.items():
        if entry.klass is None or entry.klass not in names:
            raise ConfigError(
                f"tenants.{tenant}.class: {entry.klass!r} is not a class (classes: {', '.join(names)})"
            )
        out[tenant] = entry.klass
    return out


def _paths(paths: schema.Paths) -> PathTable:
    """The path table: the built-in rows, minus `paths.deny`, plus `paths.free` ("[METHOD ]/path")."""
    deny = set()
    for raw in paths.deny:
        path = normalize_path(raw)
        if path not in DEFAULT_TABLE.rules:
            raise ConfigError(f"paths.deny: {raw!r} is not a built-in path (see docs/admission.md)")
        deny.add(path)
    rules = {p: r for p, r in DEFAULT_TABLE.rules.items() if p not in deny}
    for raw in paths.free:
        method, _, path = raw.rpartition(" ")
        method = method.strip().upper() or "GET"
        if not path.startswith("/") or not method.isalpha():
            raise ConfigError(f"paths.free: entries are '[METHOD ]/path', got {raw!r}")
        normal = normalize_path(path)
        if normal in rules and rules[normal].kind is RouteKind.METERED:
            raise ConfigError(f"paths.free: {raw!r} is a metered path; it cannot be made free")
        rules[normal] = PathRule(normal, frozenset({method}), RouteKind.FREE, None, "configured free path")
    return PathTable(rules)


def _feedback(file: schema.ConfigFile) -> FeedbackConfig:
    fb = file.feedback
    subscriber = _subscriber(fb) if fb.has_source else None
    base = AdaptiveConfig()
    marks = {file.adaptive.low_watermark, file.adaptive.high_watermark}
    if file.kv_budget.enabled and marks == {None}:  # defaults that make room for the budget
        low, high = watermarks_above(file.kv_budget.target_utilization)
        base = replace(base, low_watermark=low, high_watermark=high)
    default = _adaptive(base, file.adaptive, "adaptive")
    pools = {
        name: _adaptive(default, tuning, f"adaptive.pools.{name}")
        for name, tuning in file.adaptive.pools.items()
    }
    budget = KvBudgetConfig(**file.kv_budget.model_dump())
    if budget.enabled and subscriber is None:
        raise ConfigError(
            "kv_budget.enabled: needs a KV feed (feedback.exporters, service or direct_targets)"
        )
    return FeedbackConfig(
        subscriber=subscriber,
        kv_aggregation=fb.kv_aggregation,
        unserved_models=fb.unserved_models,
        adaptive_default=default,
        adaptive_pools=pools,
        kv_budget=budget,
    )


def _subscriber(fb: schema.Feedback) -> SubscriberConfig:
    targets: list[Target] = []
    for i, target in enumerate(fb.direct_targets):
        try:
            targets.append(target_from_mapping(target.model_dump(exclude_none=True)))
        except ValueError as exc:
            raise ConfigError(f"feedback.direct_targets[{i}]: {exc}") from None
    try:
        return SubscriberConfig(
            exporters=fb.exporters,
            service=fb.service,
            resolve_interval=fb.resolve_interval_seconds,
            direct_targets=tuple(targets),
            scrape_interval=fb.scrape_interval_seconds,
        )
    except SubscriberConfigError as exc:
        raise ConfigError(f"feedback.{exc.key}: {exc.reason}") from None


def _adaptive(base: AdaptiveConfig, tuning: schema.AdaptiveTuning, path: str) -> AdaptiveConfig:
    try:
        return replace(base, **_overrides(tuning))
    except AdaptiveConfigError as exc:
        raise ConfigError(f"{path}.{exc.key}: {exc.reason}") from None


def _store(store: schema.Store) -> StoreSettings:
    _check_redis(store.redis)
    return store_settings(store)


def _check_redis(red: schema.Redis) -> None:
    """`store.redis` mode, ACL user and TLS; files named here must be readable now (mounted Secrets)."""
    if red.mode == "cluster" and red.url.startswith("unix://"):
        raise ConfigError("store.redis.url: cluster mode needs a redis:// or rediss:// URL of any node")
    if red.mode == "cluster" and urlsplit(red.url).path.strip("/") not in ("", "0"):
        raise ConfigError(
            f"store.redis.url: a Redis Cluster has only database 0, got {urlsplit(red.url).path!r}"
        )
    _readable("store.redis.password_file", red.password_file)
    if red.password_file and red.password_env:
        raise ConfigError("store.redis.password_env: give password_file or password_env, not both")
    if red.password_env is not None and red.password_env not in os.environ:
        raise ConfigError(f"store.redis.password_env: environment variable {red.password_env} is not set")
    if red.tls.model_fields_set and not red.url.startswith("rediss://"):
        raise ConfigError("store.redis.tls: TLS settings need a rediss:// URL")
    for name in ("ca_file", "cert_file", "key_file"):
        _readable(f"store.redis.tls.{name}", getattr(red.tls, name))
    if bool(red.tls.cert_file) != bool(red.tls.key_file):
        raise ConfigError("store.redis.tls.key_file: a client certificate needs both cert_file and key_file")


def _readable(key: str, path: str | None) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ConfigError(f"{key}: cannot read {path!r}")
