"""Messages between the replicas that share one Redis: each replica subscribes to its own channel,
`<key_prefix>reports:<name>`, and any replica publishes to another's by its name (the `Mailbox` a shared
store offers through the port, extproc/core/ports.py). What the messages mean is the caller's business: the
lean profile's end reports relayed to the replica that admitted their request (extproc/protocol/relay.py).

Pub/sub delivers at most once, to whoever is subscribed at that moment: a message published while its
receiver is not subscribed (restarting, Redis unreachable) is lost. Publishing never waits on the caller's
side, and the publishes in flight are bounded: more are dropped and counted rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from extproc.store.redis.breaker import RAW_CLIENT_ERRORS
from extproc.store.redis.connection import Client

log = logging.getLogger("extproc.store.redis")

RECONNECT_BACKOFF_S = (0.1, 2.0)
"""First and longest wait before subscribing again after the subscription broke."""
PUBLISH_TIMEOUT_S = 1.0
"""A publish that takes longer is given up (the message is lost)."""
SUBSCRIBE_WAIT_S = 2.0
"""How long start() waits for the first subscription: messages published before it are lost, so a replica
subscribes before it reports ready (Redis down: it starts anyway and keeps trying)."""
LOG_EVERY = 1000
"""While publishing fails, one warning for the first lost message and then one per this many."""
MAX_IN_FLIGHT = 1024
"""Publishes waiting on Redis at once; more are dropped and counted rather than queued without bound."""


class RedisMailbox:
    """This replica's channel on the shared Redis, and publishing to the other replicas' channels."""

    def __init__(self, client: Client, key_prefix: str, own: str) -> None:
        self.client = client
        self.channel_prefix = f"{key_prefix}reports:"
        self.own = own
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.published = 0
        self.dropped = 0

    def channel(self, name: str) -> str:
        return self.channel_prefix + name

    async def start(self, deliver: Callable[[bytes], None]) -> None:
        """Subscribe to this replica's channel, handing each message to `deliver`; returns once subscribed
        (or after `SUBSCRIBE_WAIT_S`, Redis unreachable: it keeps trying)."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._subscribe_loop(deliver), name="report-relay")
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

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, to: str, payload: bytes) -> None:
        """Publish `payload` on replica `to`'s channel in the background (dropped and counted when too many
        publishes wait already)."""
        if len(self._publishing) >= MAX_IN_FLIGHT:
            self.dropped += 1
            return
        # Base64: the store's client decodes every reply as UTF-8 (redis_connect), subscriptions included.
        text = base64.b64encode(payload).decode("ascii")
        task = asyncio.get_running_loop().create_task(self._publish(to, text))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, to: str, text: str) -> None:
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                await self.client.publish(self.channel(to), text)
            self.published += 1
        except RAW_CLIENT_ERRORS as exc:
            self.dropped += 1  # the message is lost
            if self.dropped == 1 or self.dropped % LOG_EVERY == 0:  # Redis down: not one line per request
                log.warning(
                    "report relay: publish failed",
                    extra={"error": type(exc).__name__, "dropped": self.dropped},
                )

    @staticmethod
    def _received(text: object, deliver: Callable[[bytes], None]) -> None:
        try:
            payload = base64.b64decode(str(text), validate=True)
        except (binascii.Error, ValueError):
            log.warning("report relay: undecodable entry ignored")
            return
        deliver(payload)

    async def _subscribe_loop(self, deliver: Callable[[bytes], None]) -> None:
        """Subscribe to this replica's channel, again with backoff whenever the subscription breaks."""
        delay = RECONNECT_BACKOFF_S[0]
        while not self._closed:
            pubsub: Any = self.client.pubsub()  # redis-py types the cluster's and the standalone's apart
            try:
                await pubsub.subscribe(self.channel(self.own))
                await pubsub.get_message(timeout=1.0)  # the subscribe confirmation: now on the channel
                self._subscribed.set()
                delay = RECONNECT_BACKOFF_S[0]
                while not self._closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._received(message["data"], deliver)
            except RAW_CLIENT_ERRORS as exc:
                log.warning("report relay: subscription lost", extra={"error": type(exc).__name__})
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(RECONNECT_BACKOFF_S[1], delay * 2)
