"""The store backends, chosen in one place: each registers under the name `store.backend` takes, with the
parser of its own section of `store` and the function that builds it. The config package reads a backend's
section through its parser at load (extproc/config/runtime.py), and `build_store` (factory.py) builds the
one named at start; nothing else in the sidecar names a backend. What the sidecar asks of any store is the
port, extproc/core/ports.py (`LimiterStore`, with its `Mailbox` where replicas share the state).

Adding a backend: its store in this package (its client imported inside its builder, so deployments that do
not use it never load it), one `register` line below, and its name and section in the config schema
(extproc/config/schema.py `Store`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from extproc.core.clock import Clock
from extproc.core.ports import LimiterStore
from extproc.store.local import LocalStore
from extproc.store.settings import RedisSettings

S = TypeVar("S")


@dataclass(frozen=True)
class Backend(Generic[S]):
    """One backend: `settings` reads its section of `store` (a mapping of the parsed keys; empty where the
    schema has no section for it), `build` makes the store from those settings, and `shared` says whether
    replicas share its state: a shared store is wrapped in the local fallback unless the operator chose to
    fail closed (`store.on_unavailable: reject`, factory.py)."""

    settings: Callable[[Mapping[str, Any]], S]
    build: Callable[[S, Clock], LimiterStore]
    shared: bool


BACKENDS: dict[str, Backend[Any]] = {}
"""Every backend by its name in `store.backend`."""


def register(name: str, backend: Backend[Any]) -> None:
    """Make `name` a backend `store.backend` can choose (one line per backend, below)."""
    BACKENDS[name] = backend


def backend(name: str) -> Backend[Any]:
    found = BACKENDS.get(name)
    if found is None:
        raise ValueError(f"unknown store backend {name!r}, expected one of {sorted(BACKENDS)}")
    return found


def backend_settings(name: str, section: Mapping[str, Any]) -> object:
    """Backend `name`'s settings, from its section of `store`."""
    return backend(name).settings(section)


def _no_settings(_section: Mapping[str, Any]) -> None:
    return None


def _local(_settings: None, clock: Clock) -> LimiterStore:
    return LocalStore(clock=clock)


def _redis(settings: RedisSettings, clock: Clock) -> LimiterStore:
    from extproc.store.redis.build import redis_store  # only deployments that share state load the client

    return redis_store(settings)


register("local", Backend(settings=_no_settings, build=_local, shared=False))
register("redis", Backend(settings=RedisSettings.from_section, build=_redis, shared=True))
