"""A store backend is its store in the store package, one registration line and its section of the config
schema: a test double registered the way `local` and `redis` are (extproc/store/backends.py) is built by the
factory, wrapped in the local fallback as a store replicas share, and carries the lean profile's end reports
between two sidecars through the mailbox it offers on the port, with no other line of the sidecar naming it.
(The schema part, its name and section in `Store`, is the one thing the double cannot show: YAML does not
choose it, so the tests hand the factory its settings.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.app import Sidecar
from extproc.config.runtime import Config
from extproc.core.clock import Clock, FakeClock
from extproc.core.ports import LimiterStore
from extproc.store.backends import BACKENDS, Backend, backend_settings, register
from extproc.store.factory import build_store
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore
from extproc.store.settings import StoreSettings

HUBS: dict[str, dict[str, Callable[[bytes], None]]] = {}
"""In-memory stand-ins for a shared server: each replica's delivery by its name, per hub."""


class DoubleMailbox:
    """Messages between the replicas on one hub, delivered on the event loop as a server's would be."""

    def __init__(self, hub: dict[str, Callable[[bytes], None]], own: str) -> None:
        self.hub = hub
        self.own = own
        self.published = 0
        self.dropped = 0
        self.closed = False

    async def start(self, deliver: Callable[[bytes], None]) -> None:
        self.hub[self.own] = deliver

    def send(self, to: str, payload: bytes) -> None:
        receiver = self.hub.get(to)
        if receiver is None:
            self.dropped += 1
            return
        self.published += 1
        asyncio.get_running_loop().call_soon(receiver, payload)

    async def close(self) -> None:
        self.closed = True
        self.hub.pop(self.own, None)


class DoubleStore(LocalStore):
    """In-process limits, as if shared: what makes it a backend here is its mailbox."""

    def __init__(self, hub: dict[str, Callable[[bytes], None]], clock: Clock) -> None:
        super().__init__(clock=clock)
        self.hub = hub

    def mailbox(self, own: str) -> DoubleMailbox:
        return DoubleMailbox(self.hub, own)


@dataclass(frozen=True)
class DoubleSettings:
    hub: str


def double_settings(section: Mapping[str, Any]) -> DoubleSettings:
    return DoubleSettings(hub=str(section.get("hub", "default")))


def double_store(settings: DoubleSettings, clock: Clock) -> LimiterStore:
    return DoubleStore(HUBS.setdefault(settings.hub, {}), clock)


@pytest.fixture
def double() -> Iterator[str]:
    register("double", Backend(settings=double_settings, build=double_store, shared=True))
    yield "double"
    del BACKENDS["double"]
    HUBS.clear()


def settings(name: str, on_unavailable: str = "local") -> StoreSettings:
    return StoreSettings(
        backend=name,
        options=backend_settings(name, {"hub": "one"}),
        on_unavailable="reject" if on_unavailable == "reject" else "local",
        fallback_share=0.5,
    )


def test_the_factory_builds_a_registered_backend_as_it_builds_redis(double: str) -> None:
    wrapped = build_store(settings(double), FakeClock())
    assert isinstance(wrapped, FallbackStore) and isinstance(wrapped.primary, DoubleStore)
    assert isinstance(build_store(settings(double, "reject"), FakeClock()), DoubleStore)


def test_an_unregistered_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown store backend 'double'"):
        backend_settings("double", {})


def entry_for(key: str) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.common_properties.metadata.filter_metadata["extproc"].fields["id"].string_value = key
    return entry


async def test_the_sidecar_relays_end_reports_through_the_backends_mailbox(double: str) -> None:
    """Two sidecars on one double: an entry for a lease A issued that reached B goes to A, through nothing
    but the port (the sidecar picks the relay up from `LimiterStore.mailbox`)."""
    a, b = (Sidecar(config=replace(Config(), store=settings(double))) for _ in range(2))
    try:
        for sidecar in (a, b):
            await sidecar._start_relay()
            assert sidecar.relay is not None
        assert b.end_reports.relay is not None
        assert b.end_reports.relay.forward(f"{a.unseen.report_prefix}-7", entry_for("x"))
        await asyncio.sleep(0)  # the double delivers on the next turn of the loop, as a server would
        assert a.relay is not None and a.relay.received == 1
        assert b.relay is not None and b.relay.published == 1
    finally:
        for sidecar in (a, b):
            await sidecar.stop(grace_s=0)


def test_the_in_process_backend_offers_no_mailbox() -> None:
    assert build_store(settings("local"), FakeClock()).mailbox("me") is None
