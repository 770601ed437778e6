"""Steps an engine ran after a request's count, charged to the requests that stopped (vLLM #54947).

A request whose answer was not seen whole is charged its share of the pool's generation counters up to a
reading `ENGINE_STOP_S` past its end (`tally.EngineTally.count`): the engine stops within a step of the
abort. An engine that misses the abort (vLLM issue #54947; the engine tier saw a 4,000-token answer decoded
whole over 12 s after its client left) or sees it seconds late (a saturated host) decodes on, up to the
answer's allowance. While any replica runs a request in the pool, the counts of the requests running share
those steps out among themselves (a run stopped within `SHOWN_AFTER_STOP_S` is taken for still running where
the running count has room); once none does, they are nobody's: a flood whose streams ran on past its end was
charged 0.75 of what the engine generated, with one replica as with two.

The pool's readings show them: sequences running beyond what every gateway replica holds running are
*lingering* (`TallyPoint.lingering`). A request counted while the newest reading shows more lingering than
the least its readings showed while it ran (its *baseline*: traffic sent around the gateway that ran
throughout, another stream's abort seen late) may be one of them, and its settlement waits here (`follow`),
holding its reservation a while longer. At each reading where no replica held a request running at either
end of the interval, the tokens of the lingering sequences above the lowest baseline waiting, at most as many
as the replicas have waiting, `generated x lingering / running`, are split between the replicas by the
sequences each has waiting (`RunFigures.left`, through the store) and, this replica's part, between its
waiting requests by their sequences, none past its room (the allowance less its count). A request stops
waiting at the first reading with no more lingering than its baseline (whatever ran on has stopped), its
room used, or `RUN_ON_WAIT_S` past its stop; then it is charged its count and what it took here.

Which of the waiting requests ran on is not known, only how many sequences did: each takes its part of the
tokens, so a flood is charged what the engine generated while one request may pay a little of another's
run-on (never past its own allowance). Traffic sent to the engine around the gateway that starts while a
request waits is taken for a run-on too where nothing of the gateway's runs, up to the waiting requests'
rooms, for `RUN_ON_WAIT_S` at most: only requests that ended unseen just before pay it, and at most their
allowance, what their reservation already holds.

Pure: the tally calls `observe` at each reading and `close` when the feed stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)

RUN_ON_WAIT_S = 60.0
"""The longest a counted request waits, past its stop, for the engine to stop running on (an answer decoded
to its allowance after its client left takes tens of seconds on a busy engine): past it, its settlement
takes what it was given so far, and the rest of a run-on goes uncharged."""

ROOM_EPSILON = 0.5
"""Less room than this (tokens) is none: the request's allowance is used."""


@dataclass(frozen=True, slots=True)
class Reading:
    """The pool at one reading as the run-on split needs it: tokens generated so far, sequences running; of
    them `lingering`, those no replica held running, and `live`, those every replica holds running."""

    at: float
    generated: float
    running: float
    lingering: float
    live: float


@dataclass(slots=True)
class _Waiting:
    """One counted request that may still run in the engine."""

    sequences: int
    stop: float
    baseline: float
    room: float
    done: Callable[[float], None]
    taken: float = 0.0

    @property
    def left(self) -> float:
        return self.room - self.taken


class RunOns:
    """One pool's counted requests waiting for the engine to stop running on (see the module docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[Hashable, _Waiting] = {}
        self._last: Reading | None = None

    @property
    def sequences(self) -> float:
        """The sequences waiting here: this replica's `RunFigures.left`."""
        return float(sum(w.sequences for w in self._waiting.values()))

    def follow(
        self,
        key: Hashable,
        stop: float,
        sequences: int,
        room: float,
        baseline: float,
        done: Callable[[float], None],
    ) -> None:
        """The request `key` was counted; `done(tokens)` is called with what it ran on, at once (0) where
        the newest reading shows no more lingering sequences than `baseline` (nothing stopped still runs)
        or it has no `room`."""
        last = self._last
        if room < ROOM_EPSILON or last is None or last.lingering <= baseline or key in self._waiting:
            _call(done, 0.0)
            return
        self._waiting[key] = _Waiting(max(1, sequences), stop, baseline, room, done)

    def observe(self, reading: Reading, peers_left: float) -> None:
        """A new reading of the pool: the interval since the last one split, the requests that stop waiting
        told. `peers_left`: the other replicas' sequences waiting (their `RunFigures.left`)."""
        last, self._last = self._last, reading
        if not self._waiting:
            return
        if last is not None and reading.at > last.at:
            self._split(self._run_on(last, reading, peers_left), peers_left)
        for key, waiting in list(self._waiting.items()):
            if (
                waiting.left < ROOM_EPSILON
                or reading.lingering <= waiting.baseline
                or reading.at - waiting.stop >= RUN_ON_WAIT_S
            ):
                del self._waiting[key]
                _call(waiting.done, waiting.taken)

    def _run_on(self, last: Reading, reading: Reading, peers_left: float) -> float:
        """The tokens generated between two readings that no count takes: where no replica held a request
        running at either end, those of the lingering sequences above the lowest baseline waiting, at most
        as many as the replicas have waiting, every running sequence taken at one pace (as
        `tally.EngineTally.count` takes them)."""
        grown = reading.generated - last.generated
        if grown <= 0.0 or last.live > 0.0 or reading.live > 0.0:
            return 0.0
        floor = min(w.baseline for w in self._waiting.values())
        lingering = (last.lingering + reading.lingering) / 2 - floor
        excess = min(self.sequences + max(0.0, peers_left), lingering)
        if excess <= 0.0:
            return 0.0
        return grown * excess / max(excess, (last.running + reading.running) / 2)

    def _split(self, tokens: float, peers_left: float) -> None:
        """This replica's part of `tokens`, between its waiting requests by their sequences, none past its
        room; what one cannot take goes to the others."""
        ours = self.sequences
        tokens *= ours / (ours + max(0.0, peers_left))
        open_ = [w for w in self._waiting.values() if w.left >= ROOM_EPSILON]
        while tokens > 1e-9 and open_:
            each = tokens / sum(w.sequences for w in open_)
            for waiting in open_:
                given = min(waiting.left, each * waiting.sequences)
                waiting.taken += given
                tokens -= given
            open_ = [w for w in open_ if w.left >= ROOM_EPSILON]

    def give_up(self, key: Hashable) -> float:
        """The request `key` waits no more (no reading came for long): what it has taken, without `done`."""
        waiting = self._waiting.pop(key, None)
        return 0.0 if waiting is None else waiting.taken

    def close(self) -> None:
        """The feed stopped: every request waiting is charged what it has taken."""
        waiting, self._waiting = self._waiting, {}
        for item in waiting.values():
            _call(item.done, item.taken)


def _call(done: Callable[[float], None], tokens: float) -> None:
    try:
        done(tokens)
    except Exception:
        log.exception("run-on waiter failed")
