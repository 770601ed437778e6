"""One order across the fleet for the requests that wait for a pool's KV (`Fleet`'s `FleetOrder`).

Replicas that share a pool divide the free room between them (`Fleet.budget`): beside another replica that
wants KV, each takes its part of the room nobody booked. Two replicas whose queues both wait then leave idle
up to twice a request's footprint (each waits until its own part holds its head), and a replica with a few
clients serves them first: at 90/10 on the simulator the three clients of the small gateway were answered
about three times as often as the busy one's 27 (bench/RESULTS.md, section 11). One gateway answers its
clients in its queue's order and fills the room up to its head's footprint.

So where requests wait, the one waiting longest anywhere goes first. Each replica stamps each request that
waits for the pool's KV with the store's time of the first answer it takes in after the request began to
wait (a time after its arrival, in the one clock every replica reads), and publishes its oldest stamp, its
head (`ReplicaShare.head_ms`). The store answers with the bound below which a stamp comes before every other
replica's head (`Peers.bound`: the least other head, ties to the lesser name). Its waiting requests stamped
under that bound are a run ahead of everyone; once every other replica has taken figures after reading an
answer later than the exchange that found the run, and the bound still lies above it, the run is confirmed:
while this replica's head is in a confirmed run, it takes the free room but a sliver for each other replica
(`first`). Each other replica has read a head of its below its own head by then (`behind`: a sliver), and
any request that waits there later is stamped after the run. So no two replicas take the room at once, and
a run confirmed once holds for each of its requests in turn, with no exchange between them. Where nothing
waits, or the store does not order (a replica of a version before this, `Peers.bound` < 0), the room is
divided as before.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque

UNORDERED = -1
"""`Peers.bound` where the store does not order the heads."""

CARRIED_KEPT = 8
"""The most runs awaiting confirmation kept at once (one per exchange: the oldest go first)."""


class FleetOrder:
    """The requests that wait here for one pool's KV, and where this replica's oldest stands in the fleet."""

    def __init__(self) -> None:
        self._waits: dict[object, int | None] = {}  # each waiting request's stamp (None: no answer since)
        self._bound = UNORDERED  # as of the last answer: 0, no other head; else the first stamp not ahead
        self._run = 0  # the run sent with the exchange in flight (0: none)
        self._carried: deque[tuple[int, int]] = deque(maxlen=CARRIED_KEPT)  # (run, exchange's store time)
        self._confirmed = 0  # the latest stamp of a confirmed run: its requests go first

    def begins(self, key: object) -> None:
        """A request (`key`) began to wait for the pool's KV: stamped by the next answer."""
        self._waits.setdefault(key, None)

    def ends(self, key: object) -> None:
        """`key` no longer waits (admitted, refused, gone)."""
        self._waits.pop(key, None)

    def head_ms(self) -> int:
        """The stamp of its oldest stamped request; 0 where none is stamped (a request stamped by no answer
        yet is later than every stamped one)."""
        return min(self._stamps(), default=0)

    def _stamps(self) -> list[int]:
        return [stamp for stamp in self._waits.values() if stamp is not None]

    @property
    def first(self) -> bool:
        """Its head is in a confirmed run, and no head read since comes before it: it takes the free room but
        the others' slivers."""
        head = self.head_ms()
        ahead = self._bound == 0 or head < self._bound
        return self._bound != UNORDERED and 0 < head <= self._confirmed and ahead

    @property
    def behind(self) -> bool:
        """Another replica's head comes before its own (or it has none): a sliver of the free room. Never
        while `first`: a head in a confirmed run lies below the bound."""
        if self._bound <= 0:
            return False
        head = self.head_ms()
        return head == 0 or head >= self._bound

    def publishing(self) -> int:
        """Its figures are taken for an exchange: the head they carry (`ReplicaShare.head_ms`); the run
        ahead of every other head as of the last answer goes with them, to be confirmed by a later one."""
        self._run = self._ahead_run()
        return self.head_ms()

    def _ahead_run(self) -> int:
        if self._bound == UNORDERED:
            return 0
        ahead = [stamp for stamp in self._stamps() if self._bound == 0 or stamp < self._bound]
        return max(ahead, default=0)

    @property
    def unsent(self) -> bool:
        """Whether a run ahead of everyone is not yet confirmed: its figures go out again at once, so that
        an answer soon says whether the others have read it."""
        return self._ahead_run() > self._confirmed

    def observe(self, now_ms: int, oldest_ms: int, bound: int) -> None:
        """The store's answer at `now_ms` to the exchange `publishing` took figures for: `oldest_ms`, the
        least store time of the last answer the others had taken in when they took their figures, yielding
        or not (-1: no other); `bound`, the first stamp not ahead of every other head (0: no other head;
        `UNORDERED` where the store does not order them)."""
        for key, stamp in self._waits.items():
            if stamp is None:
                self._waits[key] = now_ms
        self._bound = bound
        if bound == UNORDERED:
            self._carried.clear()
            self._confirmed = 0
            return
        if self._run > self._confirmed and all(run != self._run for run, _ in self._carried):
            self._carried.append((self._run, now_ms))  # the first exchange that carried it counts
        self._run = 0
        heard = {run for run, at in self._carried if oldest_ms < 0 or oldest_ms > at}
        self._confirmed = max([self._confirmed, *(run for run in heard if bound == 0 or run < bound)])
        waiting = [(run, at) for run, at in self._carried if run > self._confirmed and run not in heard]
        self._carried = deque(waiting, maxlen=CARRIED_KEPT)  # a run heard but not ahead is carried anew
