"""Redis Cluster with in-transit encryption, the managed-cluster setup (e.g. a cloud Redis Cluster with TLS):
every node TLS only, the cluster bus and replication over TLS, the store configured through
`store.redis.mode: cluster` with a `rediss://` URL of one node and the CA that signed the nodes.

What must hold: the TLS options reach every node's connections (the client learns the other nodes from
CLUSTER SLOTS and must open TLS to each), wake-ups travel over TLS, and after the primary of the store's
slot is killed and its replica promoted, the store finds the new primary over TLS and nothing leaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.config import parse_config
from extproc.core.clock import monotonic
from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.core.ports import StoreUnavailable
from extproc.store.factory import build_store
from extproc.store.redis import RedisStore
from tests.component.store.certs import make_certificates
from tests.component.store.redis_cluster import RedisClusterNodes
from tests.support.waiting import until

LIMITS = {"global": LimitSpec(max_concurrency=2, tokens_per_minute=60_000)}


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisClusterNodes, Path]]:
    ca, cert, key = make_certificates(tmp_path_factory.mktemp("cluster-tls"))
    nodes = RedisClusterNodes(primaries=3, replicas=1, tls=(ca, cert, key))
    nodes.start()
    yield nodes, ca
    nodes.stop()


def config_store(url: str, ca: Path) -> RedisStore:
    """The store exactly as an operator configures it (ConfigMap keys through the factory)."""
    redis_section: dict[str, Any] = {
        "mode": "cluster",
        "url": url,
        "tls": {"ca_file": str(ca), "verify": "full"},
        "timeout_ms": 1000,
    }
    config = parse_config({"store": {"backend": "redis", "on_unavailable": "reject", "redis": redis_section}})
    store = build_store(config.store, monotonic)
    assert isinstance(store, RedisStore)
    return store


@pytest.fixture
async def stores(tls_cluster: tuple[RedisClusterNodes, Path]) -> AsyncIterator[list[RedisStore]]:
    nodes, ca = tls_cluster
    await asyncio.to_thread(nodes.wait_ok)
    await asyncio.to_thread(nodes.flush)
    pair = [config_store(nodes.url, ca) for _ in range(2)]
    for store in pair:
        await store.start()
        await store.apply_limits(LIMITS)
    yield pair
    for store in pair:
        await store.close()


def leases_left(nodes: RedisClusterNodes) -> int:
    with nodes.client(nodes.primary_of_store()) as c:
        return sum(int(c.zcard(k)) for k in c.keys("extproc:{limits}:l:*"))


async def test_two_replicas_share_limits_over_a_tls_cluster(
    stores: list[RedisStore], tls_cluster: tuple[RedisClusterNodes, Path]
) -> None:
    first, second = stores
    leases = [await first.acquire(["global"], 100), await second.acquire(["global"], 100)]
    assert all(isinstance(lease, Lease) for lease in leases)
    refused = await first.acquire(["global"], 100)
    assert isinstance(refused, Rejection)  # the other replica's lease counts: state is shared
    assert leases_left(tls_cluster[0]) == 2
    for store, lease in zip(stores, leases, strict=True):
        assert isinstance(lease, Lease)
        assert await store.release(lease, 50) is True
    assert leases_left(tls_cluster[0]) == 0


async def test_a_release_wakes_the_other_replica_over_tls(stores: list[RedisStore]) -> None:
    first, second = stores
    woken: list[int] = []
    second.on_wake(lambda: woken.append(1))
    await until(lambda: bool(woken), 5.0)  # the subscription's first look after connecting
    assert woken, "the subscriber never connected over TLS"
    woken.clear()
    before = second.wakeups
    await second.wake.announce()
    lease = await first.acquire(["global"], 0)
    assert isinstance(lease, Lease)
    await first.release(lease, 0)
    await until(lambda: second.wakeups > before, 5.0)
    assert second.wakeups > before


async def test_the_store_follows_a_failover_over_tls(
    stores: list[RedisStore], tls_cluster: tuple[RedisClusterNodes, Path]
) -> None:
    nodes, _ = tls_cluster
    store = stores[0]
    held = await store.acquire(["global"], 10)
    assert isinstance(held, Lease)
    killed = nodes.primary_of_store()
    nodes.kill(killed)
    await asyncio.to_thread(nodes.wait_ok)
    assert nodes.primary_of_store() != killed
    deadline = time.monotonic() + 20
    lease: Lease | Rejection | None = None
    while lease is None and time.monotonic() < deadline:
        try:
            lease = await store.acquire(["global"], 10)
        except StoreUnavailable:
            await asyncio.sleep(0.1)
    assert isinstance(lease, Lease), "the store did not reach the promoted primary over TLS"
    await store.release(lease, 0)
    await store.release(held, 0)  # replicated before the kill, or expired with its TTL: never negative
    assert leases_left(nodes) == 0
