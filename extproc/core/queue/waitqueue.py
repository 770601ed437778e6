"""Order of admission for requests that wait for capacity instead of getting an instant 429.

Highest class first; within a class, tenants take turns (round robin), and each tenant's own requests go
nearest client deadline first (`Waiter.due`), those without one after those with one, arrival order among
equals. A tenant that floods its class therefore cannot push another tenant of the same class to the back:
every tenant with a waiter gets one admission per turn, and a deadline reorders only its own tenant's line,
so a client cannot claim an early deadline to overtake anyone else. Each class has its own bound on queued
requests, so a flood of one class cannot crowd the others out of the queue either.

Pure bookkeeping: the asynchronous part (waking waiters when capacity frees) lives with the server.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Waiter:
    holder: str
    tenant: str
    enqueued_at: float
    deadline: float  # when it stops waiting: the smallest of the global, class and request bounds
    payload: Any = None
    seq: int = 0
    due: float | None = None  # the client's own deadline, when it gave one: orders its tenant's line
    run_s: float = 0.0  # how long it is expected to hold its capacity once admitted (deadline estimates)

    @property
    def order(self) -> tuple[float, int]:
        """Its place in its tenant's line: nearest deadline first, none last, arrival among equals."""
        return (math.inf if self.due is None else self.due, self.seq)


@dataclass
class _ClassQueue:
    tenants: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)
    size: int = 0


def _place(line: MutableSequence[Waiter], waiter: Waiter) -> None:
    """Put `waiter` in a tenant's line by its order, from the back: a request without a deadline, the
    common case, costs nothing."""
    place = len(line)
    while place and line[place - 1].order > waiter.order:
        place -= 1
    line.insert(place, waiter)


def _in_turn(lines: Iterable[Sequence[Waiter]]) -> Iterator[Waiter]:
    """Tenants' lines merged as tenants take turns: each line's first, then each line's second, ..."""
    for turn in itertools.zip_longest(*lines):
        yield from (waiter for waiter in turn if waiter is not None)


class WaitQueue:
    def __init__(self, priority: Sequence[str], max_queued: Mapping[str, int]) -> None:
        self._priority = list(priority)
        self._max = dict(max_queued)
        self._classes: dict[str, _ClassQueue] = {}
        self._seq = itertools.count()

    def configure(self, priority: Sequence[str], max_queued: Mapping[str, int]) -> None:
        """New class order and bounds (config reload); waiters already queued stay queued."""
        self._priority = list(priority)
        self._max = dict(max_queued)

    def __len__(self) -> int:
        return sum(q.size for q in self._classes.values())

    def depth(self, holder: str) -> int:
        queue = self._classes.get(holder)
        return queue.size if queue is not None else 0

    def _rank(self, holder: str) -> int:
        return self._priority.index(holder) if holder in self._priority else len(self._priority)

    def push(self, waiter: Waiter) -> bool:
        """Queue a waiter; False when its class's queue is full (or the class may not queue)."""
        if self.depth(waiter.holder) >= self._max.get(waiter.holder, 0):
            return False
        waiter.seq = next(self._seq)
        queue = self._classes.setdefault(waiter.holder, _ClassQueue())
        _place(queue.tenants.setdefault(waiter.tenant, deque()), waiter)
        queue.size += 1
        return True

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (admitted, expired or gone); its tenant goes to the back of its class's turn."""
        queue = self._classes.get(waiter.holder)
        if queue is None:
            return False
        line = queue.tenants.get(waiter.tenant)
        if line is None or waiter not in line:
            return False
        served = line[0] is waiter
        line.remove(waiter)
        queue.size -= 1
        if not line:
            del queue.tenants[waiter.tenant]
        elif served:
            queue.tenants.move_to_end(waiter.tenant)
        if not queue.size:
            del self._classes[waiter.holder]
        return True

    def service_order(self, holder: str, extra: Waiter | None = None) -> list[Waiter]:
        """The waiters of class `holder` and of the classes above it, in the order they are expected to be
        admitted: higher classes first; within a class, tenants in turn (one waiter each per turn, from
        the tenant whose turn is next), each tenant's line in its order. `extra`, a newcomer not queued, is
        placed where it would queue (a tenant new to the class takes the last turn)."""
        rank = self._rank(holder)
        out: list[Waiter] = []
        for name in sorted(self._classes, key=self._rank):
            if self._rank(name) > rank:
                break
            lines = {tenant: list(line) for tenant, line in self._classes[name].tenants.items()}
            if extra is not None and name == holder:
                _place(lines.setdefault(extra.tenant, []), extra)
            out.extend(_in_turn(lines.values()))
        if extra is not None and holder not in self._classes:
            out.append(extra)
        return out

    def ahead_in_line(self, holder: str, tenant: str, due: float | None) -> list[float]:
        """When each of `tenant`'s waiters in class `holder` that a newcomer due at `due` would queue behind
        stops waiting (`Waiter.deadline`), in their order: those certainly before it, whatever the other
        tenants' turns."""
        queue = self._classes.get(holder)
        line = queue.tenants.get(tenant, ()) if queue is not None else ()
        order = (math.inf if due is None else due, sys.maxsize)
        return [waiter.deadline for waiter in line if waiter.order < order]

    def ahead_of(self, holder: str) -> bool:
        """Whether anyone of this class or a higher one is waiting (a newcomer must not overtake them)."""
        rank = self._rank(holder)
        return any(self._rank(h) <= rank and q.size for h, q in self._classes.items())

    def candidates(self) -> Iterator[Waiter]:
        """The head waiter of every tenant, highest class first, tenants in their turn order."""
        for holder in sorted(self._classes, key=self._rank):
            queue = self._classes.get(holder)
            if queue is None:
                continue
            for line in list(queue.tenants.values()):
                if line:
                    yield line[0]

    def expired(self, now: float) -> list[Waiter]:
        return [
            w
            for q in self._classes.values()
            for line in q.tenants.values()
            for w in line
            if w.deadline <= now
        ]
