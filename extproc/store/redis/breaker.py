"""What a failing Redis looks like to the store, the exceptions it raises, and the circuit breaker.

Failures never hang a request: every call is bounded and raises `StoreUnavailable`. After `BREAKER_FAILURES`
consecutive failures calls fail fast for `BREAKER_OPEN_S`, then probe again.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import ClusterDownError, ReadOnlyError, RedisError, ResponseError, TryAgainError

from extproc.core.ports import StoreUnavailable

log = logging.getLogger("extproc.store.redis")

BREAKER_FAILURES = 3
BREAKER_OPEN_S = 0.5
"""After this many consecutive failures, calls fail fast for this long instead of each waiting `timeout_s`."""

CLIENT_ERRORS = (RedisError, OSError, TimeoutError)
"""What a failing Redis surfaces as."""

RAW_CLIENT_ERRORS = (*CLIENT_ERRORS, AttributeError)
"""Around direct uses of the client. AttributeError: redis-py 8.1.0's connection can lose its stream writer to
a concurrent disconnect (`'NoneType' object has no attribute 'writelines'` in `redis/asyncio/connection.py`
`send_packed_command`), seen when a Cluster primary is killed under load. Script calls go through
`Calls.call`, which turns it into a ConnectionError, so that our own AttributeErrors elsewhere are not taken
for one."""

TRANSIENT_REFUSALS = (ClusterDownError, TryAgainError, ReadOnlyError)
"""Replies that a failover produces: unavailability, not a script or a proxy refusing scripts."""


class RedisUnavailable(StoreUnavailable):
    """Redis did not answer within the timeout (down, unreachable, paused, or refusing scripts).

    Raised by `acquire` and `status` as the port's `StoreUnavailable`; the admission path decides what a
    request gets then (fail closed with a 503, or a local fallback). Nothing was admitted: a lease the script
    may still have granted is removed in the background, or expires after the lease TTL.

    `sent` is False when no script was handed to the client (failing fast, or the bound ran out while the
    call waited for a free connection): nothing can have run, so there is nothing to take back.
    """

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class RedisUnsafe(RedisUnavailable):
    """Redis answers, but admitting through it now could exceed the limits: it lost its state and the
    replicas are re-asserting their leases, or its `maxmemory-policy` may evict limiter keys. The script
    admitted nothing."""


class Breaker:
    """Consecutive failures, and the fail-fast window they open."""

    def __init__(self) -> None:
        self.failures = 0
        self.fail_fast_until = 0.0
        self.last_error: str | None = None

    @property
    def closed(self) -> bool:
        """True while calls may be tried (not failing fast)."""
        return time.monotonic() >= self.fail_fast_until

    def check(self) -> None:
        """Raise at once while failing fast."""
        if not self.closed:
            raise RedisUnavailable(f"redis unavailable (failing fast): {self.last_error}", sent=False)

    def failed(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.failures += 1
        if self.failures >= BREAKER_FAILURES:
            self.fail_fast_until = time.monotonic() + BREAKER_OPEN_S
        if isinstance(exc, ResponseError) and not isinstance(exc, TRANSIENT_REFUSALS):
            # a script error or a proxy refusing scripts: never silent
            log.error("redis store: command refused", extra={"error": self.last_error})

    def succeeded(self) -> bool:
        """Close the breaker; True when calls had been failing (Redis answers again)."""
        was_failing = self.failures > 0
        self.failures = 0
        self.fail_fast_until = 0.0
        return was_failing
