"""How the Redis store connects: one Redis or a Redis Cluster, plain or TLS, with or without an ACL user.

Behaviour of the client that the store relies on (redis-py 8.1.0, the version pinned in pyproject.toml):

- Scripts: `AsyncScript.__call__` (redis/commands/core.py) sends EVALSHA and, on a NOSCRIPT reply, loads the
  script and sends EVALSHA once more. A NOSCRIPT reply means the script did not run, so that retry cannot take
  capacity twice. It is what happens after a Redis restart, and in a Cluster after a failover: the script
  cache is per node and not replicated, so the promoted replica does not have the scripts yet. In a Cluster
  `SCRIPT LOAD` goes to every primary (`PRIMARIES` in redis/cluster.py's command flags).
- Routing: `RedisCluster._determine_slot` (redis/asyncio/cluster.py) routes EVALSHA by its first key. The
  store's only key is the prefix with its `{limits}` hash tag, so every script runs on the primary of that
  one slot, where all of the store's keys live.
- Redirections: `RedisCluster._execute_command` follows MOVED (updates its slot cache) and ASK (sends ASKING
  to the target) and waits out TRYAGAIN, up to 16 redirections; a redirected command was not executed by the
  node that redirected it, so following it is safe. A connection error or timeout marks the topology for a
  refresh on the next command and is raised: the client's own retries are off (`Retry(NoBackoff(), 0)`),
  because a script retried after a lost reply could take capacity twice; the store decides what to do.
- TLS and ACL: `rediss://` selects TLS; `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs` and
  `ssl_check_hostname` are passed to every connection (of every node, in a Cluster). A username and password
  from the URL or from `username` / `password` authenticate every connection (`AUTH user pass`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from extproc.store.settings import RedisMode, TlsVerify

Client = aioredis.Redis | RedisCluster
Mode = RedisMode
Verify = TlsVerify

DEFAULT_MAX_CONNECTIONS = 32
"""Connections per replica (per node in a Cluster). The Python client tops out near 20k calls/s at 16-64 in
flight (perf.md 3.8); more connections only add server-side clients."""


@dataclass(frozen=True)
class TlsOptions:
    """TLS settings for `rediss://` URLs. `verify`: `full` checks the chain and the host name, `ca` the chain
    only (a managed Redis whose certificate names another host), `none` nothing (tests only)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: Verify = "full"

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "ssl_ca_certs": self.ca_file,
            "ssl_certfile": self.cert_file,
            "ssl_keyfile": self.key_file,
            "ssl_cert_reqs": "none" if self.verify == "none" else "required",
            "ssl_check_hostname": self.verify == "full",
        }


@dataclass(frozen=True)
class Credentials:
    """Where the ACL user and password come from; None: from the URL, if it names them."""

    username: str | None = None
    password_file: str | None = None
    password_env: str | None = None

    def resolve(self) -> dict[str, str]:
        """The `username` / `password` client arguments (read now: a mounted Secret or the environment)."""
        out: dict[str, str] = {}
        if self.username is not None:
            out["username"] = self.username
        if self.password_file is not None:
            out["password"] = Path(self.password_file).read_text().rstrip("\r\n")
        elif self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ValueError(f"environment variable {self.password_env} is not set")
            out["password"] = value
        return out


def connect(
    url: str,
    *,
    mode: Mode = "standalone",
    timeout_s: float,
    socket_timeout_s: float,
    tls: TlsOptions | None = None,
    credentials: Credentials | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Client:
    """A client for `url` (`redis://`, `rediss://`, `unix://`; in cluster mode any node's address).

    Requests beyond `max_connections` in flight wait for a connection (within the caller's timeout) rather
    than failing: a burst of admissions must queue, not turn into errors.
    """
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": timeout_s,
        "socket_timeout": socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "client_name": "extproc",
        **(credentials.resolve() if credentials else {}),
    }
    if tls is not None and url.startswith("rediss://"):
        common.update(tls.client_kwargs())
    if mode == "cluster":
        # The cluster client raises MaxConnectionsError instead of waiting for a free connection: the store
        # bounds its calls in flight to `max_connections` itself, and the margin covers the wake-up
        # subscription, which borrows a connection of a node's pool.
        return RedisCluster.from_url(url, max_connections=max_connections + 8, **common)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, **common
    )
    return aioredis.Redis(connection_pool=pool)
