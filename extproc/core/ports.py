"""The interface a limiter state store implements.

The ext_proc server talks to limits only through `LimiterStore`. The in-process store (the default) keeps
state in this process; a shared store lets several gateway replicas enforce one global limit. Both settle a
lease exactly once, whoever asks first; a lease may give its slots back before that (`release_slot`), its
tokens then settling with the lease. A shared store also carries messages between the replicas that share
it (`Mailbox`): the lean profile's end reports reach the replica that admitted their request through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from extproc.core.engine.tally import RunFigures
from extproc.core.kv.fleet import Peers, ReplicaShare
from extproc.core.limiter.limiter import KeySnapshot, Lease, LimitSpec, RateLimitStatus, Rejection


class StoreUnavailable(Exception):
    """The store could not answer in time (a shared store down or unreachable); nothing was admitted."""


EvictionCheck = Literal["safe", "evicting", "unverified"]
"""Whether a shared store can drop limiter keys to make room: `safe` (never: also the in-process store),
`evicting` (it may: the store refuses to admit through it), `unverified` (it would not say)."""


@dataclass(frozen=True)
class StoreHealth:
    """What a store can say about its own failures (the in-process store never fails: all zero)."""

    available: bool
    fallback_acquires: int = 0
    lost_leases: int = 0
    dropped_releases: int = 0
    state_losses: int = 0
    """Times the shared store was found to have forgotten its state (flushed, restarted empty, evicted)."""
    restored_leases: int = 0
    """Leases this replica re-added because the shared store had lost them before their expiry."""
    eviction: EvictionCheck = "safe"
    fallback_leases: int = 0
    """Requests running on leases this replica took in its local fallback, not yet counted in the shared
    store (adopted into it once it answers: extproc/store/fallback.py)."""


class Mailbox(Protocol):
    """Messages between the replicas that share a store, each replica reached by its name: at most once, to
    a replica subscribed at that moment; a lost message is the caller's to recover from."""

    published: int
    """Messages handed to the shared store."""
    dropped: int
    """Messages lost: the store unreachable, or too many waiting to be sent."""

    @property
    def closed(self) -> bool: ...

    async def start(self, deliver: Callable[[bytes], None]) -> None:
        """Receive this replica's messages, each handed to `deliver`; returns once receiving (bounded: a
        store unreachable now is tried again in the background)."""
        ...

    def send(self, to: str, payload: bytes) -> None:
        """Send `payload` to replica `to` without waiting; never raises (a lost message is counted)."""
        ...

    async def close(self) -> None:
        """Stop receiving and sending, within a bounded time."""
        ...


class KvBoard(Protocol):
    """Each pool's KV-budget figures of the replicas that share a store (`core.kv_fleet`): a replica's own
    are kept a while (`kv_fleet.REPLICA_TTL_S`), so a replica that dies stops counting."""

    async def exchange(self, pool: str, share: ReplicaShare) -> Peers:
        """Store this replica's figures of `pool` and read the sum of the other live replicas' in one call;
        raises `StoreUnavailable` when the store cannot answer in time."""
        ...

    async def exchange_runs(self, pool: str, figures: RunFigures) -> dict[str, RunFigures]:
        """Store this replica's runs of `pool` as its engine tally sums them (`EngineTally.figures`) and read
        each other live replica's, by its name (their sequence-seconds carried to now at the sequences they
        ran when they published), so each tally splits the pool's growth against every replica's runs;
        raises `StoreUnavailable` when the store cannot answer in time."""
        ...


class LimiterStore(Protocol):
    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        """Take one slot on every key and `tokens` from every bucket, all or nothing, as class `holder`;
        of them `output_tokens` are completion, which is all an `output:` key's bucket holds (and an
        `input:` key's the rest: extproc/core/limiter/split.py `key_tokens`).

        With `use_pool=False` only the class's own guarantee may be used, not the burstable pool.
        """
        ...

    async def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        """Settle a lease to the tokens really used, `actual_output` of them completion, and give back its
        slots unless `release_slot` did; False when it was settled before."""
        ...

    async def release_slot(self, lease: Lease) -> bool:
        """Give back an open lease's slots now, its tokens staying reserved until `release` settles them
        (the engine finished the request while its client still reads the answer). False when the lease is
        settled, gone, or gave its slots back before: a slot is never freed twice. A store that cannot
        answer keeps the slots held (False, never raises): `release` frees them at the latest."""
        ...

    async def refund(self, lease: Lease, tokens: int) -> bool:
        """Lower an open lease's reservation by `tokens` prompt tokens and return them to its buckets now
        (total and input ones: a reservation made on a bound, corrected once the exact count is known);
        False when the lease is settled or gone.
        The lease's `reserved_tokens` drops by what was refunded, so its settlement stays exact."""
        ...

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        """The tightest remaining capacity over `keys`, for response headers."""
        ...

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        """Install new base limits and the class priority order (config reload); open leases are kept."""
        ...

    async def set_scale(self, key: str, scale: float) -> None:
        """Scale a key's base limits (adaptive feedback)."""
        ...

    def propose_scale(self, key: str, scale: float) -> None:
        """`set_scale` without waiting, from synchronous code (the feed's callbacks): the in-process store
        applies it at once; a shared store takes it as this replica's proposal for the one scale all use."""
        ...

    def snapshot(self) -> list[KeySnapshot]:
        """Current state of every known key, for metrics."""
        ...

    async def start(self) -> None:
        """Connect and start background work (lease renewal, wake-up subscription); idempotent."""
        ...

    async def close(self) -> None:
        """Stop background work and disconnect, within a bounded time."""
        ...

    def prune(self) -> int:
        """Forget idle keys nobody configured (open-ended tenant keys); returns how many were forgotten."""
        ...

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Call `callback` when capacity may have freed elsewhere (a release on another replica)."""
        ...

    def announce_waiting(self) -> None:
        """Requests wait in this replica's queue: ask other replicas to signal their releases."""
        ...

    def health(self) -> StoreHealth:
        """Failure counters for metrics, read at scrape time."""
        ...

    def mailbox(self, own: str) -> Mailbox | None:
        """Messages to and from the other replicas sharing this store's state, this one named `own`; None
        where the state is this process's own (every message would be for the one replica there is)."""
        ...

    def kv_board(self) -> KvBoard | None:
        """The pools' KV-budget figures shared between the replicas of this store; None where the state is
        this process's own (a KV budget then books its configured share of each pool)."""
        ...
