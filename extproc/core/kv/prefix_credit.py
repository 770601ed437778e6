"""The KV budget's prefix credit (`KvBudget`, `prefix_index`): the prompt prefixes its leases share, booked as
the engine's prefix cache holds them. Of the holders of a chunk only the last `replicas` admitted pay for it,
the others are credited it (their prompt is booked less the credit, `Lease.own_prompt`); when a payer is
released the next holder pays again, so what the leases hold now is booked exactly. The index says whose
credit changes; this applies it to the leases, through the ledger so the demand follows.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.core.kv.lease import Lease
from extproc.core.kv.ledger import Ledger
from extproc.core.kv.prefix import NO_CHUNKS, PrefixIndex, PromptChunks

Booking = Callable[[Lease | None], tuple[int, int]]
"""A booking sum without and with an extra lease (`Booker.book` at one `now`)."""


class PrefixCredit:
    """The shared prefixes of one pool's leases, credited to all but the holders that pay for them."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._index = PrefixIndex()
        self._engine_shares = True  # the pool's engines share prompt prefixes (`set_engine_shares`)

    @property
    def replicas(self) -> int:
        """Replicas a shared chunk may be held on at most (see `set_replicas`)."""
        return self._index.replicas

    def chunks(self, chunks: PromptChunks) -> PromptChunks:
        """A request's chunks as the budget books them: none where the engines do not share prefixes."""
        return chunks if self._engine_shares else NO_CHUNKS

    def admitted(self, lease_id: str, lease: Lease) -> None:
        """`lease`, just added to the ledger, holds its chunks: the holders it relieves are credited."""
        self._credit(self._index.add(lease_id, lease.chunks.hashes), 1)

    def released(self, lease_id: str, lease: Lease) -> None:
        """`lease`, just dropped from the ledger, holds its chunks no more: the next holders pay again."""
        self._credit(self._index.remove(lease_id, lease.chunks.hashes), -1)

    def book_with(self, candidate: Lease, book: Booking) -> tuple[int, int, int]:
        """`book` with `candidate` added, the chunks it would credit to the leases that hold them credited
        for as long as the sum takes (then as before: the candidate is not admitted yet), and the prompt
        tokens that credit spares those leases: the candidate adds its footprint less these. The index is
        only read (`PrefixIndex.would_credit`): the check costs the candidate's chunks, not their holders."""
        hashes = candidate.chunks.hashes
        changes = self._index.would_credit(hashes) if hashes else None
        if not changes:
            return (*book(candidate), 0)
        alone = book(None)[0]
        spared = self._credit(changes, 1)
        try:
            together = book(candidate)[1]
        finally:
            self._credit(changes, -1)
        return alone, together, spared

    def set_replicas(self, replicas: int) -> bool:
        """How many replicas serve the pool (from the feed): a shared chunk is booked once per replica at
        most. A change re-books the prefix credit of the leases whose payment it changes (only those holding
        a chunk with more holders than the smaller count), in place: a replica coming or going costs the
        shared chunks, not a rebuild of every lease. True when it changed."""
        replicas = max(1, int(replicas))
        if replicas == self._index.replicas:
            return False
        self._credit(self._index.set_replicas(replicas), 1)
        return True

    def set_engine_shares(self, shares: bool) -> bool:
        """Whether the pool's engines share prompt prefixes (the feed: vLLM's `enable_prefix_caching`, True
        when no engine says). An engine that does not holds every prompt whole, however many requests
        share its text: no request is credited another's chunks, and the leases in flight are booked whole
        again at once. Sharing back on credits new leases only. True when it changed."""
        if shares == self._engine_shares:
            return False
        self._engine_shares = shares
        if shares:
            return True
        self._index = PrefixIndex(self._index.replicas)
        for lease in self._ledger.leases.values():
            self._set_credit(lease, 0)
            lease.chunks = NO_CHUNKS
        return True

    def _credit(self, changes: dict[str, int], sign: int) -> int:
        """Shared chunks newly credited to (`sign` 1) or paid again by (-1) the leases named; returns by how
        much their footprints fell."""
        fell = 0
        for lease_id, chunks in changes.items():
            lease = self._ledger.leases.get(lease_id)
            if lease is not None:
                fell += self._set_credit(lease, lease.credited + sign * chunks)
        return fell

    def _set_credit(self, lease: Lease, credited: int) -> int:
        """`lease` credited `credited` chunks, through the ledger; returns by how much its footprint fell."""
        before = lease.footprint
        lease.credited = max(0, credited)
        self._ledger.resized(lease, before)
        return before - lease.footprint
