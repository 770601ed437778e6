"""An admitted request's run in its pool's engine tally, and the engines' count of an answer not seen whole.

`InFlight` holds one `EngineRun` from admission: it tells the pool's `EngineTally` (core/engine/tally.py)
when the request began and when the engine was done with it, so that the others counted beside it are
split by the time each ran as this sidecar saw them; and, where its answer was not seen to its end (nothing
of it came back, or a stream was left or cut), `count` waits for the feed to read the engines past its end
and gives its share of what they generated.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Hashable
from typing import TypeVar

from extproc.admission.vocabulary.usage import Usage
from extproc.core.engine.runon import RUN_ON_WAIT_S
from extproc.core.engine.tally import ENGINE_STOP_S, EngineTally

T = TypeVar("T")

ENGINE_COUNT_WAIT_S = 8.0
"""The longest a lease whose answer was not seen whole waits for that reading before it is charged by the
rules without a count: past `ENGINE_STOP_S`, the exporter's interval (1 s shipped, 2 s in the real-engine
tier), a scrape slowed by a saturated host and a sample delivered late (the reading is timed when it was read:
`kvfeed/subscriber/readtime.py`)."""

QUEUED_READING_S = 1.0
"""How much longer a count waits once `ENGINE_COUNT_WAIT_S` passed without its reading: a sidecar whose event
loop was held up past the wait (the real-engine tier's saturated host froze one 7.5 s) fires the timer
before it reads the samples queued behind it, and charged 44 answers of a flood by estimate so."""

PEERS_COUNT_WAIT_S = 20.0
"""The longest a count waits in all where its reading came but the other gateway replicas have not answered
since (`EngineTally.covers`: the store's exchange stalled, for 7-10 s at a time on the real-engine tier's
saturated host): counted on their last answer, a request took their runs since for its own; charged the
estimate instead, a fleet flood on that tier was charged 1.17 times what vLLM generated (54 answers). Within
`runon.RECENT_S`, so the run-ons since its stop are still kept when it is counted."""

MISSED_READING_SHARE = 0.5
"""A count below this share of the tokens that passed for the request is taken for a missed reading (an
endpoint that restarted or left the feed within the request's time, whose growth then was lost), not the
split's noise, and the request is charged by the rules for an answer without a count. A share of a flood's
count errs by a fifth either way for one request (a stream that passed 45 tokens counted 38, one that
passed 3 counted 8: the engine ran on until the abort reached it), never by half as measured; a share
under what passed is lifted to it (`EngineRun.charge`)."""


class EngineRun:
    """One request's `sequences` in its pool's tally from `start` (None: the pool has no tally), or in its
    engine's where a picker named the engine: then also in the pool's (`beside`), which counts it as a run it
    knows, not among the others' room that the pool's own requests might be charged for."""

    def __init__(
        self,
        tally: EngineTally | None,
        key: Hashable,
        start: float,
        sequences: int,
        beside: EngineTally | None = None,
    ) -> None:
        self.tally = tally
        self.key = key
        self.start = start
        self.sequences = sequences
        self.ran_on = 0.0  # what the engine ran on past the request's count (`count`), charged with it
        self.ran_on_charged = 0  # what of it the charge holds (`charge`: within the reservation)
        self._told = tuple(t for t in (tally, beside) if t is not None)  # the tallies its run is told to
        for told in self._told:
            told.begin(key, start, sequences)

    def end(self, at: float) -> None:
        """The engine is done with the request (it ended on the proxy, settled, or the feed found it done);
        the first call only counts."""
        for told in self._told:
            told.end(self.key, at)

    def ran_until(self, at: float) -> None:
        """The engine ran the request until `at`, later than its end was told (`EngineTally.ran_until`)."""
        for told in self._told:
            told.ran_until(self.key, at)

    def stopped_at(self, ended: float) -> float:
        """When the engine stopped the request that `ended` on the proxy: the end it was told first (the
        feed found the engine done while a slow client still read: its count must not take what others
        generated after that), moved later by `ran_until`, as the tally keeps it; else `ended`."""
        stop = None if self.tally is None else self.tally.stop_of(self.key)
        return ended if stop is None else stop

    def countable(self) -> bool:
        """Whether the tally reaches back to the request's start: its count can then be had."""
        return self.tally is not None and self.tally.reaches_back(self.start)

    def charge(self, counted: float | None, usage: Usage | None, cap: int) -> int | None:
        """The completion to charge from the engines' count of this request (`count`), of which `usage` passed
        (at most `cap`, its reservation); None where there is no count or it is a missed reading
        (`MISSED_READING_SHARE`). At least what certainly passed (`Usage.certain_completion`: a tokenizer's
        count of the text may exceed the engine's tokens), the difference taken off later shares of the pool
        (`EngineTally.charge`); to the nearest token: a share is a fraction of what others ran beside it,
        and rounding each up charged a flood more than the engines generated."""
        tally = self.tally
        passed, certain = (0, None) if usage is None else (usage.completion_tokens, usage.certain_completion)
        if tally is None or counted is None:
            return None
        own = counted - self.ran_on  # the count itself, without the run-on
        if own < passed * MISSED_READING_SHARE:
            return None
        floor = passed if certain is None else certain
        charged = min(cap, round(tally.charge(counted, floor)))
        self.ran_on_charged = max(0, charged - min(cap, round(max(own, floor))))
        return charged

    def count(self, stop: float, allowance: int) -> Awaitable[float | None]:
        """The tokens the engines generated for the request, which ended on the proxy at `stop`: once the
        feed has read them `ENGINE_STOP_S` past it, at most `ENGINE_COUNT_WAIT_S` (and `QUEUED_READING_S`)
        later, and the other gateway replicas answered since, at most `PEERS_COUNT_WAIT_S` later; None where
        neither came (the feed or the store stopped, or is slower than that). Where the engine may be running
        it on past that reading, what it generates then too, up to the request's `allowance` (its completion
        reservation; `runon.py`), once it stops, at most `RUN_ON_WAIT_S` later: `ran_on` says how much. The
        wait is registered now."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.tally is not None:
            self.tally.after(stop + ENGINE_STOP_S, functools.partial(_resolve, ready, None))
        return self._counted(stop, allowance, ready)

    async def _counted(self, stop: float, allowance: int, ready: asyncio.Future[None]) -> float | None:
        tally = self.tally
        if tally is None:
            return None
        await asyncio.wait({ready}, timeout=ENGINE_COUNT_WAIT_S)
        if not ready.done():
            await asyncio.wait({ready}, timeout=QUEUED_READING_S)
        if not ready.done() and tally.read_past(stop + ENGINE_STOP_S):  # the other replicas have not answered
            await asyncio.wait({ready}, timeout=PEERS_COUNT_WAIT_S - ENGINE_COUNT_WAIT_S)
        if not tally.covers(stop + ENGINE_STOP_S):
            return None
        counted = tally.count(self.start, stop, self.sequences, ENGINE_STOP_S, self.key)
        if counted is None:
            return None
        ran_on: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        done = functools.partial(_resolve, ran_on)
        tally.follow_run_on(self.key, (self.start, stop), self.sequences, allowance - counted, done)
        try:
            self.ran_on = await asyncio.wait_for(ran_on, RUN_ON_WAIT_S + ENGINE_COUNT_WAIT_S)
        except TimeoutError:  # the feed stopped reading the pool: what it was given so far
            self.ran_on = tally.run_ons.give_up(self.key)
        except asyncio.CancelledError:  # shutdown: it waits no more (`wait_for` cancelled `ran_on` too)
            tally.run_ons.give_up(self.key)
            raise
        return counted + self.ran_on


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)
