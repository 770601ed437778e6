"""Waking waiters across replicas: a release on one replica pumps the queues of the others at once.

While any replica has requests queued, a release publishes on `<prefix>{limits}:wake`, and every replica
subscribed there pumps its queue instead of waiting for its next 100 ms tick. The subscription reconnects on
its own after Redis restarts or fails over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from extproc.core.ports import StoreUnavailable
from extproc.store.redis.breaker import RAW_CLIENT_ERRORS
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls

log = logging.getLogger("extproc.store.redis")

WAITING_ANNOUNCE_S = 2.0
WAITING_REFRESH_S = 0.5
"""A replica with queued requests announces it for this long, refreshed this often while they wait."""

WAKE_BACKOFF_S = (0.1, 2.0)
"""Reconnect delays of the wake-up subscription: first and largest."""


class Wake:
    """The wake-up callbacks, the waiting announcement and the subscription."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.callbacks: list[Callable[[], None]] = []
        self.closed = False
        self._announced_until = 0.0
        self.wakeups = 0
        """Wake-up messages received from releases (on any replica)."""

    def announce_waiting(self) -> None:
        """This replica has requests queued: make releases on every replica publish wake-ups. Throttled; no
        wait on the caller's side (runs in the background, failures are ignored: the 100 ms tick remains)."""
        now = time.monotonic()
        if now < self._announced_until - (WAITING_ANNOUNCE_S - WAITING_REFRESH_S):
            return
        self._announced_until = now + WAITING_ANNOUNCE_S
        self.calls.background.spawn(self.announce())

    async def announce(self) -> None:
        ms = str(math.ceil(WAITING_ANNOUNCE_S * 1000))
        with contextlib.suppress(StoreUnavailable):
            await self.calls.run(
                self.calls.scripts.waiting, lambda: [ms], (), BACKGROUND_TIMEOUT_S, fail_fast=False
            )

    def notify(self) -> None:
        for callback in self.callbacks:
            try:
                callback()
            except Exception:
                log.exception("redis store: wake-up callback failed")

    async def loop(self) -> None:
        """Subscribe to the wake-up channel, reconnecting with backoff (Redis restarted, failed over)."""
        delay = WAKE_BACKOFF_S[0]
        channel = self.calls.base + "wake"
        while not self.closed:
            pubsub = self.calls.client.pubsub()
            try:
                await pubsub.subscribe(channel)
                delay = WAKE_BACKOFF_S[0]
                self.notify()  # whatever was published while not subscribed is lost: look once now
                while not self.closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.wakeups += 1
                        self.notify()
            except RAW_CLIENT_ERRORS as exc:
                log.warning(
                    "redis store: wake-up subscription lost", extra={"error": f"{type(exc).__name__}"}
                )
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                        await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(WAKE_BACKOFF_S[1], delay * 2)
