"""`RedisStore` from its settings (`store.redis`, extproc/store/settings.py `RedisSettings`): the builder the
Redis backend registers (extproc/store/backends.py)."""

from __future__ import annotations

from extproc.store.redis.connection import Credentials, TlsOptions
from extproc.store.redis.store import RedisStore
from extproc.store.settings import RedisSettings


def redis_store(settings: RedisSettings) -> RedisStore:
    """A store on the settings' URL; TLS where it is a `rediss://` one."""
    tls = None
    if settings.url.startswith("rediss://"):
        tls = TlsOptions(
            ca_file=settings.tls_ca_file,
            cert_file=settings.tls_cert_file,
            key_file=settings.tls_key_file,
            verify=settings.tls_verify,
        )
    return RedisStore.from_url(
        settings.url,
        mode=settings.mode,
        tls=tls,
        credentials=Credentials(
            username=settings.username,
            password_file=settings.password_file,
            password_env=settings.password_env,
        ),
        key_prefix=settings.key_prefix,
        lease_ttl_s=settings.lease_ttl_seconds,
        timeout_s=settings.timeout_ms / 1000,
    )
