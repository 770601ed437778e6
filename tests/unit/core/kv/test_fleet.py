"""One pool's KV budget across gateway replicas (`kv_fleet`): divided by demand through the others' figures,
a fixed share while they are unknown, and the engine's pool-wide counts read against every replica's
leases."""

from __future__ import annotations

import pytest

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.fleet import (
    ASKING_HINT_S,
    FREE_HORIZONS_S,
    OTHERS_LAG_S,
    PEERS_FRESH_S,
    PUBLISH_EVERY_S,
    REPLICA_TTL_S,
    YIELD_AFTER_S,
    YIELDED_PART,
    Claim,
    Fleet,
    Peers,
    ReplicaShare,
)


def budget(capacity: int = 10_000, share: float = 1.0) -> KvBudget:
    """A forecast budget whose completion estimate is the whole allowance, its pace known (100 tok/s)."""
    learner = CompletionLearner(min_samples=10**6)
    b = KvBudget(
        capacity,
        target_utilization=1.0,
        capacity_share=share,
        booking=BookingMode.FORECAST,
        learner=learner,
    )
    b.pace.observe_stream(100, 1.0)
    return b


def exchange(a: KvBudget, b: KvBudget, now: float) -> None:
    """What the store carries at `now`: each replica's figures to the other, `a`'s call first (store time 2k
    ms, `b`'s 2k + 1), each with what the other had heard when its figures were taken."""
    a_share, b_share = a.replica_share(now), b.replica_share(now)
    ms = round(now * 1000) * 2
    a.observe_peers(Peers(b_share, 1, now_ms=ms, oldest_ms=heard_of(b_share)), now)
    b.observe_peers(Peers(a_share, 1, now_ms=ms + 1, oldest_ms=heard_of(a_share)), now)


def heard_of(share: ReplicaShare) -> int:
    """`Peers.oldest_ms` of one other replica: what it had heard, or -1 where it yields."""
    return -1 if share.yielding else share.heard_ms


def state(fleet: Fleet) -> Claim:
    """The fleet's claim, read afresh (a call, so a type checker does not carry an earlier comparison)."""
    return fleet.claim


def heard(r: KvBudget, share: ReplicaShare, replicas: int, now: float) -> None:
    """Two answers of the store at `now`: the first carries this replica's ask, the second comes after every
    other replica has published again, so it takes its part."""
    r.observe_peers(Peers(share, replicas, now_ms=10, oldest_ms=5), now)
    r.observe_peers(Peers(share, replicas, now_ms=20, oldest_ms=11), now)
    assert state(r.fleet) is Claim.FULL


def test_the_store_unreachable_books_on_the_fallback_share_and_capacity_share_stays_a_ceiling() -> None:
    r = budget(share=0.8)
    assert r.budget_tokens == 8_000  # alone: the configured share, as before there was a fleet
    r.share_through_store(fallback_share=0.5)
    assert r.budget_tokens == 5_000  # shared, the others not known yet
    heard(r, ReplicaShare(booked=1_000), 1, now=10.0)
    assert r.budget_tokens == 4_500  # half of the 9,000 unbooked: the other replica may take the rest
    r.observe_peers(Peers(ReplicaShare(), 0), now=10.0)
    assert r.budget_tokens == 8_000  # alone: all of it, at most the 0.8 ceiling
    r.observe_peers(None, now=10.0 + PEERS_FRESH_S + 0.1)  # the store did not answer since
    assert r.budget_tokens == 5_000
    with pytest.raises(ValueError, match="fallback_share"):
        Fleet().share_through_store(0.0)


def test_an_empty_replica_does_not_admit_past_a_pool_the_others_filled() -> None:
    r = budget()
    r.share_through_store(fallback_share=0.5)
    r.observe_peers(Peers(ReplicaShare(booked=9_900), 1), now=0.0)
    assert not r.would_fit(500, 500, now=0.0)[0]  # not the "empty pool admits" of a replica alone


def unseen_leases(r: KvBudget, prefix: str, count: int) -> None:
    """`count` answers nobody sees (lean), admitted at 0, counted running by a sample at 3 s."""
    r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    for i in range(count):
        r.admit(f"{prefix}{i}", 100, 10_000, now=0.0)


def test_a_replicas_running_leases_are_not_found_finished_for_the_others_count() -> None:
    """Two replicas without shared figures holding 10 and 2 running requests: the busy one scaled the
    pool's 12 running by its 0.5 share, counted 6, and took 4 of its running leases for finished."""
    busy = budget(capacity=100_000, share=0.5)
    unseen_leases(busy, "a", 10)
    busy.observe_engine(2_000, now=3.0, fresh_for=100.0, waiting=0, running=12)
    busy.observe_engine(2_000, now=6.0, fresh_for=100.0, waiting=0, running=12)
    assert busy.engine_finished == 0


def test_with_the_others_figures_the_pools_excess_is_divided_by_candidates() -> None:
    a, b = budget(capacity=100_000), budget(capacity=100_000)
    for r, prefix, count in ((a, "a", 10), (b, "b", 2)):
        r.share_through_store(fallback_share=0.5)
        unseen_leases(r, prefix, count)
        r.observe_engine(2_000, now=3.0, fresh_for=100.0, waiting=0, running=12)
    exchange(a, b, 3.0)
    for r in (a, b):
        r.observe_engine(2_000, now=4.0, fresh_for=100.0, waiting=0, running=12)
    assert (a.engine_finished, b.engine_finished) == (0, 0)  # 12 settled, 12 running: none done
    exchange(a, b, 5.0)  # read just before the sample: the others' figures are fresh
    for r in (a, b):  # three of the twelve done
        r.observe_engine(2_000, now=5.0, fresh_for=100.0, waiting=0, running=9)
    # 10 and 2 candidates share an excess of 3: 2 and 0 (rounded down), never more than 3 together.
    assert (a.engine_finished, b.engine_finished) == (2, 0)


def test_the_engine_correction_reads_the_others_kv_as_theirs() -> None:
    a = budget(capacity=100_000)
    a.share_through_store(fallback_share=0.5)
    a.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    a.admit("a", 1_000, 0, now=0.0)
    a.observe_peers(Peers(ReplicaShare(booked=3_000, held=3_000, settled=3), 1), now=3.0)
    a.observe_engine(4_500, now=3.0, fresh_for=100.0, waiting=1, running=4)
    assert a.unexplained_tokens == 500  # 4,500 in use, 1,000 and 3,000 explained
    a.observe_engine(800, now=4.0, fresh_for=100.0, waiting=0, running=4)
    # Downward the whole gauge counts: the others' floor is one exchange old, and may have been released.
    assert a.unexplained_tokens == -200


def test_without_the_others_figures_the_downward_correction_reads_the_whole_gauge() -> None:
    r = budget(capacity=100_000, share=0.5)
    r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    r.admit("a", 1_000, 0, now=0.0)
    # 1,500 in use in the pool: half of it is not proof that this replica's 1,000 holds only 750.
    r.observe_engine(1_500, now=3.0, fresh_for=100.0, waiting=0, running=2)
    assert r.unexplained_tokens == 0


def test_a_replica_publishes_its_booking_without_the_pools_correction() -> None:
    r = budget(capacity=100_000)
    r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    r.admit("a", 1_000, 1_000, now=0.0)
    r.observe_engine(50_000, now=3.0, fresh_for=100.0, waiting=0, running=1)
    share = r.replica_share(3.0)
    assert r.booked_tokens > 40_000  # the pool's unexplained KV is in this replica's own booking
    assert share.booked == 2_000 and share.settled == 1


def test_a_replica_that_releases_keeps_only_its_part_of_the_room_while_another_wants_it() -> None:
    """Its queue woken by its own release, a busy replica took all of the freed room back before the other
    replica heard of it, and the other replica's waiters starved."""
    busy, other = budget(), budget()
    for r in (busy, other):
        r.share_through_store(fallback_share=0.5)
        r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    for i in range(9):
        busy.admit(f"a{i}", 500, 500, now=0.0)
    other.admit("b0", 500, 500, now=0.0)
    exchange(busy, other, 0.001)
    assert not other.would_fit(500, 500, now=0.002)[0]  # the cache is full: the other replica wants KV
    exchange(busy, other, 0.003)
    busy.release("a0", 500)
    busy.release("a1", 500)  # 2,000 freed while the other replica wants KV: 1,000 of it is busy's
    assert busy.would_fit(500, 500, now=0.004)[0]
    busy.admit("a9", 500, 500, now=0.004)
    assert busy.budget_tokens == 8_000  # its half of what it released, however often it asks
    exchange(busy, other, 0.005)
    assert other.budget_tokens == 1_000 + 500  # the other half free, and the busy one may take half of it
    assert other.would_fit(250, 250, now=0.006)[0]


def test_one_replica_with_all_the_traffic_fills_nearly_the_whole_target() -> None:
    """A replica with no request for `YIELD_AFTER_S` yields its part of the free room: the busy one beside it
    takes all but a sliver at each exchange. Half of it left to the idle one held the busy one at 90 % of one
    gateway's throughput on the simulator (every client on one of two gateways)."""
    busy, idle = budget(), budget()
    for r in (busy, idle):
        r.share_through_store(fallback_share=0.5)
        r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    admitted = 0
    for step in range(8):
        now = YIELD_AFTER_S + step * 0.01
        busy.would_fit(0, 0, now=now)  # the busy replica decides all along; the idle one never
        exchange(busy, idle, now)
        while busy.would_fit(500, 500, now=now)[0]:
            busy.admit(f"a{admitted}", 500, 500, now=now)
            admitted += 1
    assert state(idle.fleet) is Claim.YIELDED and state(busy.fleet) is Claim.FULL
    assert admitted == 9  # 9,000 of 10,000; a fixed half would be 5,000, half of each free room 8,000
    # The idle replica meets a request: its sliver (50 of the 1,000 free) does not hold it, so it asks.
    now = YIELD_AFTER_S + 0.1
    assert not idle.would_fit(200, 200, now=now)[0]
    assert state(idle.fleet) is Claim.ASKING and idle.fleet.must_publish
    exchange(busy, idle, now)  # the ask goes out; the busy replica's figures in that answer predate it
    assert state(idle.fleet) is Claim.ASKING and busy.fleet.must_publish  # it owes the asker a publication
    exchange(busy, idle, now + 0.01)  # its figures were taken before it took in an answer after the ask
    assert state(idle.fleet) is Claim.ASKING
    exchange(busy, idle, now + 0.02)  # now they were: the asker takes its half of what is free
    assert state(idle.fleet) is Claim.FULL
    assert 450 <= (idle.budget_tokens or 0) <= 550 and idle.would_fit(200, 200, now=now + 0.02)[0]


def test_a_replica_that_decided_lately_does_not_yield() -> None:
    """Yielding is for a replica with no request at all: one that admits a few keeps its part."""
    fleet = Fleet()
    fleet.share_through_store(0.5)
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=10, oldest_ms=5), now=0.0)
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=20, oldest_ms=11), now=0.0)
    fleet.decided(1.0)
    assert fleet.publishing(1.0 + YIELD_AFTER_S - 0.01) == 0 and state(fleet) is Claim.FULL
    assert fleet.publishing(1.0 + YIELD_AFTER_S) == 1 and state(fleet) is Claim.YIELDED


def test_an_asking_replica_keeps_to_its_sliver_until_every_other_has_published_since() -> None:
    """The others count on the room a yielded replica left them until they have read its ask: it takes its
    part only once the oldest of their publications is later than the exchange that carried it."""
    fleet = Fleet()
    fleet.share_through_store(0.5)
    others = ReplicaShare(booked=2_000)
    fleet.observe(Peers(others, 2, now_ms=100, oldest_ms=90), now=0.0)  # carries the ask (never yielded)
    assert state(fleet) is Claim.ASKING
    assert fleet.budget(10_000, 1.0, 0.0) == int(8_000 * YIELDED_PART)
    fleet.observe(Peers(others, 2, now_ms=150, oldest_ms=100), now=0.1)  # one other has not published since
    assert state(fleet) is Claim.ASKING
    fleet.observe(Peers(others.plus(ReplicaShare(yielding=1)), 2, now_ms=200, oldest_ms=101), now=0.2)
    assert state(fleet) is Claim.FULL
    # One of the two others yields: this one and the other busy one divide what its sliver leaves.
    assert fleet.budget(10_000, 1.0, 0.2) == int(8_000 * (1 - YIELDED_PART) / 2)


def test_a_peer_that_published_after_the_ask_without_having_read_it_is_waited_for() -> None:
    """Published after the ask is not read it: a peer whose answer was lost counts on the yielded room still.
    The asker waits for figures taken after the peer had taken in an answer later than the ask."""
    fleet = Fleet()
    fleet.share_through_store(0.5)
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=100, oldest_ms=50), now=0.0)  # the ask, at 100
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=150, oldest_ms=90), now=0.1)  # it published at 120, say
    assert state(fleet) is Claim.ASKING
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=200, oldest_ms=130), now=0.2)  # it took in an answer of 130
    assert state(fleet) is Claim.FULL


def test_a_lone_replica_yields_to_nobody_and_an_unshared_one_publishes_nothing() -> None:
    fleet = Fleet()
    fleet.share_through_store(0.5)
    fleet.observe(Peers(ReplicaShare(), 0, now_ms=100, oldest_ms=-1), now=0.0)
    assert state(fleet) is Claim.FULL
    assert fleet.publishing(YIELD_AFTER_S * 10) == 0  # quiet, but nobody else could take the room
    alone = Fleet()
    alone.decided(0.0)
    assert not alone.must_publish


def test_a_replica_short_of_its_part_keeps_to_its_sliver_while_the_others_may_count_on_it() -> None:
    """The store lost, a yielded replica that fell back to its fixed share at once would take the room the
    others count on until its figures expire there (`REPLICA_TTL_S`)."""
    fleet = Fleet()
    fleet.share_through_store(0.5)
    fleet.observe(Peers(ReplicaShare(), 1, now_ms=100, oldest_ms=50), now=0.0)  # asking
    assert state(fleet) is Claim.ASKING
    assert fleet.budget(10_000, 1.0, PEERS_FRESH_S + 1.0) == int(10_000 * YIELDED_PART)
    assert fleet.budget(10_000, 1.0, REPLICA_TTL_S + 0.1) == 5_000  # its figures gone: the fallback share


def test_an_ask_among_replicas_that_all_yield_is_heard_at_once() -> None:
    """A yielded replica takes its sliver until it has heard the asker again, so only the others that do not
    yield must have read the ask: with every other yielding, the exchange that carries the ask grants it."""
    fleet = Fleet()
    fleet.share_through_store(0.5)
    fleet.observe(Peers(ReplicaShare(yielding=1), 1, now_ms=100, oldest_ms=-1), now=0.0)
    assert state(fleet) is Claim.FULL
    assert fleet.budget(10_000, 1.0, 0.0) == int(10_000 * (1 - YIELDED_PART))


def test_a_request_refused_while_its_replica_asks_is_told_to_come_back_soon() -> None:
    """Refused on its sliver, a request need wait only for the others to hear the ask; and the replica,
    having told it when to come back, does not yield before then."""
    r = budget()
    r.share_through_store(fallback_share=0.5)
    r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    r.observe_peers(Peers(ReplicaShare(booked=2_000), 1, now_ms=10, oldest_ms=5), now=0.0)
    r.admit("a", 100, 100, now=0.0)
    assert state(r.fleet) is Claim.ASKING and not r.would_fit(2_000, 2_000, now=0.0)[0]
    assert r.retry_after(0.0) == ASKING_HINT_S
    # Its promise is planned on the half it takes once heard, not on its sliver: a promise due later than its
    # client's return would stand in the way of its other clients.
    assert r.fleet.release_part(0.0) == pytest.approx(0.5)
    heard(r, ReplicaShare(booked=2_000), 1, now=0.1)
    assert r.fleet.publishing(ASKING_HINT_S + YIELD_AFTER_S - 0.01) == 0


def test_even_traffic_never_books_past_the_pool_together() -> None:
    a, b = budget(), budget()
    for r in (a, b):
        r.share_through_store(fallback_share=0.5)
        r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    admitted = {"a": 0, "b": 0}
    for i in range(40):
        now = i * 0.01
        exchange(a, b, now)
        for name, r in (("a", a), ("b", b)):
            if r.would_fit(500, 500, now=now)[0]:
                r.admit(f"{name}{i}", 500, 500, now=now)
                admitted[name] += 1
        assert a.demand_tokens + b.demand_tokens <= 10_000
    assert admitted["a"] >= 3 and admitted["b"] >= 3, admitted


def test_a_refused_client_is_sent_back_when_the_other_replicas_leases_end() -> None:
    """A replica's hints counted its own leases alone: one holding a single long answer sent its clients
    back at that answer's end, while the other replica's ends freed the room, which that replica's own
    clients, sent back at those very moments, took (without a queue, 171 answers to one gateway's fifteen
    clients and 19 to the other's). Now the others' forecast ends (`ReplicaShare.frees`) count, at this
    replica's part of the room they free, and it reads the store again when its client comes back."""
    busy, quiet = budget(), budget()
    for r in (busy, quiet):
        r.share_through_store(fallback_share=0.5)
        r.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    for i in range(9):
        busy.admit(f"a{i}", 500, 500, now=0.0)  # 9,000 of 10,000, each ends after ~5 s of answer
    quiet.admit("b0", 100, 900, now=0.0)  # ~9 s
    for t in (0.01, 0.02, 0.03):
        exchange(busy, quiet, t)
    assert state(busy.fleet) is Claim.FULL and state(quiet.fleet) is Claim.FULL
    peers = quiet.fleet.peers(0.04)
    assert peers is not None
    frees = peers.share.frees  # as read at 0.03: the busy replica's ends, by horizon
    first_end = FREE_HORIZONS_S[next(i for i, freed in enumerate(frees) if freed)]
    assert not quiet.would_fit(500, 500, now=0.04)[0]
    hint = quiet.retry_after(0.04)
    assert hint is not None and hint < 8.0  # not its own end (~9 s)
    assert hint == pytest.approx(first_end - 0.01 + OTHERS_LAG_S)
    assert quiet.fleet.take_reads() == [pytest.approx(0.04 + hint - PUBLISH_EVERY_S, abs=PUBLISH_EVERY_S)]
    assert quiet.fleet.take_reads() == []  # handed out once
    for i in range(9):
        busy.release(f"a{i}", 500)
    exchange(busy, quiet, 0.04 + hint - PUBLISH_EVERY_S)  # the read due then
    assert quiet.would_fit(500, 500, now=0.04 + hint)[0]


def test_a_replica_beside_another_plans_on_its_part_of_its_own_releases() -> None:
    """What a replica releases is free room that the other, wanting it too, may take half of (`Fleet.budget`):
    its refused client, sent back at its first release, found half the room there and was refused again."""
    busy, other = budget(), budget()
    for r in (busy, other):
        r.share_through_store(fallback_share=0.5)
        r.would_fit(0, 0, now=0.0)  # deciding: neither yields (no engine sample: lifetimes are booked)
    for i in range(10):  # the whole pool, the answers ending one after another
        busy.admit(f"a{i}", 900 - 50 * i, 100 + 50 * i, now=0.0)
    for t in (0.01, 0.02, 0.03):
        exchange(busy, other, t)
    assert state(busy.fleet) is Claim.FULL and state(other.fleet) is Claim.FULL
    assert busy.fleet.release_part(0.04) == pytest.approx(0.5)
    assert not busy.would_fit(500, 500, now=0.04)[0]
    hint = busy.retry_after(0.04)
    assert hint is not None and hint > 1.25  # the second end (~1.5 s at 100 tokens/s), not the first (~1 s)
    busy.release("a0", 100)
    assert not busy.would_fit(500, 500, now=0.04 + 1.0)[0]  # at the first end: half of its 1,000
    busy.release("a1", 150)
    assert busy.would_fit(500, 500, now=0.04 + hint)[0]
