"""One order across the fleet for requests that wait for a pool's KV (`FleetOrder`): the replica whose
waiting requests come first takes nearly all of the free room once every other replica has read them, the
others their sliver; however the exchanges interleave, no two replicas take the room at once."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.fleet import YIELDED_PART, Claim, Fleet, Peers, ReplicaShare


@dataclass
class Store:
    """KV_POOL's order and ask figures (extproc/store/redis/scripts.py), on a clock of its own (ms)."""

    ms: int = 0
    figures: dict[str, ReplicaShare] = field(default_factory=dict)

    def exchange(self, name: str, share: ReplicaShare) -> Peers:
        self.ms += 1
        self.figures[name] = share
        others = {n: s for n, s in self.figures.items() if n != name}
        heard = [s.heard_ms for s in others.values() if not s.yielding]
        firsts = [s.head_ms + (name < n) for n, s in others.items() if s.head_ms]
        yielding = sum(s.yielding for s in others.values())
        return Peers(
            ReplicaShare(yielding=yielding),
            len(others),
            now_ms=self.ms,
            oldest_ms=min(heard, default=-1),
            bound=min(firsts, default=0),
            heard_all_ms=min((s.heard_ms for s in others.values()), default=-1),
        )


@dataclass
class Replica:
    """One replica's fleet and its one call in flight: figures taken, then run by the store, then taken in."""

    name: str
    fleet: Fleet = field(default_factory=Fleet)
    taken: ReplicaShare | None = None  # figures taken, not yet run by the store
    answer: Peers | None = None  # run, not yet taken in
    waits: list[int] = field(default_factory=list)

    def take(self, now: float) -> None:
        yielding = self.fleet.publishing(now)
        head = self.fleet.order.publishing()
        self.taken = ReplicaShare(yielding=yielding, heard_ms=self.fleet.heard_ms, head_ms=head)

    def part(self) -> float:
        return self.fleet._part(Peers(replicas=2))


def three_replicas() -> list[Replica]:
    replicas = [Replica(name) for name in ("a", "b", "c")]
    for r in replicas:
        r.fleet.share_through_store(1 / 3)
    return replicas


def step(rng: random.Random, store: Store, replicas: list[Replica], now: float, keys: list[int]) -> None:
    """One event at random: a request begins to wait, a waiter leaves, or a call moves one phase."""
    r = rng.choice(replicas)
    r.fleet.decided(now)  # busy: none yields
    event = rng.random()
    if event < 0.2:
        keys[0] += 1
        r.waits.append(keys[0])
        r.fleet.order.begins(keys[0])
    elif event < 0.35 and r.waits:
        r.fleet.order.ends(r.waits.pop(rng.randrange(len(r.waits))))
    elif r.taken is None and r.answer is None:
        r.take(now)
    elif r.answer is None:
        assert r.taken is not None
        r.answer, r.taken = store.exchange(r.name, r.taken), None
    else:
        r.fleet.observe(r.answer, now)
        r.answer = None


@pytest.mark.parametrize("seed", range(40))
def test_however_the_exchanges_interleave_one_replica_at_most_takes_the_room(seed: int) -> None:
    """Three busy replicas, requests beginning and ending to wait at random, each call taken, run and
    answered at random moments: whenever one replica takes the room ahead of the others, each other one
    takes at most its sliver, so together they never take more than the room."""
    rng = random.Random(seed)
    store, replicas, keys = Store(), three_replicas(), [0]
    firsts = 0
    for i in range(3_000):
        step(rng, store, replicas, i * 0.01, keys)
        ahead = [r for r in replicas if r.fleet.order.first and r.fleet.claim is Claim.FULL]
        assert len(ahead) <= 1
        if ahead:
            firsts += 1
            assert sum(r.part() for r in replicas) <= 1.0 + 1e-9
    assert firsts > 100  # the order did take the room ahead, often


def full_fleet() -> Fleet:
    f = Fleet()
    f.share_through_store(0.5)
    f.claim = Claim.FULL
    return f


def answer(f: Fleet, now_ms: int, bound: int = 0) -> None:
    """Its figures taken, then the store's answer at `now_ms`: the other replica had read every answer up
    to `now_ms - 1` when it took its own."""
    f.order.publishing()
    f.observe(
        Peers(replicas=1, now_ms=now_ms, oldest_ms=now_ms - 1, bound=bound, heard_all_ms=now_ms - 1), 0.0
    )


def test_a_replica_takes_the_room_ahead_only_once_every_other_has_read_its_run() -> None:
    f = full_fleet()
    f.order.begins("x")
    f.order.begins("y")
    answer(f, 10)  # both stamped 10; the run (up to 10) not sent yet
    assert f.order.head_ms() == 10 and f.must_publish and not f.order.first
    answer(f, 12)  # the run goes out with the exchange at 12; the other had read no later than 11
    assert not f.order.first and f._part(Peers(replicas=1)) == pytest.approx(0.5)
    answer(f, 14)  # the other took its figures after reading the answer at 13
    assert f.order.first and f._part(Peers(replicas=1)) == pytest.approx(1 - YIELDED_PART)
    f.order.begins("z")
    f.order.ends("x")  # y, of the same run, goes first without another exchange
    assert f.order.first
    answer(f, 16)  # z stamped 16: after the run
    f.order.ends("y")
    assert not f.order.first and not f.order.behind and f._part(Peers(replicas=1)) == pytest.approx(0.5)
    answer(f, 18)
    answer(f, 20)
    assert f.order.first


def test_a_replica_whose_head_comes_after_anothers_keeps_to_its_sliver() -> None:
    f = full_fleet()
    f.order.begins("x")
    answer(f, 10, bound=8)  # x stamped 10; another replica's head is 8
    assert f.order.behind and not f.order.first and f._part(Peers(replicas=1)) == YIELDED_PART
    f.order.ends("x")
    assert f.order.behind  # nothing waiting here, another waits: behind it
    answer(f, 12, bound=0)  # the other's head gone
    assert not f.order.behind and f._part(Peers(replicas=1)) == pytest.approx(0.5)


def test_a_run_the_others_came_before_meanwhile_is_not_confirmed() -> None:
    f = full_fleet()
    f.order.begins("x")
    answer(f, 10)  # x stamped 10
    answer(f, 12)  # the run up to 10 carried
    answer(f, 14, bound=9)  # heard, but the other published a head of 9 before reading it
    assert not f.order.first and f.order.behind


def test_a_store_that_does_not_order_divides_the_room_as_before() -> None:
    f = full_fleet()
    f.order.begins("x")
    for ms in (10, 20, 30):
        answer(f, ms, bound=-1)
    assert not f.order.first and not f.order.behind and not f.order.unsent
    assert f._part(Peers(replicas=1)) == pytest.approx(0.5)


def budget() -> KvBudget:
    b = KvBudget(
        10_000,
        target_utilization=1.0,
        booking=BookingMode.LIFETIME,
        learner=CompletionLearner(min_samples=10**6),
    )
    b.share_through_store(fallback_share=0.5)
    b.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    return b


def test_the_oldest_waiting_request_gets_the_room_half_of_it_would_not_hold() -> None:
    """Two replicas holding 6,000 and 1,000 tokens of 10,000: a waiting request of 2,000 does not fit
    half of the 3,000 free, and did not until 4,000 were free; first in the fleet's order, it fits; the
    other replica, behind it, keeps to its sliver."""
    busy, quiet = budget(), budget()
    busy.admit("held", 3_000, 3_000, now=0.0)
    quiet.admit("held", 500, 500, now=0.0)
    ms = 0

    def exchange(now: float) -> None:
        nonlocal ms
        shares = {r: r.replica_share(now) for r in (busy, quiet)}
        for r, other in ((busy, quiet), (quiet, busy)):
            ms += 1
            theirs = shares[other]
            heard = theirs.heard_ms
            peers = Peers(theirs, 1, now_ms=ms, oldest_ms=heard, bound=theirs.head_ms, heard_all_ms=heard)
            r.observe_peers(peers, now)

    for i in range(3):  # both take their part
        exchange(i * 0.1)
    assert not busy.would_fit(1_000, 1_000, now=0.3)[0]
    busy.fleet.order.begins("waiting")
    for i in range(4, 8):
        exchange(i * 0.1)
        busy.fleet.decided(i * 0.1)
        quiet.fleet.decided(i * 0.1)
    assert busy.fleet.order.first and quiet.fleet.order.behind
    assert busy.would_fit(1_000, 1_000, now=0.8)[0]
    assert not quiet.would_fit(250, 250, now=0.8)[0]
