"""ReportRelay on a real Redis: an entry handed over by one replica reaches the replica named by its key's
prefix, and only that one; what is not another replica's is not relayed; a bad payload is ignored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.protocol.relay import ReportRelay
from extproc.store.redis import RedisStore


def entry(path: str) -> accesslog_pb2.HTTPAccessLogEntry:
    found = accesslog_pb2.HTTPAccessLogEntry()
    found.request.path = path
    return found


class Replica:
    def __init__(self, url: str, prefix: str) -> None:
        self.store = RedisStore.from_url(url, timeout_s=1.0)
        self.got: list[accesslog_pb2.HTTPAccessLogEntry] = []
        self.arrived = asyncio.Event()
        self.relay = ReportRelay(self.store.mailbox(prefix), prefix, self.deliver)

    def deliver(self, found: accesslog_pb2.HTTPAccessLogEntry) -> None:
        self.got.append(found)
        self.arrived.set()

    async def arrival(self) -> None:
        async with asyncio.timeout(2.0):
            await self.arrived.wait()

    async def close(self) -> None:
        await self.relay.close()
        await self.store.close()


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[dict[str, Replica]]:
    found = {prefix: Replica(redis_url, prefix) for prefix in ("aaaa0001", "bbbb0002", "cccc0003")}
    for replica in found.values():
        await replica.relay.start()
    yield found
    for replica in found.values():
        await replica.close()


async def test_an_entry_reaches_the_replica_its_key_names_and_no_other(replicas: dict[str, Replica]) -> None:
    a, b, c = replicas.values()
    assert b.relay.forward("aaaa0001-7", entry("/v1/chat/completions"))
    await a.arrival()
    assert [e.request.path for e in a.got] == ["/v1/chat/completions"]
    await asyncio.sleep(0.1)
    assert not b.got and not c.got
    assert b.relay.published == 1 and a.relay.received == 1


@pytest.mark.parametrize("key", ["bbbb0002-3", "-3", "plain"])
async def test_what_is_not_another_replicas_is_not_relayed(replicas: dict[str, Replica], key: str) -> None:
    """The receiver's own key (settled already) or a key naming no replica: the caller counts it unknown."""
    b = replicas["bbbb0002"]
    assert not b.relay.forward(key, entry("/x"))
    await asyncio.sleep(0.05)
    assert b.relay.published == 0


async def test_an_undecodable_payload_is_ignored_and_the_subscription_stays(
    replicas: dict[str, Replica],
) -> None:
    a, b, _ = replicas.values()
    await b.store.client.publish(b.store.mailbox("bbbb0002").channel("aaaa0001"), "not base64 !")
    assert b.relay.forward("aaaa0001-1", entry("/after"))
    await a.arrival()
    assert [e.request.path for e in a.got] == ["/after"]
