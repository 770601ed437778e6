"""The prefix index as it was before issue 40, kept as a reference: a list of holders per chunk, scanned, and
a budget that checks a candidate by inserting and removing it, and rebuilds every lease when replicas change.

It is the oracle the counted index (extproc/core/kv/prefix.py) is tested against
(tests/unit/core/kv/test_prefix.py), and the baseline `bench/micro` measures it against. Straightforward on
purpose: the last `replicas` entries of a chunk's list pay, the others are credited.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extproc.core.kv.budget import KvBudget
from extproc.core.kv.lease import Lease
from extproc.core.kv.prefix_credit import Booking, PrefixCredit


class ListPrefixIndex:
    """Chunk hash -> the lease ids holding it, oldest first."""

    __slots__ = ("_holders", "replicas")

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = max(1, int(replicas))
        self._holders: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def shared_run(self, chunks: Sequence[int]) -> int:
        run = 0
        for chunk in chunks:
            if chunk not in self._holders:
                break
            run += 1
        return run

    def add(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        credited: dict[str, int] = {}
        for chunk in chunks:
            holders = self._holders.setdefault(chunk, [])
            holders.append(lease)
            if len(holders) > self.replicas:
                older = holders[-self.replicas - 1]
                credited[older] = credited.get(older, 0) + 1
        return credited

    def remove(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        debited: dict[str, int] = {}
        for chunk in chunks:
            holders = self._holders.get(chunk)
            if holders is None:
                continue
            try:
                at = holders.index(lease)
            except ValueError:
                continue
            paid = at >= len(holders) - self.replicas
            del holders[at]
            if not holders:
                del self._holders[chunk]
            elif paid and len(holders) >= self.replicas:
                newer = holders[-self.replicas]
                debited[newer] = debited.get(newer, 0) + 1
        return debited

    def credited(self, lease: str, chunks: Sequence[int]) -> int:
        run = 0
        for chunk in chunks:
            holders = self._holders.get(chunk, ())
            if lease in holders[: max(0, len(holders) - self.replicas)]:
                run += 1
            else:
                break
        return run

    def credited_chunks(self, lease: str, chunks: Sequence[int]) -> int:
        """All chunks of `lease` it does not pay for, leading or not (`credited` for chained hashes)."""
        return sum(
            lease in holders[: max(0, len(holders) - self.replicas)]
            for holders in (self._holders.get(chunk, []) for chunk in chunks)
        )


class ListPrefixCredit(PrefixCredit):
    """`PrefixCredit` on `ListPrefixIndex`: the candidate's check and the change of replicas as they were."""

    _index: ListPrefixIndex  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._index = ListPrefixIndex()

    def set_replicas(self, replicas: int) -> bool:
        replicas = max(1, int(replicas))
        if replicas == self._index.replicas:
            return False
        index = ListPrefixIndex(replicas)
        self._index = index
        leases = self._ledger.leases
        for lease_id, lease in leases.items():
            index.add(lease_id, lease.chunks.hashes)
        for lease_id, lease in leases.items():
            self._set_credit(lease, index.credited(lease_id, lease.chunks.hashes))
        return True

    def book_with(self, candidate: Lease, book: Booking) -> tuple[int, int, int]:
        hashes = candidate.chunks.hashes
        if not hashes or not self._index.shared_run(hashes):
            return (*book(candidate), 0)
        alone = book(None)[0]
        spared = self._credit(self._index.add("", hashes), 1)
        try:
            together = book(candidate)[1]
        finally:
            self._credit(self._index.remove("", hashes), -1)
        return alone, together, spared


class ListBudget(KvBudget):
    """`KvBudget` on `ListPrefixCredit`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix = ListPrefixCredit(self._ledger)
