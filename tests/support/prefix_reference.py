"""The prefix index as it was before issue 40, kept as a reference: a list of holders per chunk, scanned, and
a budget that checks a candidate by inserting and removing it, and rebuilds every lease when replicas change.

It is the oracle the counted index (extproc/core/kv/prefix.py) is tested against
(tests/unit/core/kv/test_prefix.py), and the baseline `bench/micro` measures it against. Straightforward on
purpose: the last `replicas` entries of a chunk's list pay, the others are credited.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extproc.core.kv.budget import KvBudget, _Lease


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


class ListBudget(KvBudget):
    """`KvBudget` on `ListPrefixIndex`, with the candidate's check and the change of replicas as they were."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefixes = ListPrefixIndex()  # type: ignore[assignment]

    def set_replicas(self, replicas: int) -> None:
        replicas = max(1, int(replicas))
        if replicas == self._prefixes.replicas:
            return
        index = ListPrefixIndex(replicas)
        self._prefixes = index  # type: ignore[assignment]
        self._last_fit = None
        for lease_id, lease in self._leases.items():
            index.add(lease_id, lease.chunks.hashes)
        for lease_id, lease in self._leases.items():
            self._set_credit(lease, index.credited(lease_id, lease.chunks.hashes))

    def _book_candidate(self, now: float | None, candidate: _Lease) -> tuple[int, int]:
        hashes = candidate.chunks.hashes
        if not hashes or not self._prefixes.shared_run(hashes):
            return self._book(now, candidate)
        alone = self._book(now)[0]
        self._credit(self._prefixes.add("", hashes), 1)
        try:
            together = self._book(now, candidate)[1]
        finally:
            self._credit(self._prefixes.remove("", hashes), -1)
        return alone, together
