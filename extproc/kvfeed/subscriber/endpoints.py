"""One engine of a pool read on its own: what a KV budget that books that engine alone is fed.

Where an inference pool's picker runs before the sidecar and names the engine a request goes to
(extproc/admission/intake/endpoint.py), the request is booked on that engine's KV budget, not the pool's:
a picker that concentrates work on one engine (a popular prefix) fills that engine while the pool's sum has
room. Such a budget reads its engine as a pool of one: the engine's newest sample aggregated alone (its
capacity, KV in use, running and waiting, pace, block size) and its own prompt counter, the evidence the
downward correction takes (`KvBudget.observe_engine`). And what such a request is charged where its answer was
not seen whole comes from that engine's generation counter alone (`tally`): the pool's tally splits every
engine's growth between every run, a picked request's only between the runs on its engine.

An engine's tally is made at the first request booked there, not for every engine the feed reads (each holds
up to `tally.MAX_POINTS` points), and starts from the engine's newest sample, so that first request's run
begins after a reading. Pure: the caller passes `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Set

from extproc.core.engine.counter import PoolCounter
from extproc.core.engine.tally import EngineTally
from extproc.kvfeed.sample import FeedSample
from extproc.kvfeed.subscriber.aggregate import PoolSnapshot, StoredSample, aggregate
from extproc.kvfeed.subscriber.settings import KvMode

EngineKey = tuple[str, str]  # (pool, endpoint)


class EndpointReadings:
    """The newest sample and the prompt counter of every engine the feed reads, by pool and endpoint."""

    __slots__ = ("_latest", "_prompted", "_read_at", "_tallies")

    def __init__(self) -> None:
        self._latest: dict[EngineKey, StoredSample] = {}
        self._read_at: dict[EngineKey, float] = {}  # when the newest sample was read (`ReadTimes`)
        self._prompted: dict[EngineKey, PoolCounter] = {}
        self._tallies: dict[EngineKey, EngineTally] = {}

    def observe(self, sample: FeedSample, received_at: float, read_at: float) -> None:
        """A sample the subscriber stored at `received_at`, read by its exporter at `read_at` (`ReadTimes`):
        the engine's newest, its prompt counter's reading (a down sample, or one without the counter, makes
        the next reading a new baseline), and its tally's, if it has one."""
        key = (sample.model, sample.endpoint)
        self._latest[key] = StoredSample(sample, received_at)
        self._read_at[key] = read_at
        tally = self._tallies.get(key)
        if tally is not None:
            read_generated(tally, sample.endpoint, sample, read_at)
        counter = self._prompted.get(key)
        if counter is None and prompted_in(sample):
            counter = self._prompted[key] = PoolCounter()
        if counter is not None:
            read_prompted(counter, sample.endpoint, sample)

    def snapshot(
        self, pool: str, endpoint: str, now: float, stale_after: Callable[[str], float], kv_mode: KvMode
    ) -> PoolSnapshot | None:
        """The engine read as a pool of one at `now` (stale when its newest sample is), None unknown."""
        stored = self._latest.get((pool, endpoint))
        if stored is None:
            return None
        return aggregate((stored,), now, stale_after, kv_mode).get(pool)

    def prompted(self, pool: str, endpoint: str) -> float | None:
        """The prompt tokens the engine prefilled since the feed first read it; None without a reading."""
        counter = self._prompted.get((pool, endpoint))
        return counter.total if counter is not None and counter.known else None

    def tally(self, pool: str, endpoint: str) -> EngineTally | None:
        """The engine's generation counter over time, made at the first ask from its newest sample; None
        for an engine the feed has not read."""
        key = (pool, endpoint)
        tally = self._tallies.get(key)
        stored = self._latest.get(key)
        if tally is None and stored is not None:
            tally = self._tallies[key] = EngineTally()
            read_generated(tally, endpoint, stored.sample, self._read_at[key])
        return tally

    def keep(self, known: Set[EngineKey]) -> set[EngineKey]:
        """Forget every engine not in `known` (the subscriber forgot it): memory follows the fleet. The
        engines forgotten."""
        gone = {key for key in self._latest if key not in known}
        for held in (self._latest, self._read_at, self._prompted, self._tallies):
            for key in [k for k in held if k not in known]:
                del held[key]
        return gone


def generated_in(sample: FeedSample) -> bool:
    """Whether `sample` carries what a tally reads: up, with the generation counter and the running count."""
    return sample.up and sample.generation_tokens_total is not None and sample.requests_running is not None


def read_generated(tally: EngineTally, endpoint: str, sample: FeedSample, at: float) -> None:
    """One endpoint's reading at `at` into a tally (a pool's, `FeedbackLoop._tally`, or one engine's): a down
    sample changes nothing (the growth over the gap counts at the next reading), one without the counter or
    the running count makes the next reading a new baseline."""
    if not sample.up:
        return
    generated, running = sample.generation_tokens_total, sample.requests_running
    if generated is None or running is None:
        tally.forget(endpoint)
        return
    waiting = sample.requests_waiting if sample.requests_waiting is not None else 0.0
    tally.observe(endpoint, generated, running, at, waiting)


def prompted_in(sample: FeedSample) -> bool:
    """Whether `sample` carries the prompt counter a `PoolCounter` reads (and is up)."""
    return sample.up and sample.prompt_tokens_total is not None


def read_prompted(counter: PoolCounter, endpoint: str, sample: FeedSample) -> None:
    """One endpoint's prompt counter into a sum (a pool's, or one engine's): a down sample, or one without
    the counter, makes its next reading a new baseline."""
    value = sample.prompt_tokens_total
    if not sample.up or value is None:
        counter.forget(endpoint)
    else:
        counter.observe(endpoint, value)
