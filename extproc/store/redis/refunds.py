"""Parts of an open lease given back before its release: some of its reservation (bound admission: the exact
prompt count came in under the byte bound the request was admitted on; extproc/admission/deciding/
provisional.py), or its slots (the engine finished the request while its client still reads the answer:
extproc/admission/tracking/inflight.py)."""

from __future__ import annotations

import asyncio

from extproc.core.limiter.limiter import Lease
from extproc.core.limiter.split import key_tokens
from extproc.core.ports import StoreUnavailable
from extproc.store.redis.breaker import RedisUnavailable
from extproc.store.redis.calls import Calls
from extproc.store.redis.keyspace import Keyspace
from extproc.store.redis.views import Views


async def refund(calls: Calls, keyspace: Keyspace, lease: Lease, tokens: int, timeout_s: float) -> bool:
    """Give `tokens` prompt tokens of an open lease's reservation back to its buckets now (each key its part:
    extproc/core/limiter/split.py `key_tokens`), in one script call.

    False when the lease is settled, or found removed or expired in Redis. When Redis does not answer the
    refund may or may not have run: the lease is then taken as refunded (its release refunds that much
    less), so a lost reply or a cancellation can under-refund a bucket until it refills, never refund it
    twice. A refund never sent (failing fast, or no connection free within the bound) leaves the
    reservation as it was, for the release to refund.
    """
    tokens = max(0, min(tokens, lease.reserved_tokens - lease.reserved_output))
    if lease.settled or not lease.placements or tokens == 0:
        return False
    head = [str(lease.lease_id)]
    tail: list[str] = []
    for placement in lease.placements:  # prompt tokens: the total and input buckets, not the output ones
        tail += [placement.slot, placement.tokens or "", str(key_tokens(placement.key, tokens, 0))]
    try:
        raw = await calls.run(
            calls.scripts.refund, lambda: [*head, *keyspace.keyspec(lease.keys), *tail], lease.keys, timeout_s
        )
    except RedisUnavailable as exc:
        if exc.sent:  # it may have run: never refund twice
            lease.reserved_tokens -= tokens
        return False
    except asyncio.CancelledError:
        lease.reserved_tokens -= tokens  # it may have run, as above
        raise
    if not int(raw[0]):
        return False
    lease.reserved_tokens -= tokens
    return True


async def release_slot(
    calls: Calls, keyspace: Keyspace, views: Views, lease: Lease, timeout_s: float, key_ttl_ms: int
) -> bool:
    """Give back the lease's slots in one script call, its tokens waiting for the release (`P u` in
    `scripts`). False when it was settled or gave its slots back before, was found expired, or Redis did not
    answer: the slots then stay held until the release, the safe side, and no retry is owed. A call whose
    reply was lost may still have run: the renewal then finds the lease in `P u` and keeps it there, and the
    release settles it either way."""
    if lease.settled or lease.slot_released or not lease.placements:
        return False
    head = [str(lease.lease_id), repr(lease.acquired_at), str(key_ttl_ms)]
    slots = [placement.slot for placement in lease.placements]
    try:
        raw = await calls.run(
            calls.scripts.release_slot,
            lambda: [*head, *keyspace.keyspec(lease.keys), *slots],
            lease.keys,
            timeout_s,
        )
    except StoreUnavailable:
        return False
    views.parse(lease.keys, raw[2:], float(raw[1]), with_places=False)
    moved = bool(int(raw[0]))
    if moved and not lease.settled:
        lease.slot_released = True
    return moved
