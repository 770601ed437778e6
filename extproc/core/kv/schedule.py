"""When will a refused request's KV fit? A `retry-after` per client that a whole burst can follow.

Forty requests arrive at once at a cache that holds eight of them. Hints that point every refused client at
the next release bring thirty-two back together when the first eight end: eight fit, twenty-four are
refused again and, with an SDK's two retries, most give up (measured on vLLM: 21 of 40 answered). So each
refused request is given a moment of its own, and that moment is remembered as a promise: the KV it will
take from then, for as long as it is expected to run. The next refused request is fitted after the leases
that end and around the promises already made, the way a backfilling scheduler plans its queue: client 9
is sent to the first release, client 17 to when the ninth's answer ends, and so on.

`RetrySchedule.eta` takes the booking the refused request was compared with (it included the request), the
leases' expected releases (seconds from now, tokens), the request's expected duration and footprint, and
returns the earliest time from now at which the booking, less what has been released, plus the promises
running then, leaves room for it for its whole expected run. A promise is kept under the request's identity
(`ClaimId`, as fair shares know it). Clients that send the same body share an identity, so a refusal adds a
promise, and replaces one of the identity's only when that one's time has come (its client is back); an
admission removes the identity's earliest promise (its lease is counted now), and a promise lapses at its
expected end. Pure: callers pass `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Promise:
    """KV tokens a refused request was told it may take from `start` until `end` (absolute seconds)."""

    start: float
    end: float
    tokens: int
    priority: tuple[float, float] = (0.0, 0.0)  # (class rank, tenant's attained service): lower first
    tenant: str = ""  # whose request it is: its service is read again when another is planned (`eta`)


_Planned = tuple[tuple[float, float], str, Callable[[str], float] | None]
"""A request being planned: its priority, its tenant and how to read a tenant's service now (`eta`)."""


def _ahead(
    promise: Promise, priority: tuple[float, float], tenant: str, standing: Callable[[str], float] | None
) -> bool:
    """Whether `promise` is planned before the request of `priority` and `tenant` (lower goes first)."""
    if standing is None or promise.priority[0] != priority[0]:
        return promise.priority <= priority
    if promise.tenant == tenant:
        return True
    return standing(promise.tenant) <= priority[1]


@dataclass
class RetrySchedule:
    max_promises: int = 256
    _promises: dict[Hashable, list[Promise]] = field(default_factory=dict, init=False)

    @property
    def promises(self) -> int:
        return sum(len(listed) for listed in self._promises.values())

    def eta(
        self,
        owner: Hashable,
        now: float,
        level: float,
        budget: float,
        releases: Sequence[tuple[float, int]],
        duration: float,
        tokens: int,
        first: bool = False,
        priority: tuple[float, float] = (0.0, 0.0),
        tenant: str = "",
        standing: Callable[[str], float] | None = None,
    ) -> float:
        """Seconds from `now` after which the refused request `owner` (`tokens` of KV for `duration` s) is
        expected to fit, and the promise made for it. `level` is the booking it was refused at, itself
        included; `releases` (seconds from now, tokens) are the leases' expected ends. It is planned around
        the promises of its `priority` or before (its class's rank, its tenant's attained service: lower
        goes first), in front of the others, or of all with `first` (it holds the fair-share claim): those
        passed find its KV taken when they come back and are planned again. With `standing` (a tenant's
        attained service now) the promises of `tenant`'s class are ordered by their tenants' service now,
        not as it stood when each was made: service decays, so a tenant's own earlier promises, made at
        its higher service of a moment ago, would all count as behind its later refusals, and a burst's
        refusals spread over milliseconds were every one sent to the first release. A tenant's own earlier
        promises stay ahead of it (first come within a tenant). One sort and one sweep: O(n log n) in the
        leases and promises."""
        self._forget(now)
        self._drop(owner, due_by=now)  # this client's own promise, if it is back at or after its time
        ahead_of = None if first else (priority, tenant, standing)
        times, levels = self._steps(now, level, releases, ahead_of)
        chosen = self._first_fit(times, levels, budget, max(0.0, duration))
        if self.promises < self.max_promises:
            promise = Promise(now + chosen, now + chosen + max(0.0, duration), tokens, priority, tenant)
            self._promises.setdefault(owner, []).append(promise)
        return chosen

    def kept(self, owner: Hashable) -> None:
        """A request of `owner` was admitted: its lease now counts, the identity's earliest promise goes."""
        self._drop(owner, due_by=None)

    def _drop(self, owner: Hashable, due_by: float | None) -> None:
        """Remove `owner`'s earliest promise (only if it starts by `due_by`, when given)."""
        listed = self._promises.get(owner)
        if not listed:
            return
        earliest = min(range(len(listed)), key=lambda i: listed[i].start)
        if due_by is not None and listed[earliest].start > due_by:
            return
        del listed[earliest]
        if not listed:
            del self._promises[owner]

    def _steps(
        self,
        now: float,
        level: float,
        releases: Sequence[tuple[float, int]],
        ahead_of: _Planned | None,
    ) -> tuple[list[float], list[float]]:
        """The booking ahead as a step function: `levels[k]` holds from `times[k]` to `times[k + 1]`, with
        the promises ahead of the request `ahead_of` describes (none for None, `_ahead`)."""
        changes: dict[float, float] = {0.0: 0.0}
        for at, released in releases:
            at = max(0.0, at)
            changes[at] = changes.get(at, 0.0) - released
        promises = [
            p
            for listed in self._promises.values()
            for p in listed
            if ahead_of is not None and _ahead(p, *ahead_of)
        ]
        for promise in promises:
            start, end = max(0.0, promise.start - now), promise.end - now
            changes[start] = changes.get(start, 0.0) + promise.tokens
            changes[end] = changes.get(end, 0.0) - promise.tokens
        times = sorted(changes)
        levels, current = [], level
        for t in times:
            current += changes[t]
            levels.append(current)
        return times, levels

    @staticmethod
    def _first_fit(times: list[float], levels: list[float], budget: float, duration: float) -> float:
        """The first step time from which the level stays within `budget` for `duration` (a sliding-window
        maximum over the steps), else the last step."""
        window: deque[int] = deque()  # step indices whose levels decrease, the window's maximum first
        end = 0
        for start in range(len(times)):
            while end < len(times) and (end == start or times[end] < times[start] + duration):
                while window and levels[window[-1]] <= levels[end]:
                    window.pop()
                window.append(end)
                end += 1
            while window[0] < start:
                window.popleft()
            if levels[window[0]] <= budget:
                return times[start]
        return times[-1]

    def _forget(self, now: float) -> None:
        for owner in list(self._promises):
            kept = [p for p in self._promises[owner] if p.end > now]
            if kept:
                self._promises[owner] = kept
            else:
                del self._promises[owner]
