"""What the store factory takes: `StoreSettings`, built from the config's `store` section at load.

The store package defines it, so it depends on no config class; the config package converts `store` into it
(extproc/config/runtime.py) and holds the defaults. What is common to every backend is here; what belongs to
one backend is its own settings type, read from its own section of `store` (`store.redis` for Redis:
`RedisSettings`) by the parser the backend registers (extproc/store/backends.py). Read at start only:
switching stores orphans leases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

OnUnavailable = Literal["local", "reject"]  # fall back to this replica's own limits, or refuse (fail closed)
RedisMode = Literal["standalone", "cluster"]
TlsVerify = Literal["full", "ca", "none"]


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """`store`: the backend by its registered name, its own settings (`options`, of the type its parser
    returns), and what to do when a store shared by replicas cannot be reached."""

    backend: str
    options: object
    on_unavailable: OnUnavailable = "local"
    fallback_share: float = 1.0


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """`store.redis`: how to reach the shared Redis (one Redis or a Cluster) and how long its leases live."""

    url: str
    key_prefix: str
    lease_ttl_seconds: float
    timeout_ms: float
    mode: RedisMode
    username: str | None
    password_file: str | None  # a mounted Secret; never logged
    password_env: str | None
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_verify: TlsVerify

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> RedisSettings:
        """The parsed `store.redis` section (every key present, the config's defaults filled in), its `tls`
        subsection flattened."""
        tls = section["tls"]
        return cls(
            url=section["url"],
            key_prefix=section["key_prefix"],
            lease_ttl_seconds=section["lease_ttl_seconds"],
            timeout_ms=section["timeout_ms"],
            mode=section["mode"],
            username=section["username"],
            password_file=section["password_file"],
            password_env=section["password_env"],
            tls_ca_file=tls["ca_file"],
            tls_cert_file=tls["cert_file"],
            tls_key_file=tls["key_file"],
            tls_verify=tls["verify"],
        )
