"""Builds the limiter store the `store` settings ask for (read once at start)."""

from __future__ import annotations

from extproc.core.clock import Clock
from extproc.core.ports import LimiterStore
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore
from extproc.store.settings import StoreSettings


def build_store(settings: StoreSettings, clock: Clock) -> LimiterStore:
    """In-process state by default; Redis shared by the replicas, wrapped with a local fallback unless the
    operator chose to fail closed (`on_unavailable: reject`)."""
    if settings.backend == "local":
        return LocalStore(clock=clock)
    # Only deployments that share state need the client.
    from extproc.store.redis import RedisStore
    from extproc.store.redis.connection import Credentials, TlsOptions

    tls = None
    if settings.redis_url.startswith("rediss://"):
        tls = TlsOptions(
            ca_file=settings.tls_ca_file,
            cert_file=settings.tls_cert_file,
            key_file=settings.tls_key_file,
            verify=settings.tls_verify,
        )
    shared = RedisStore.from_url(
        settings.redis_url,
        mode=settings.redis_mode,
        tls=tls,
        credentials=Credentials(
            username=settings.redis_username,
            password_file=settings.redis_password_file,
            password_env=settings.redis_password_env,
        ),
        key_prefix=settings.key_prefix,
        lease_ttl_s=settings.lease_ttl_seconds,
        timeout_s=settings.timeout_ms / 1000,
    )
    if settings.on_unavailable == "reject":
        return shared
    return FallbackStore(shared, LocalStore(clock=clock), settings.fallback_share)
