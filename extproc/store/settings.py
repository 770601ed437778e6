"""What the store factory takes: `StoreSettings`, built from the config's `store` section at load.

The store package defines it, so it depends on no config class; the config package converts `store` into it
(extproc/config/runtime.py) and holds the defaults. Read at start only: switching stores orphans leases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["local", "redis"]
OnUnavailable = Literal["local", "reject"]  # fall back to this replica's own limits, or refuse (fail closed)
RedisMode = Literal["standalone", "cluster"]
TlsVerify = Literal["full", "ca", "none"]


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """`store`, flattened for `build_store`: the backend, and for Redis how to reach it and what to do
    when it cannot be reached."""

    backend: Backend
    redis_url: str
    key_prefix: str
    lease_ttl_seconds: float
    timeout_ms: float
    on_unavailable: OnUnavailable
    fallback_share: float
    redis_mode: RedisMode
    redis_username: str | None
    redis_password_file: str | None  # a mounted Secret; never logged
    redis_password_env: str | None
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_verify: TlsVerify
