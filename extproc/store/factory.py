"""Builds the limiter store the config asks for (read once at start)."""

from __future__ import annotations

from typing import cast

from extproc.config import StoreConfig
from extproc.core.clock import Clock
from extproc.core.ports import LimiterStore
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore


def build_store(config: StoreConfig, clock: Clock) -> LimiterStore:
    """In-process state by default; Redis shared by the replicas, wrapped with a local fallback unless the
    operator chose to fail closed (`on_unavailable: reject`)."""
    if config.backend == "local":
        return LocalStore(clock=clock)
    # Only deployments that share state need the client.
    from extproc.store.redis import RedisStore
    from extproc.store.redis.connection import Credentials, Mode, TlsOptions, Verify

    tls = None
    if config.redis_url.startswith("rediss://"):
        tls = TlsOptions(
            ca_file=config.tls_ca_file,
            cert_file=config.tls_cert_file,
            key_file=config.tls_key_file,
            verify=cast(Verify, config.tls_verify),
        )
    shared = RedisStore.from_url(
        config.redis_url,
        mode=cast(Mode, config.redis_mode),
        tls=tls,
        credentials=Credentials(
            username=config.redis_username,
            password_file=config.redis_password_file,
            password_env=config.redis_password_env,
        ),
        key_prefix=config.key_prefix,
        lease_ttl_s=config.lease_ttl_seconds,
        timeout_s=config.timeout_ms / 1000,
    )
    if config.on_unavailable == "reject":
        return shared
    return FallbackStore(shared, LocalStore(clock=clock), config.fallback_share)
