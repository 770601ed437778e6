"""Builds the limiter store the `store` settings ask for (read once at start), by the backend registered
under its name (backends.py)."""

from __future__ import annotations

from extproc.core.clock import Clock
from extproc.core.ports import LimiterStore
from extproc.store.backends import backend
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore
from extproc.store.settings import StoreSettings


def build_store(settings: StoreSettings, clock: Clock) -> LimiterStore:
    """The backend's store; one shared by replicas is wrapped with a local fallback unless the operator chose
    to fail closed (`on_unavailable: reject`)."""
    chosen = backend(settings.backend)
    store = chosen.build(settings.options, clock)
    if not chosen.shared or settings.on_unavailable == "reject":
        return store
    return FallbackStore(store, LocalStore(clock=clock), settings.fallback_share)
