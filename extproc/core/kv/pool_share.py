"""The KV budget's share of its pool (`KvBudget`): the tokens this replica may book, from the pool's capacity,
`target_utilization` and `capacity_share`, and, where replicas share a store, what the others have booked
(`Fleet`): each may book what the others have not, up to that ceiling, and its fallback share while the store
cannot say. It keeps what the others' figures are read against: the latest `now` a caller passed (their
age) and what this replica had booked when it last sent its own. Each tenant's unconfirmed credit
(`kv_credit`) is a part of this replica's fixed share, so a change of either bounds it anew
(`Ledger.set_credit_limit`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from extproc.core.kv.fleet import Fleet, Peers
from extproc.core.kv.ledger import Ledger


class PoolShare:
    """This replica's part of one pool's KV capacity."""

    def __init__(self, target_utilization: float, capacity_share: float, ledger: Ledger) -> None:
        self._target = target_utilization
        self._share = capacity_share
        self.fleet = Fleet()
        self._capacity: int | None = None
        self._seen_at: float | None = None  # the latest `now` a caller passed: the others' figures' age
        self._sent_booked = 0  # what it had booked when its figures were last taken (`replica_share`)
        self._ledger = ledger  # whose tenants' unconfirmed credit is bounded by this share

    @property
    def capacity(self) -> int | None:
        """Pool capacity in tokens, None while unknown."""
        return self._capacity

    def set_capacity(self, capacity_tokens: int | None) -> None:
        """Capacity from the feed; 0 or negative means unknown (servers report 0 when unset)."""
        if capacity_tokens is None or capacity_tokens <= 0:
            self._capacity = None
        else:
            self._capacity = int(capacity_tokens)
        self._ledger.set_credit_limit(self._capacity, self.budget_share())

    def budget(self, booked: int, unexplained: float) -> int | None:
        """Tokens this sidecar may have admitted: capacity x target_utilization, less what the other
        replicas have booked where a shared store says, at most `capacity_share` of it (`Fleet.budget`);
        `booked` and `unexplained` as of the last decision or sample."""
        if self._capacity is None:
            return None
        target = self._capacity * self._target
        own = max(0.0, booked - unexplained)
        return self.fleet.budget(target, self._share, self._seen_at, unexplained, own)

    def budget_share(self) -> float:
        """The fixed share of the pool this replica books against while the others are unknown."""
        fleet = self.fleet
        return min(self._share, fleet.fallback_share) if fleet.shared else self._share

    def share_through_store(self, fallback_share: float) -> None:
        """Replicas share this pool through a store (`Fleet.share_through_store`)."""
        self.fleet.share_through_store(fallback_share)
        self._ledger.set_credit_limit(self._capacity, self.budget_share())

    def seen(self, now: float | None) -> None:
        """A caller's `now`: the others' figures are as old as the latest one."""
        if now is not None and (self._seen_at is None or now > self._seen_at):
            self._seen_at = now

    def observe_peers(self, peers: Peers | None, now: float) -> None:
        """The others' figures, as the store answered at `now` to the exchange of this replica's last ones."""
        self.seen(now)
        self.fleet.observe(peers, now, self._sent_booked)

    def sent(self, booked: int) -> None:
        """This replica's figures were taken with `booked`: the store's next answer is read against it."""
        self._sent_booked = booked
