"""The shared limiter store in Redis (one Redis or a Redis Cluster): several gateway replicas, one set of
limits. `RedisStore` (in `store`) composes the modules of this package; see `store` for the map."""

from extproc.core.ports import StoreUnavailable
from extproc.store.redis.breaker import BREAKER_FAILURES, BREAKER_OPEN_S, RedisUnavailable, RedisUnsafe
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S
from extproc.store.redis.connection import Credentials, Mode, TlsOptions, Verify
from extproc.store.redis.store import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_REFRESH_S,
    DEFAULT_TIMEOUT_S,
    RedisStore,
)

__all__ = [
    "BACKGROUND_TIMEOUT_S",
    "BREAKER_FAILURES",
    "BREAKER_OPEN_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_REFRESH_S",
    "DEFAULT_TIMEOUT_S",
    "Credentials",
    "Mode",
    "RedisStore",
    "RedisUnavailable",
    "RedisUnsafe",
    "StoreUnavailable",
    "TlsOptions",
    "Verify",
]
