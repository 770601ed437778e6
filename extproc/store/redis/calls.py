"""Every Redis call of the store: the registered scripts, the bound on calls in flight, the replies that ask
for a retry, and the background tasks calls leave behind.

A script call sends the KEYSPEC of the caller's keys (see `scripts`). Scripts refuse to decide at a scale
other than the stored one (`stale`), and ACQUIRE refuses while the stored state is not the one this replica
counted its leases in (`epoch`, `recovering`); `Calls.run` adopts what such a reply brings and sends again,
or raises, all within the caller's bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from extproc.store.redis.breaker import (
    CLIENT_ERRORS,
    RAW_CLIENT_ERRORS,
    Breaker,
    RedisUnavailable,
    RedisUnsafe,
)
from extproc.store.redis.connection import Client
from extproc.store.redis.scripts import (
    ACQUIRE,
    FORGET,
    GUARD,
    KV_POOL,
    PEEK,
    REFUND,
    RELEASE,
    RELEASE_SLOT,
    RENEW,
    RUNS_POOL,
    SCALE,
    WAITING,
)

log = logging.getLogger("extproc.store.redis")

BACKGROUND_TIMEOUT_S = 1.0
"""Bound on renewals, cache refreshes and release retries: off the request path, so they may wait longer."""

BACKGROUND_SHARE = 4
"""Background calls (release retries, forgets, scale proposals, state checks, background cache reads, wake
announcements) hold at most 1/BACKGROUND_SHARE of the connections (at least one): after a failover thousands
of them may be due at once, and a request, bounded by `timeout_s`, must find connections they cannot take.
Lease renewals are a few calls per interval and keep the leases counted: they take the requests' lane."""

STALE_RETRIES = 3
"""Calls refused because the effective scale changed meanwhile are sent again this often (each refusal
brings the new scale, so one retry normally suffices)."""

ScalesAdopted = Callable[[Sequence[str], Sequence[float]], None]
EpochSeen = Callable[[str, float], bool]
"""Told the stored epoch id and the recovery time left; True while this replica's leases are not counted."""


class Background:
    """Tasks started off the request path (retries, proposals, recoveries), cancelled together at close."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self.tasks)


class Handed:
    """Whether a call got as far as the client (it may then have run in Redis, whatever the reply)."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


class Scripts:
    """The store's Lua scripts, registered on one client (loaded again by redis-py on NOSCRIPT)."""

    def __init__(self, client: Client) -> None:
        self.acquire = client.register_script(ACQUIRE)
        self.release = client.register_script(RELEASE)
        self.release_slot = client.register_script(RELEASE_SLOT)
        self.peek = client.register_script(PEEK)
        self.renew = client.register_script(RENEW)
        self.forget = client.register_script(FORGET)
        self.refund = client.register_script(REFUND)
        self.scale = client.register_script(SCALE)
        self.waiting = client.register_script(WAITING)
        self.guard = client.register_script(GUARD)
        self.kv_pool = client.register_script(KV_POOL)
        self.runs_pool = client.register_script(RUNS_POOL)

    @property
    def all(self) -> tuple[AsyncScript, ...]:
        return (
            self.acquire,
            self.release,
            self.release_slot,
            self.peek,
            self.renew,
            self.forget,
            self.refund,
            self.scale,
            self.waiting,
            self.guard,
            self.kv_pool,
            self.runs_pool,
        )


class Calls:
    """Script calls on one client, bounded in number and time, with the breaker and the retry replies."""

    def __init__(
        self, client: Client, base: str, max_in_flight: int, breaker: Breaker, background: Background
    ) -> None:
        self.client = client
        self.base = base
        self.scripts = Scripts(client)
        self.breaker = breaker
        self.background = background
        self.replica = secrets.randbits(30)
        """This replica's id in Redis: the high bits of its lease ids and the field of its scale proposals."""
        self._slots = asyncio.Semaphore(max_in_flight)
        self._background_slots = asyncio.Semaphore(max(1, max_in_flight // BACKGROUND_SHARE))
        self._topology_task: asyncio.Task[Any] | None = None
        self.closed = False
        """Set by the store's close: background loops end at their next turn even if a cancellation was
        swallowed (taken for a timeout) inside the client."""
        self.judged: list[float] = []
        """The scales of the keys of the last call answered (what its script judged at)."""
        self.stale_retries = 0
        """Calls sent again because the effective scale had changed."""
        self.on_stale: ScalesAdopted = lambda keys, scales: None
        self.on_epoch: EpochSeen = lambda epoch_id, left: False
        self.on_reconnect: Callable[[], None] = lambda: None
        self.scale_of: Callable[[str], float] = lambda key: 1.0

    async def load(self) -> None:
        """Load every script now (raises a client error when Redis does not answer)."""
        async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
            for script in self.scripts.all:
                script.sha = await self.client.script_load(script.script)

    async def run(
        self,
        script: AsyncScript,
        args: Callable[[], list[str]],
        keys: Sequence[str],
        limit_s: float,
        fail_fast: bool = True,
    ) -> Any:
        """A script call whose KEYSPEC (built by `args`) must match the stored scales: on a `stale` reply the
        stored scales are adopted and the call is sent again, all within `limit_s`.

        `self.judged` is set to the scales of `keys` in the call that was answered (what the script judged
        at), for the caller to rebuild its views with before anything else runs on the loop.

        A call with `fail_fast` is on a request's path; one without is background work: it is sent even
        while the breaker fails fast, and waits for one of the background lane's connections before its
        bound starts (a backlog is queueing, not Redis failing).
        """
        if fail_fast:
            self.breaker.check()
            return await self._bounded(script, args, keys, limit_s)
        async with self._background_slots:
            return await self._bounded(script, args, keys, limit_s)

    async def _bounded(
        self, script: AsyncScript, args: Callable[[], list[str]], keys: Sequence[str], limit_s: float
    ) -> Any:
        handed = Handed()
        try:
            async with asyncio.timeout(limit_s):
                raw, sent = await self._send(script, args, keys, handed)
        except CLIENT_ERRORS as exc:
            if not handed.sent:
                # The bound ran out while the call waited for a connection: nothing reached Redis, so
                # this says nothing against it (calls that hang there trip the breaker themselves).
                raise RedisUnavailable("redis: no connection free within the bound", sent=False) from exc
            self.breaker.failed(exc)
            self._refresh_topology()
            raise RedisUnavailable(f"redis: {self.breaker.last_error}") from exc
        if self.breaker.succeeded():
            self.on_reconnect()  # answering again: possibly another server, another policy
        self.judged = sent
        return raw

    async def _send(
        self, script: AsyncScript, args: Callable[[], list[str]], keys: Sequence[str], handed: Handed
    ) -> tuple[Any, list[float]]:
        for _ in range(STALE_RETRIES + 1):
            sent = [self.scale_of(k) for k in keys]
            raw = await self.call(script, args(), handed)
            if not isinstance(raw, list) or not raw or raw[0] not in ("stale", "epoch", "recovering"):
                return raw, sent
            if raw[0] == "stale":
                self.stale_retries += 1
                self.on_stale(keys, [float(v) for v in raw[1:]])
            elif raw[0] == "epoch":
                if self.on_epoch(str(raw[1]), float(raw[2])) or float(raw[2]) > 0:
                    raise RedisUnsafe("redis lost its state: leases being re-asserted")
            else:
                raise RedisUnsafe(f"redis lost its state: leases being re-asserted for {raw[1]} s")
        raise RedisUnavailable("redis: the effective scale kept changing")

    async def call(self, script: AsyncScript, args: list[str], handed: Handed | None = None) -> Any:
        """One script call, once one of the connections is free."""
        async with self._slots:
            if handed is not None:
                handed.sent = True
            try:
                return await script(keys=[self.base], args=args)
            except AttributeError as exc:  # see RAW_CLIENT_ERRORS
                raise RedisConnectionError(f"connection lost: {exc}") from exc

    def _refresh_topology(self) -> None:
        """Cluster only: look up the slot owners again in the background, with the background bound.

        After a failover the client must learn the new primary (`RedisCluster.initialize`). Done inside a
        request, that lookup shares the request's `timeout_s` and is cancelled before it completes whenever
        a node is slow to refuse; in the background it has `BACKGROUND_TIMEOUT_S`, and requests that wait
        on the client's initialization lock then find the new layout.
        """
        client = self.client
        if not isinstance(client, RedisCluster) or self._topology_task is not None:
            return

        async def refresh() -> None:
            try:
                async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                    await client.initialize()
            except (*RAW_CLIENT_ERRORS, RedisClusterException) as exc:
                log.info("redis store: cluster layout not refreshed yet", extra={"error": type(exc).__name__})
            finally:
                self._topology_task = None

        self._topology_task = self.background.spawn(refresh())

    async def close(self) -> None:
        """Close the client's connections, waiting at most `BACKGROUND_TIMEOUT_S` (a close that holds on to
        its cancellation is left behind rather than hanging the shutdown)."""
        self.closed = True
        task = self.background.spawn(self._aclose())
        await asyncio.wait({task}, timeout=BACKGROUND_TIMEOUT_S)

    async def _aclose(self) -> None:
        with contextlib.suppress(*RAW_CLIENT_ERRORS):
            await self.client.aclose()
