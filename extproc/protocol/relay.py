"""End reports between replicas: an access-log entry that reached a replica which did not admit its request is
handed to the one that did, through Redis pub/sub.

Where the sidecar runs as its own Deployment behind a Service (Envoy Gateway, docs/gateways.md), Envoy's
ext_proc stream and its gRPC access-log stream are two separate connections to that Service, balanced on
their own: the entry that ends a request often reaches another replica than the one holding its lease. The
lease lives in the admitting replica's memory (the reservation, the reading spec, the decode pace), so only
that replica can settle it exactly. Every report key starts with the admitting replica's prefix
(UnseenStreams.expect_report: `<prefix>-<counter>`), so the receiving replica publishes the serialized
entry on the owner's channel, `<store.key_prefix>reports:<prefix>`, and the owner settles it as if Envoy had
sent it there.

Pub/sub delivers at most once, to whoever is subscribed at that moment: an entry published while the owner
is not subscribed (restarting, Redis unreachable) is lost, and the lease expires by the lean profile's rule
(`admission.end_report_wait_seconds`), as for any lost report. Anyone who can publish on the shared Redis can
forge a report; that is the same trust as the limiter state kept there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf.message import DecodeError

from extproc.store.redis.breaker import RAW_CLIENT_ERRORS

log = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = (0.1, 2.0)
"""First and longest wait before subscribing again after the subscription broke."""
PUBLISH_TIMEOUT_S = 1.0
"""A publish that takes longer is given up (the lease then expires by the rule)."""
SUBSCRIBE_WAIT_S = 2.0
"""How long start() waits for the first subscription: entries for this replica published before it are lost,
so the sidecar subscribes before it reports ready (Redis down: it starts anyway and keeps trying)."""
LOG_EVERY = 1000
"""While publishing fails, one warning for the first lost entry and then one per this many."""
MAX_IN_FLIGHT = 1024
"""Publishes waiting on Redis at once; more are dropped and counted rather than queued without bound."""

Deliver = Callable[[accesslog_pb2.HTTPAccessLogEntry], None]


def shared_client(store: object) -> Any | None:
    """The Redis client of a shared store (behind its local fallback, if any); None for in-process state,
    where every report reaches the one replica there is."""
    from extproc.store.fallback import FallbackStore
    from extproc.store.redis import RedisStore

    if isinstance(store, FallbackStore):
        store = store.primary
    return store.client if isinstance(store, RedisStore) else None


class ReportRelay:
    """Publishes foreign entries to their owners and delivers this replica's own to `deliver`."""

    def __init__(self, client: Any, key_prefix: str, own_prefix: str, deliver: Deliver) -> None:
        self.client = client
        self.channel_prefix = f"{key_prefix}reports:"
        self.own_prefix = own_prefix
        self.deliver = deliver
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.published = 0
        self.dropped = 0
        self.received = 0

    def channel(self, prefix: str) -> str:
        return self.channel_prefix + prefix

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._subscribe_loop(), name="report-relay")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                await self._subscribed.wait()

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._task, *self._publishing) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=PUBLISH_TIMEOUT_S * 2)

    def forward(self, key: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> bool:
        """Hand an entry whose key this replica does not hold to the replica that issued it. False when the
        key is this replica's own (settled already) or names no replica: the entry is then unknown."""
        owner, sep, _ = key.partition("-")
        if not sep or not owner or owner == self.own_prefix or self._closed:
            return False
        if len(self._publishing) >= MAX_IN_FLIGHT:
            self.dropped += 1
            return True
        # Base64: the store's client decodes every reply as UTF-8 (redis_connect), subscriptions included.
        payload = base64.b64encode(entry.SerializeToString()).decode("ascii")
        task = asyncio.get_running_loop().create_task(self._publish(owner, payload))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
        return True

    async def _publish(self, owner: str, payload: str) -> None:
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                await self.client.publish(self.channel(owner), payload)
            self.published += 1
        except RAW_CLIENT_ERRORS as exc:
            self.dropped += 1  # the entry is lost: the owner's lease expires by the rule
            if self.dropped == 1 or self.dropped % LOG_EVERY == 0:  # Redis down: not one line per request
                log.warning(
                    "report relay: publish failed",
                    extra={"error": type(exc).__name__, "dropped": self.dropped},
                )

    def _received(self, payload: object) -> None:
        entry = accesslog_pb2.HTTPAccessLogEntry()
        try:
            entry.ParseFromString(base64.b64decode(str(payload), validate=True))
        except (binascii.Error, ValueError, DecodeError):
            log.warning("report relay: undecodable entry ignored")
            return
        self.received += 1
        self.deliver(entry)

    async def _subscribe_loop(self) -> None:
        """Subscribe to this replica's channel, again with backoff whenever the subscription breaks."""
        delay = RECONNECT_BACKOFF_S[0]
        while not self._closed:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.channel(self.own_prefix))
                await pubsub.get_message(timeout=1.0)  # the subscribe confirmation: now on the channel
                self._subscribed.set()
                delay = RECONNECT_BACKOFF_S[0]
                while not self._closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._received(message["data"])
            except RAW_CLIENT_ERRORS as exc:
                log.warning("report relay: subscription lost", extra={"error": type(exc).__name__})
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(RECONNECT_BACKOFF_S[1], delay * 2)
