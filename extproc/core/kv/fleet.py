"""One pool's KV budget across the gateway replicas that admit into it: what each replica tells the others.

Several replicas in front of one engine pool share its KV cache. A fixed fraction each (`capacity_share`,
1/replicas) splits the cache whatever the traffic: a replica holding every client fills half the cache while
the other half stands idle behind the other replica. And every inference a budget draws from the engine's
pool-wide gauges (`KvBudget.observe_engine`: KV in use beyond what its leases explain, running sequences fewer
than its settled leases) reads another replica's requests as its own: with 10 and 2 requests running on two
replicas and the running count scaled by one half, the busy one counted 6 running, took 4 of its running
leases for finished and gave their slots back while they ran.

So each replica publishes its figures of each pool (`ReplicaShare`) through the shared store, and reads the
sum of the others' (`Peers`, the store's `KvBoard`): a replica's budget is what it had booked at its last
exchange plus its part of the room nobody had booked, so the cache is divided by demand; and the engine's
counts are read against the leases of every replica. Where the others are unknown (a store that is not shared,
or one that cannot be reached) a budget falls back to a fixed share, and reads the engine's counts as if every
running sequence could be another replica's: it finds fewer of its own leases finished, never more (`Fleet`).

The figures are published after each change of a budget (at most every `PUBLISH_EVERY_S`) and at each feed
sample, so between two exchanges a replica does not see what the others admit. Taking all the free room each
time, two replicas with queues that both woke at a release took the same room: on the simulator, two gateways
at 50/50 preempted 9 times in a minute (KV peak 1.0). So the free room is divided between the live replicas:
alone, a replica takes all of it; beside another, half at each exchange (the rest at the next ones, where the
other does not take it); together they never take more than there was. Counting only the replicas heard to
want KV, or to hold leases, was not enough: a replica is heard only at its next publication, and two gateways
whose bursts began at once each took the whole cache.

Half of each exchange's free room left to a replica that admits nothing cost the busy one the room of about
two requests (90 % of one gateway's throughput with every client on one of two gateways). So a replica quiet
for `YIELD_AFTER_S` yields (`Claim`): it publishes that it takes only a sliver (`YIELDED_PART`) of the free
room, and the others divide the rest. Yielding is safe at once (it takes less); taking its part back is not,
so a yielded replica that meets a request asks first: it publishes that it no longer yields and keeps to its
sliver until every other replica that does not yield has published figures taken after it had read the ask
(`ReplicaShare.heard_ms`: the store's time of the last answer it had taken in; `Peers.oldest_ms`). Published
after the ask is not enough: a replica whose answer was lost, or still on its way, counts on the yielded room
still, and may have booked on it since it took its figures. However the exchanges interleave, the parts the
replicas take of the room they saw sum to at most one. A replica short of its full part that loses the store
keeps to its sliver while the others may still count on the room it left (`REPLICA_TTL_S`).

A refused client is told when its replica will have room: after its own releases and the others', each at
the part of it this replica may take (`releases`). So each replica also publishes when its leases' forecast
ends free their room (`ReplicaShare.frees`, by fixed horizons the store can sum), and reads the others' again
when its client is due back (`take_reads`): counting its own ends alone, a replica holding few of the cache's
leases sent its clients back at those, and the busy one's clients took the room the others' ends freed.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from extproc.core.kv.order import FleetOrder

PUBLISH_EVERY_S = 0.05
"""The shortest interval between two publications of one pool's figures by one replica: a burst of decisions
is published once per interval, not once per decision."""

PEERS_FRESH_S = 3.0
"""How long the others' figures, as last read from the store, are trusted: past that (the store unreachable)
a budget books on its fallback share again. Three feed samples."""

COUNTS_FRESH_S = 0.25
"""How recent the others' figures must be for the engine's running count to be read against their leases
(`Fleet.finished_allowance`): a replica publishes within `PUBLISH_EVERY_S` of a change, so a read this recent
has what they ended."""

YIELD_AFTER_S = 2.0
"""How long a replica has made no KV decision (no request checked against its budget) before it yields its
part of the free room to the others: two feed samples, longer than the gap between a few clients' requests."""

YIELDED_PART = 0.05
"""The part of the free room a yielded (or asking) replica may still take at each exchange: enough for a small
request without asking, and little enough that the busy replicas beside it take nearly all of the room."""

ASKING_HINT_S = 1.0
"""The most a request refused while its replica asks for its part is told to wait (`KvBudget.retry_after`):
the others answer an ask at their next publication, at the latest their next feed sample."""

REPLICA_TTL_S = 5.0
"""How long a replica's published figures count after their publication: a replica that died, or lost the
store, stops holding KV in the others' budgets after this."""

FREE_HORIZONS_S = (
    0.25,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    12.0,
    15.0,
    20.0,
    25.0,
    30.0,
)
"""The moments after its publication at which a replica says how much of its booking its leases' forecast
ends will have freed (`ReplicaShare.frees`): the same for every replica, so the store sums them. A release
counts at the first horizon at or after it, so a client sent back on it comes at most a step late: a quarter
of a second near, at most a quarter of the wait further out; none past what an SDK waits."""

NO_FREES = (0,) * len(FREE_HORIZONS_S)

OTHERS_LAG_S = 2 * PUBLISH_EVERY_S
"""How long after another replica's lease ends this replica can count on its part of the room: the other
publishes within `PUBLISH_EVERY_S` of the change, and this one reads at the moment it told its client to
come back (`Fleet.take_reads`), the store's round trip ahead of it."""

READS_WITHIN_S = FREE_HORIZONS_S[-1] + OTHERS_LAG_S
"""The furthest a refused client's return gets a read planned (`Fleet.told`): no later moment comes from the
others' published ends, so at most one read per `PUBLISH_EVERY_S` up to this is ever pending per pool."""

READS_KEPT = 64
"""The most reads one pool's budget keeps due at once (`Fleet.take_reads`): more refused clients than that
within one horizon share the reads already due around their moments."""


@dataclass(frozen=True, slots=True)
class ReplicaShare:
    """One replica's figures of a pool, in tokens and sequences, as `KvBudget.replica_share` computes them:

    - `booked`: the forecast peak of its leases (or their lifetime footprints), without the engine correction
      (the pool's own, which every replica computes alike);
    - `held`: the KV its leases explain now (prompt less shared chunks, plus tokens generated);
    - `settled`: the sequences of its leases admitted long enough ago to be in the engine's gauges, which the
      engine runs unless it has finished them;
    - `candidates`: of those, the sequences that may be finished (a stalled stream, an answer nobody sees);
    - `yielding`: 1 while it yields its part of the free room (`Claim.YIELDED`), else 0 (summed: how many);
    - `heard_ms`: the store's time (ms) of the last answer it had taken in when these were taken: what asks it
      has read (not summed: `Peers.oldest_ms` is the least over the others that do not yield);
    - `frees`: of `booked`, what its leases' forecast ends will have freed by each of `FREE_HORIZONS_S` after
      these were taken (cumulative): when the others' refused clients may find room;
    - `head_ms`: the store's time stamped on its oldest request waiting for the pool's KV, 0 with none
      (`FleetOrder`; not summed: the store compares them, `Peers.bound`).
    """

    booked: int = 0
    held: int = 0
    settled: int = 0
    candidates: int = 0
    yielding: int = 0
    heard_ms: int = field(default=0, compare=False)
    frees: tuple[int, ...] = NO_FREES
    head_ms: int = field(default=0, compare=False)

    def plus(self, other: ReplicaShare) -> ReplicaShare:
        """The sum of two replicas' figures (`heard_ms` and `head_ms` are not sums: left out)."""
        booked, held, settled, candidates, yielding = (
            a + b for a, b in zip(self.fields(), other.fields(), strict=True)
        )
        frees = tuple(a + b for a, b in zip(self.frees, other.frees, strict=True))
        return ReplicaShare(booked, held, settled, candidates, yielding, frees=frees)

    def fields(self) -> tuple[int, int, int, int, int]:
        return (self.booked, self.held, self.settled, self.candidates, self.yielding)


def frees_by(releases: Iterable[tuple[float, int]], booked: int) -> tuple[int, ...]:
    """`ReplicaShare.frees` of a replica whose leases free `releases` (seconds from now, tokens): what they
    have freed by each of `FREE_HORIZONS_S`, at most `booked` (its forecast peak: what the others count).
    A footprint freed before the peak lowers the peak by less: hints only, and they plan a replica's own
    releases the same way; its refused clients find out at their return and are planned again."""
    freed = [0] * len(FREE_HORIZONS_S)
    for seconds, tokens in releases:
        first = bisect.bisect_left(FREE_HORIZONS_S, seconds)
        if first < len(freed):
            freed[first] += tokens
    total, out = 0, []
    for tokens in freed:
        total += tokens
        out.append(min(total, max(0, booked)))
    return tuple(out)


NOBODY = ReplicaShare()
"""The others' figures when there are no others."""


@dataclass(frozen=True, slots=True)
class Peers:
    """The sum of the other live replicas' figures of a pool, as the store last answered, and how many; and,
    in the store's clock (ms), when it answered (`now_ms`) and the least `heard_ms` of the others that do
    not yield (`oldest_ms`, -1 where none does): an ask is heard once that is later than the ask's own
    exchange. A replica that says it yields takes only its sliver until it has heard this one again, so it
    need not have read the ask; nor need one of a version before yielding (it never counts on a yielded
    part). `bound`: the first stamp (ms) of this replica's waiting requests that does not come before every
    other replica's head (the least of them, ties to the lesser name), 0 where no other has a head, -1
    where the store does not order them (`FleetOrder`); `heard_all_ms`, as `oldest_ms` over every other
    replica, yielding or not: a yielded replica's request may wait too, stamped before it read a run.
    The times and `bound` are when and where, not what: left out of equality."""

    share: ReplicaShare = NOBODY
    replicas: int = 0
    now_ms: int = field(default=0, compare=False)
    oldest_ms: int = field(default=0, compare=False)
    bound: int = field(default=-1, compare=False)
    heard_all_ms: int = field(default=-1, compare=False)


class Claim(Enum):
    """What a replica takes of the free room at each exchange (`Fleet.budget`)."""

    FULL = "full"
    """Its part: the room less the yielded replicas' slivers, divided between those that do not yield."""
    YIELDED = "yielded"
    """Quiet for `YIELD_AFTER_S`: a sliver (`YIELDED_PART`); the others count on the rest."""
    ASKING = "asking"
    """It wants its part again (or has just started): the sliver until every other replica has published
    after its ask, and so stopped counting on the room it yielded."""


class Fleet:
    """How one pool's budget sees the other replicas: alone (no shared store: the configured fixed share),
    or shared (the store's `Peers`, or, while they are unknown, the fallback share)."""

    def __init__(self) -> None:
        self.shared = False
        self.fallback_share = 1.0
        self._peers: Peers | None = None
        self._read_at: float | None = None
        self._own_at_read = 0  # what this replica had booked at the exchange the peers came with
        self._own_low = 0  # the least it has booked since (`budget`): what it released meanwhile
        self.claim = Claim.ASKING  # a replica that starts takes its part once the others have heard of it
        self._asked_ms: int | None = None  # the store's time of the exchange that carried the ask
        self._sent_yielding = False  # what its last published figures said
        self._decided_at: float | None = None  # its latest KV decision (`decided`)
        self._reads: set[float] = set()  # when refused clients come back: the others read by then (`told`)
        self._owes_ack = False  # another replica asked (or joined) since this one last published
        self.heard_ms = 0  # the store's time of the last answer taken in (`ReplicaShare.heard_ms`)
        self.order = FleetOrder()  # where its requests waiting for KV stand in the fleet

    def share_through_store(self, fallback_share: float) -> None:
        """Replicas share this pool through a store; `fallback_share` of the pool is this replica's while the
        store cannot say what the others hold (`store.fallback_share`, 1/replicas)."""
        if not 0.0 < fallback_share <= 1.0:
            raise ValueError(f"store.fallback_share: must be in (0, 1], got {fallback_share}")
        self.shared = True
        self.fallback_share = fallback_share

    def expect(self, replicas: int, now: float) -> None:
        """Before its first exchange, the store is known to hold `replicas` other live replicas of the pool
        (one engine's budget, made at the first request a picker sent there: its pool's budget knows them),
        which may book here at any moment: it asks (its sliver) until its first exchange is answered, rather
        than take its fallback share, the whole of it by default. Nothing once the store has answered."""
        if self.shared and self._peers is None and replicas > 0:
            self._peers, self._read_at = Peers(replicas=replicas), now
            self._asked_ms = 0  # its ask goes out with its first exchange, heard once every other has
            # published after it (`_heard`)

    def observe(self, peers: Peers | None, now: float, own_booked: int = 0) -> None:
        """The store's answer at `now` (None: it did not answer) to an exchange in which this replica had
        booked `own_booked`."""
        if peers is not None:
            self.order.observe(peers.now_ms, peers.heard_all_ms, peers.bound)
            before = self._peers
            if before is not None and (
                peers.share.yielding < before.share.yielding or peers.replicas > before.replicas
            ):
                self._owes_ack = True  # the asker waits for this replica's next publication
            self._peers, self._read_at, self._own_at_read = peers, now, own_booked
            self._own_low = own_booked
            self.heard_ms = max(self.heard_ms, peers.now_ms)
            self._heard(peers)

    @property
    def must_publish(self) -> bool:
        """Whether this replica's figures should go out now rather than at its next change: while it asks (the
        ask, then again until the others have heard it), or another replica's ask it has not yet answered."""
        return self.shared and (self._owes_ack or self.claim is Claim.ASKING or self.order.unsent)

    def asking(self, now: float | None) -> bool:
        """Whether this replica books on its sliver while the others it knows hear its ask."""
        return self.claim is Claim.ASKING and self.peers(now) is not None

    def told(self, eta: float | None, now: float | None) -> float | None:
        """The `retry-after` of a request refused at `now`, expected to fit in `eta` seconds: refused on its
        sliver while the others hear the ask, it need wait only until then (`ASKING_HINT_S`); and a replica
        that told a client when to come back is not quiet before then, and reads the others' figures by
        then (`take_reads`): the room it counted on from their releases is its own only once read."""
        if self.asking(now):
            eta = ASKING_HINT_S if eta is None else min(eta, ASKING_HINT_S)
        if now is not None and eta is not None:
            self.decided(now + eta)
            peers = self.peers(now)
            others = peers is not None and peers.replicas > 0
            if others and eta <= READS_WITHIN_S and len(self._reads) < READS_KEPT:
                slot = math.ceil(
                    (now + eta - PUBLISH_EVERY_S) / PUBLISH_EVERY_S
                )  # a read per interval at most
                self._reads.add(slot * PUBLISH_EVERY_S)
        return eta

    @property
    def reads_due(self) -> bool:
        """Whether a refused client was told to come back at a moment no read is planned for yet."""
        return bool(self._reads)

    def take_reads(self) -> list[float]:
        """The moments (the budget's clock) at which refused clients come back, less a round trip: the
        exchange reads the others' figures then (`FleetExchange`). Each moment is handed out once."""
        reads, self._reads = sorted(self._reads), set()
        return reads

    def releases(self, now: float | None) -> tuple[list[tuple[float, int]], float]:
        """What a refusal's `retry-after` plans on besides this replica's own releases: the others'
        (`others_releases`), and the part of its own it may book again (`release_part`)."""
        return self.others_releases(now), self.release_part(now)

    def release_part(self, now: float | None) -> float:
        """What of a release this replica may book again before the others could take it: all, alone or with
        the others unknown (its fallback share is fixed); else its part of the free room, its own releases
        as the others' (`budget`: what it released since the exchange is free room too). Planned whole, its
        own ends sent its clients back when half the room was there, to be refused again. An asking replica
        plans on the part it takes once heard (`_full_part`): its client is told to come back by then, and
        a promise planned on its sliver would stand, due later, in the way of its other clients."""
        peers = self.peers(now)
        return 1.0 if peers is None else self._full_part(peers)

    def others_releases(self, now: float | None) -> list[tuple[float, int]]:
        """The room the other replicas' forecast lease ends give this one (seconds from `now`, tokens): their
        summed `frees` as last read, less the time since, each its part of the room freed (`_full_part`), once
        read (`OTHERS_LAG_S`). Without them, a refused client's `retry-after` counted its own replica's
        leases alone: a replica with few of the cache's leases sent its clients back at their ends, and the
        busy one's clients, sent back at the moments the room it freed was there, took it: at 50/50
        without a queue, 171 answers to one gateway's 15 clients, 19 to the other's."""
        peers = self.peers(now)
        if peers is None or now is None or self._read_at is None:
            return []
        age, part = now - self._read_at, self._full_part(peers)
        releases, before = [], 0
        for horizon, freed in zip(FREE_HORIZONS_S, peers.share.frees, strict=True):
            if freed > before:
                releases.append((max(0.0, horizon - age) + OTHERS_LAG_S, math.floor((freed - before) * part)))
                before = freed
        return releases

    def _heard(self, peers: Peers) -> None:
        """An asking replica's ask went out with the first exchange that did not say it yields; it takes its
        part once every other replica that does not yield has published since (or there is none)."""
        if self.claim is not Claim.ASKING:
            return
        if self._asked_ms is None and not self._sent_yielding:
            self._asked_ms = peers.now_ms
        if self._asked_ms is not None and (peers.oldest_ms < 0 or peers.oldest_ms > self._asked_ms):
            self.claim, self._asked_ms = Claim.FULL, None

    def decided(self, now: float | None) -> None:
        """A request was checked against this replica's budget at `now`: a yielded replica asks for its part
        (it keeps to its sliver until the others have heard)."""
        if now is not None and (self._decided_at is None or now > self._decided_at):
            self._decided_at = now
        if self.claim is Claim.YIELDED:
            self.claim, self._asked_ms = Claim.ASKING, None

    def publishing(self, now: float) -> int:
        """This replica's figures are taken at `now` for the others: a replica with no KV decision for
        `YIELD_AFTER_S` yields from now on (safe at once: it takes less). Returns `ReplicaShare.yielding`."""
        quiet = self._decided_at is None or now - self._decided_at >= YIELD_AFTER_S
        others = self._peers is not None and self._peers.replicas > 0  # alone, it yields to nobody
        if self.claim is Claim.FULL and self.shared and quiet and others:
            self.claim = Claim.YIELDED
        self._sent_yielding = self.claim is Claim.YIELDED
        self._owes_ack = False
        return int(self._sent_yielding)

    def peers(self, now: float | None) -> Peers | None:
        """The others' figures; None while unknown: not shared, never read, or last read too long ago. A
        replica short of its full part trusts its last read until its own figures expire in the others'
        budgets (`REPLICA_TTL_S`): until then they may count on the room it left, so its fallback share
        would take that room twice."""
        if not self.shared or self._read_at is None:
            return None
        fresh_for = PEERS_FRESH_S if self.claim is Claim.FULL else REPLICA_TTL_S
        if now is not None and now - self._read_at > fresh_for:
            return None
        return self._peers

    def budget(
        self,
        target_tokens: float,
        ceiling: float,
        now: float | None,
        unexplained: float = 0.0,
        own_now: float | None = None,
    ) -> int:
        """Tokens this replica may book of the pool's `target_tokens` (capacity x target_utilization), the
        pool's `unexplained` KV included (the engine correction every replica adds alike):

        - shared, the others known: what it had booked at the exchange, plus its part of the room nobody had
          booked then (its `Claim`'s part: divided between the live replicas that do not yield), at most
          `ceiling` (`capacity_share`) of the target. What it released since (the least of `own_now`,
          what it books at each decision, since the exchange) is free room too, its part only: a replica
          whose queue wakes at its own release would otherwise take all of it back before the others hear of
          it, and starve them;
        - shared, the others unknown: the fallback share (and never above the ceiling);
        - alone: the ceiling, the configured fixed share, as before there was a fleet.
        """
        peers = self.peers(now)
        if peers is not None:
            if own_now is not None:
                self._own_low = min(self._own_low, math.ceil(own_now))
            free = target_tokens - self._own_at_read - unexplained - peers.share.booked
            released = self._own_at_read - self._own_low
            part = self._own_low + unexplained + (free + released) * self._part(peers)
            return math.floor(min(target_tokens * ceiling, part))
        share = min(ceiling, self.fallback_share) if self.shared else ceiling
        return math.floor(target_tokens * share)

    def _part(self, peers: Peers) -> float:
        """This replica's part of the free room (`Claim`). Every live replica that does not yield may admit at
        any moment: counting only those heard to be active, two gateways whose bursts came at once each took
        the whole cache (booked 28,504 tokens of 14,745 together, and the engine preempted) before either had
        heard of the other's; so a replica leaves its part only by saying so. Where requests wait, the
        replica whose head is the fleet's oldest takes all but the others' slivers, and they their slivers
        (`FleetOrder`)."""
        if self.claim is not Claim.FULL or self.order.behind:
            return YIELDED_PART
        if self.order.first:
            return max(YIELDED_PART, 1.0 - YIELDED_PART * peers.replicas)
        return self._full_part(peers)

    @staticmethod
    def _full_part(peers: Peers) -> float:
        """The part of the free room a replica that does not yield takes: the room less the yielded
        replicas' slivers, divided between those that do not yield."""
        yielded = min(peers.share.yielding, peers.replicas)
        return (1.0 - YIELDED_PART * yielded) / (1 + peers.replicas - yielded)

    def others_booked(self, now: float | None) -> int:
        peers = self.peers(now)
        return 0 if peers is None else peers.share.booked

    def running_mine(self, running: float, now: float | None) -> float:
        """Of the engine's running sequences, those that may be this replica's: all but the others' settled
        leases where they are known, else all (another replica's can be any of them)."""
        peers = self.peers(now)
        others = 0 if peers is None else peers.share.settled
        return max(0.0, running - others)

    def finished_allowance(self, settled: int, candidates: int, running: float, now: float | None) -> int:
        """How many of this replica's candidate sequences the engine may be taken to have finished: the pool's
        settled sequences beyond its running ones, divided between the replicas by their candidates (so the
        replicas together never find more finished than the engine's count says), where the others' figures
        were read within `COUNTS_FRESH_S`; else this replica's settled sequences beyond every running one
        (any of them may be another replica's). An older read is not enough: where the others ended
        requests since, their settled count left the pool's excess too high, and a replica took leases the
        engine still ran for finished."""
        peers = self.peers(now)
        read_at = self._read_at
        if peers is None or now is None or read_at is None or now - read_at > COUNTS_FRESH_S:
            return max(0, math.floor(settled - running))
        excess = settled + peers.share.settled - running
        everyone = candidates + peers.share.candidates
        if excess <= 0 or everyone <= 0:
            return 0
        return math.floor(excess * candidates / everyone)

    def held_by_others(self, now: float | None) -> float | None:
        """The KV the others' leases explain now; None when unknown."""
        peers = self.peers(now)
        return None if peers is None else float(peers.share.held)
