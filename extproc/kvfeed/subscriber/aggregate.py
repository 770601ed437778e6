"""Per-model-pool aggregation of the newest samples (pure: the caller passes `now`).

A pool is every endpoint serving the same model name. Its KV usage is the max over fresh endpoints by default
(the fullest server preempts first, and the sidecar cannot steer requests away from it), the mean as an
option; waiting, running, KV capacity and KV tokens in use (usage x capacity per endpoint) are summed, and by
default (`max`) the KV budget reads the pool as that sum plus its spread (`spread_tokens`): as full as its
fullest endpoint, whose share of what is admitted it cannot steer away. The decode pace per sequence is the
mean of the endpoints' paces weighted by their running requests. Samples that are down (up=false) or older
than the staleness window (by the sidecar's own receive time, so exporter clock skew cannot fake freshness)
are excluded, and so is any sample holding a reading no server can have (`sample.problem`; the subscriber
already stores those as down): one endpoint's NaN cannot make the pool's aggregate NaN. A pool with no fresh
sample is stale.

A pool has no live endpoint (`PoolSnapshot.no_live_endpoint`) when every endpoint the feed knows for it sent,
within the staleness window, a down sample whose scrape could not connect (`UNREACHABLE_REASONS`): the
exporter is alive and says nothing listens there. Any other state (an endpoint up, one not heard from lately,
one down for another reason: a timeout, a bad page) is not that: a slow or odd metrics page says nothing
about whether the engine serves, and an exporter gone quiet says nothing at all (the pool is then stale).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from extproc.kvfeed.sample import FeedSample, problem
from extproc.kvfeed.subscriber.settings import KvMode

UNREACHABLE_REASONS = frozenset({"connect"})
"""The scrape failures (the reason that opens a down sample's `error`, extproc/kvfeed/scraper.py) that mean
the engine is not there: the connection itself failed (refused, no route, no such host). vLLM and SGLang open
their HTTP port only once the model is loaded, so a starting engine reads so too. Not `timeout` (a busy
engine can answer its metrics late and still serve) nor `http_status`, `parse` or `invalid` (it answered)."""


def unreachable(sample: FeedSample) -> bool:
    """Whether `sample` says its engine could not be connected to (`UNREACHABLE_REASONS`)."""
    return not sample.up and sample.error.split(":", 1)[0].strip() in UNREACHABLE_REASONS


@dataclass(frozen=True, slots=True)
class StoredSample:
    """A sample and when this process received it (its clock, not the exporter's)."""

    sample: FeedSample
    received_at: float


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Aggregate of one pool at `now`."""

    pool: str
    kv_usage: float | None
    requests_waiting: float
    requests_running: float
    kv_capacity_tokens: int | None
    endpoints_fresh: int
    endpoints_known: int
    newest_at: float | None
    stale: bool
    kv_used_tokens: float | None = None  # summed usage x capacity of fresh endpoints publishing both
    kv_spread_tokens: float = 0.0  # `spread_tokens` of those endpoints in `max` mode, else 0
    decode_tokens_per_second: float | None = None  # per sequence, over fresh endpoints publishing a pace
    kv_block_tokens: int | None = None  # the largest block of the fresh endpoints: the most one rounds
    waiting_known: bool = False  # every fresh endpoint published its queue (requests_waiting is then exact)
    running_known: bool = False  # every fresh endpoint published its running count (then exact)
    # Whether the pool's engines share prompt prefixes: False when a fresh endpoint says it does not (a
    # request routed there holds its whole prompt), True when every one that says, says so; None: none says.
    prefix_caching: bool | None = None
    endpoints_unreachable: int = 0  # endpoints whose latest sample, within the window, could not connect

    @property
    def no_live_endpoint(self) -> bool:
        """Every endpoint the feed knows for the pool recently failed to connect (module docstring)."""
        return self.endpoints_known > 0 and self.endpoints_unreachable == self.endpoints_known


def spread_tokens(endpoints: Sequence[tuple[float, int]]) -> float:
    """The KV tokens a pool would hold beyond its endpoints' (usage, capacity) readings were every endpoint as
    full as the fullest. Behind a balancer that does not look at the cache (round robin, a Service's pick per
    connection) every engine gets its share of what the sidecar admits, so the fullest must hold its share:
    the budget books the pool as that full. Two 16,384-token engines at 0.9 and 0.3 read 0.9 x 32,768 in use,
    not 0.6 x 32,768. Measured on engine time (bench/RESULTS.md section 12): two engines behind a per-
    connection pick preempted 14 times on the conversation trace with the sum read, 0 with this."""
    if not endpoints:
        return 0.0
    fullest = max(usage for usage, _ in endpoints)
    return sum((fullest - usage) * capacity for usage, capacity in endpoints)


def pool_prefix_caching(items: Iterable[StoredSample]) -> bool | None:
    """Whether the fresh endpoints that say share prompt prefixes (False: one does not; None: none says)."""
    said = {s.sample.prefix_caching for s in items} - {None}
    return None if not said else all(said)


def pool_pace(items: Iterable[StoredSample]) -> float | None:
    """The pool's decode pace per sequence: the endpoints' paces weighted by their running requests (at
    least 1 each, so an endpoint that just went idle still counts), None when no fresh endpoint has one."""
    weighted = [
        (pace, max(1.0, s.sample.requests_running or 0.0))
        for s in items
        if (pace := s.sample.decode_tokens_per_second) is not None
    ]
    if not weighted:
        return None
    return sum(pace * weight for pace, weight in weighted) / sum(weight for _, weight in weighted)


def aggregate(
    samples: Iterable[StoredSample],
    now: float,
    stale_after: Callable[[str], float],
    kv_mode: KvMode = "max",
) -> dict[str, PoolSnapshot]:
    """Snapshots of every pool that has at least one sample (fresh or not)."""
    known: dict[str, int] = {}
    down: dict[str, int] = {}
    fresh: dict[str, list[StoredSample]] = {}
    for stored in samples:
        pool = stored.sample.model
        known[pool] = known.get(pool, 0) + 1
        fresh.setdefault(pool, [])
        recent = now - stored.received_at <= stale_after(pool)
        if stored.sample.up and recent and problem(stored.sample) is None:
            fresh[pool].append(stored)
        elif recent and unreachable(stored.sample):
            down[pool] = down.get(pool, 0) + 1

    out: dict[str, PoolSnapshot] = {}
    for pool, items in fresh.items():
        usages = [min(1.0, s.sample.kv_usage) for s in items if s.sample.kv_usage is not None]
        kv: float | None = None
        if usages:
            kv = max(usages) if kv_mode == "max" else sum(usages) / len(usages)
        caps = [s.sample.kv_capacity_tokens for s in items if s.sample.kv_capacity_tokens]
        readings = [
            (min(1.0, s.sample.kv_usage), s.sample.kv_capacity_tokens)
            for s in items
            if s.sample.kv_usage is not None and s.sample.kv_capacity_tokens
        ]
        used = [usage * capacity for usage, capacity in readings]
        out[pool] = PoolSnapshot(
            pool=pool,
            kv_usage=kv,
            requests_waiting=sum(s.sample.requests_waiting or 0.0 for s in items),
            requests_running=sum(s.sample.requests_running or 0.0 for s in items),
            kv_capacity_tokens=sum(c for c in caps if c) if caps else None,
            endpoints_fresh=len(items),
            endpoints_known=known[pool],
            newest_at=max((s.received_at for s in items), default=None),
            stale=not items,
            kv_used_tokens=sum(used) if used else None,
            kv_spread_tokens=spread_tokens(readings) if kv_mode == "max" else 0.0,
            decode_tokens_per_second=pool_pace(items),
            kv_block_tokens=max((b for s in items if (b := s.sample.kv_block_tokens)), default=None),
            waiting_known=bool(items) and all(s.sample.requests_waiting is not None for s in items),
            running_known=bool(items) and all(s.sample.requests_running is not None for s in items),
            prefix_caching=pool_prefix_caching(items),
            endpoints_unreachable=down.get(pool, 0),
        )
    return out
