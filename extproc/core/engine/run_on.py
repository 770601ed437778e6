"""Which of a pool's stopped runs its engines still run, reading by reading (the charge tally's `RunOn`).

A run stops where this sidecar saw its request end; the engine stops it when the abort reaches it: within a
step on a quiet GPU, seconds later on a saturated host, never where it missed the abort (vLLM #54947) and
decodes the answer to its end. Nothing says which requests an engine runs; its running count says how
many. At each reading, the running count less every replica's runs in flight (this one's, and the others'
from their figures) is the room: sequences the engine runs that no replica holds in flight. It is taken,
in this order, for
  - foreign sequences, as far as the room still holds them: those a reading found where nothing any replica
    stopped lately could be running (requests no gateway admitted), so that another's long request is not
    taken for the runs that stop beside it later;
  - the stopped runs still open, every replica's: split between the replicas by the sequences each stopped
    lately (within `SHOWN_AFTER_STOP_S`, and older ones the last reading found running: `Reading`), this
    replica's counted when the others' figures were read, so that both sides of the split are as old;
    within this replica newest first, the latest abort being the likeliest not to have reached the engine
    yet. A stopped run is found running only where the last reading found it so or it stopped since; once
    found done it stays done;
  - unknown, the rest (this replica's part that its open runs cannot hold too).
A run stays open until a reading finds no room for it (the engine is done with it), it has been open
`RUN_ON_MAX_S` past its stop, or the tokens taken for it since its stop reach its allowance (an engine stops
a request at its `max_tokens`). Its count waits for that reading: the steps an engine ran after a client
left, a whole answer where it missed the abort, are charged to the runs that stopped, capped by what they
reserved, not to the requests beside them or to nobody. A request no gateway admitted that starts while
runs stop is taken for theirs all the same: nothing in the counts tells it from a missed abort.

The sequence-seconds run on in an interval between two readings are along the line between what the two
found, ours as the other replicas' (which come as a count only), so that every replica sees the same time
run on; `Run.seconds_on` shares ours among our stopped runs: from its stop to the next reading, all of it
where that reading found it running, none where it found it done (the abort took); between two later
readings, along the line between what each found.

A reading can replace the last one (`Series`: it came too soon after its predecessor): `undo` puts back what
the replaced one changed, so the next `read` takes its place.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

SHOWN_AFTER_STOP_S = 5.0
"""How long after its stop a run counts among its replica's lately stopped ones, by which the room is
split between the replicas (`Reading`): an engine runs an aborted request on until the abort reaches it, up
to two seconds and more on a saturated host (vLLM's API server notices a client gone late). A window of the
same length on every replica, whenever its readings come, so that each takes the same part of the room."""
RUN_ON_MAX_S = 120.0
"""The longest a stopped run is held open for the steps its engine may still run: past the time a missed
abort decodes a long answer at a CPU engine's pace (1,000 tokens at 10 a second), so that a request no
gateway admitted, taken for it, is charged to it for so long at most. Its lease waits as long for its
charge (its slots and KV went back at its end)."""


@dataclass(slots=True)
class Run:
    """One request this sidecar admitted into the pool: `sequences` in flight from `start` until `stop`, then
    perhaps run on by the engine until the reading at `done` found it done. `seen`: the first reading that
    found it stopped (before it, it counted in flight there); `after`: the tokens taken for it since its
    stop, which `allowance` bounds."""

    key: Hashable
    start: float
    sequences: int
    allowance: float = math.inf
    stop: float | None = None
    seen: float | None = None
    done: float | None = None
    after: float = 0.0

    @property
    def until(self) -> float:
        """Its stop, or never while it runs."""
        return self.stop if self.stop is not None else math.inf

    @property
    def active_until(self) -> float:
        """Until when the engine may have run it: never past the reading that found it done."""
        return math.inf if self.done is None else max(self.done, self.until)

    def overlap(self, lo: float, hi: float) -> float:
        return max(0.0, min(hi, self.until) - max(lo, self.start))

    def on_at(self, at: float, found: Mapping[Hashable, float]) -> float:
        """Its sequences running at the reading at `at`, which `found` these stopped runs running."""
        if at <= self.start:
            return 0.0
        if self.stop is None or at < self.stop or self.seen is None or at < self.seen:
            return float(self.sequences)  # in flight there, or taken for it: the reading came before its end
        if self.done is not None and at >= self.done:
            return 0.0
        return found.get(self.key, 0.0)

    def seconds_on(self, t0: float, on0: float, t1: float, on1: float) -> float:
        """Its sequence-seconds after its stop between two readings that found `on0` and `on1` of its
        sequences running, by which the run-on is shared among the stopped runs (the module docstring)."""
        stop = self.stop
        if stop is None or stop >= t1:
            return 0.0
        if stop > t0:
            return on1 * (t1 - stop)
        return (on0 + on1) / 2 * (t1 - t0)


@dataclass(frozen=True, slots=True)
class Room:
    """What one reading found beside every replica's runs in flight: `unknown` sequences no run explains,
    of which `foreign` are past what every replica's stopped runs could explain (requests no gateway
    admitted); `others` the other replicas' stopped sequences taken for running; `ours` this replica's
    stopped runs taken for running (their sequences, by key)."""

    unknown: float = 0.0
    foreign: float = 0.0
    others: float = 0.0
    ours: Mapping[Hashable, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reading:
    """One reading as the room needs it: the engines' running sequences at `at`; those each side holds in
    flight (this replica, `ours_in_flight`; the others, `others_in_flight`) and has stopped lately (its
    sequences stopped within `SHOWN_AFTER_STOP_S`, and older ones the last reading found running:
    `ours_recent`, `others_recent`); the tokens a sequence generated a second since the last reading
    (`pace`)."""

    at: float
    running: float
    ours_in_flight: float
    others_in_flight: float
    ours_recent: float
    others_recent: float
    pace: float


@dataclass(slots=True)
class _Undo:
    """What a reading changed, for `RunOn.undo`."""

    room: Room
    seen: list[Run] = field(default_factory=list)
    done: list[Run] = field(default_factory=list)
    after: list[tuple[Run, float]] = field(default_factory=list)


class RunOn:
    """This replica's stopped runs of one pool that are still open, and what the last reading found."""

    def __init__(self) -> None:
        self.open: dict[Hashable, Run] = {}
        self.last = Room()
        self._last_at: float | None = None
        self._undo: _Undo | None = None

    def stopped(self, run: Run) -> None:
        """`run` stopped: open until a reading finds the engine done with it."""
        self.open[run.key] = run

    def forget(self, key: Hashable) -> None:
        """The tally forgot the run `key`: no longer open."""
        self.open.pop(key, None)

    def held(self, before: float) -> float:
        """The sequences of the runs stopped at or before `before` that the last reading found running."""
        return sum(self._cap(run) for run in self.open.values() if run.until <= before)

    def _cap(self, run: Run) -> float:
        """What the next reading may find running of an open run: what the last found, all of a new one."""
        return float(run.sequences) if run.seen is None else self.last.ours.get(run.key, 0.0)

    def read(self, reading: Reading) -> Room:
        """Take the room of a new reading (see the module docstring); the runs it finds done close."""
        undo = self._undo = _Undo(self.last)
        at = reading.at
        stopped = sorted(
            (run for run in self.open.values() if run.until <= at), key=lambda run: run.until, reverse=True
        )
        caps = {run.key: self._bounded_cap(run, at) for run in stopped}
        room = max(0.0, reading.running - reading.ours_in_flight - reading.others_in_flight)
        foreign = min(room, self.last.foreign)
        capacity = sum(caps.values()) + reading.others_recent
        explained = min(room - foreign, capacity)
        if capacity <= 0.0:
            foreign = room  # nothing any replica stopped can be running: requests no gateway admitted
        weight = reading.ours_recent + reading.others_recent
        ours_part = reading.ours_recent / weight if weight > 0 else 1.0
        ours_share = explained * ours_part
        found: dict[Hashable, float] = {}
        left = ours_share
        for run in stopped:
            on = min(caps[run.key], left)
            left -= on
            if run.seen is None:
                run.seen = at
                undo.seen.append(run)
            if on > 0:
                found[run.key] = on
            else:
                run.done = at
                undo.done.append(run)
                del self.open[run.key]
        room_now = Room(room - explained + left, foreign, explained - ours_share, found)
        self._count_after(stopped, reading, room_now, undo)
        self.last, self._last_at = room_now, at
        return room_now

    def _bounded_cap(self, run: Run, at: float) -> float:
        """What the room may find of a stopped run: none once it ran on `RUN_ON_MAX_S` or its allowance."""
        if at - run.until > RUN_ON_MAX_S or run.after >= run.allowance:
            return 0.0
        return self._cap(run)

    def _count_after(self, stopped: list[Run], reading: Reading, room: Room, undo: _Undo) -> None:
        """The tokens taken for each stopped run in the interval the reading closes, at its pace (what
        bounds it by its allowance)."""
        t0 = self._last_at
        if t0 is None or reading.pace <= 0.0:
            return
        for run in stopped:
            on0 = run.on_at(t0, self.last.ours) if run.until <= t0 else float(run.sequences)
            on1 = room.ours.get(run.key, 0.0)
            after_s = run.seconds_on(t0, on0, reading.at, on1)
            if after_s > 0:
                tokens = reading.pace * after_s
                run.after += tokens
                undo.after.append((run, tokens))

    def undo(self, previous_at: float | None) -> None:
        """The last reading was replaced: what it changed goes back (`previous_at`: the reading before it)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        for run in undo.seen:
            run.seen = None
        for run in undo.done:
            run.done = None
            self.open[run.key] = run
        for run, tokens in undo.after:
            run.after -= tokens
        self.last, self._last_at = undo.room, previous_at
