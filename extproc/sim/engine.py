"""Asyncio driver: runs the scheduler step by step on an engine clock that is `time_scale` times faster.

Engine time is a virtual clock advanced by each step's modelled duration; the driver sleeps so that wall
time keeps pace at 1/time_scale. When the host is too slow to keep up (high time scale, shared CPU), the
engine clock simply falls behind wall time instead of compressing later steps, so modelled latencies stay
those of the model, and runs with the same seed and arrival order give the same numbers. When idle, the
engine clock catches up with scaled wall time so gaps between requests count.

Latency metrics (TTFT, ITL, e2e, queue time) are in engine seconds: at any time scale they read like the
real deployment being modelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from extproc.sim.metrics import EngineMetrics
from extproc.sim.scheduler import EngineDownError, Scheduler, SeqStatus, Sequence, StepResult

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDownError", "Event", "EventKind", "Tracked"]

# Lag beyond which the driver stops trying to catch up with the modelled schedule.
_MAX_LAG_S = 0.002


class EventKind(enum.Enum):
    TOKEN = "token"
    ERROR = "error"


@dataclass(frozen=True)
class Event:
    """Delivered to a request's queue: a choice produced its `count`-th token, or failed."""

    index: int
    kind: EventKind
    count: int = 0
    finished: bool = False
    message: str = ""


@dataclass(eq=False)
class Tracked:
    """A sequence plus what the driver needs to report on it."""

    seq: Sequence
    index: int
    sink: asyncio.Queue[Event]
    finish_reason: str
    arrival: float
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    missed_abort: bool = False  # its client left and the engine missed it (`Engine.disconnected`)


class Engine:
    """Owns the scheduler, its clock and its metrics; one task runs the step loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        time_scale: float = 1.0,
        oom_restart_s: float = 30.0,
        wall_clock: Callable[[], float] = time.monotonic,
        max_num_queued_reqs: int | None = None,
        missed_abort_every: int = 0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.scheduler = scheduler
        self.metrics = metrics
        self.time_scale = time_scale
        self.oom_restart_s = oom_restart_s
        self.max_num_queued_reqs = max_num_queued_reqs
        self.missed_abort_every = missed_abort_every
        self._disconnects = 0
        self._wall = wall_clock
        self._virtual = 0.0
        self._anchor_wall = wall_clock()
        self._anchor_virtual = 0.0
        self._last_now = 0.0
        self._idle = True
        self._tracked: dict[int, Tracked] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_seq_id = 0
        self._publish_state()

    # -- clock ------------------------------------------------------------------------------------

    def now(self) -> float:
        """Engine seconds since start (monotonic)."""
        scaled = self._anchor_virtual + (self._wall() - self._anchor_wall) * self.time_scale
        if not self._idle:
            # Busy: never stamp beyond the end of the step in progress, or a lagging host would make
            # arrivals look later than the step that serves them.
            scaled = min(scaled, self._virtual)
        self._last_now = max(self._last_now, scaled)
        return self._last_now

    def _reanchor(self) -> None:
        self._anchor_wall = self._wall()
        self._anchor_virtual = self._virtual

    async def _sleep_until_virtual(self) -> None:
        wait = (self._virtual - self._anchor_virtual) / self.time_scale - (self._wall() - self._anchor_wall)
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            if -wait > _MAX_LAG_S:
                self._reanchor()
            await asyncio.sleep(0)

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        return not self.scheduler.down

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
            self._task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """A dead step loop would hang every request; make it loud and fail what is in flight."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine step loop died", exc_info=task.exception())
        for t in self._tracked.values():
            t.sink.put_nowait(Event(t.index, EventKind.ERROR, message="engine step loop failed"))
        self._tracked.clear()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests ---------------------------------------------------------------------------------

    def new_sequence(
        self,
        prompt_tokens: int,
        max_output_tokens: int,
        prompt_hashes: tuple[int, ...] = (),
        read_cache: bool = True,
    ) -> Sequence:
        """A sequence with a fresh id; `prompt_hashes` (shared by the sequences of one prompt) let it share
        cached prompt blocks."""
        self._next_seq_id += 1
        return Sequence(
            self._next_seq_id,
            prompt_tokens,
            max_output_tokens,
            prompt_hashes=prompt_hashes,
            read_cache=read_cache,
        )

    def admits(self, sequences: int) -> bool:
        """vLLM's `AsyncLLM.check_admission` (vllm 0.32.0 vllm/v1/engine/async_llm.py): with
        `--max-num-queued-reqs` set, a request whose `sequences` (n > 1 counts n) would take the unfinished
        ones past it is refused before the scheduler sees it, and `vllm:admission_rejections_total` counts
        it; the caller answers vLLM's 503 (`QueueOverflowError`)."""
        bound = self.max_num_queued_reqs
        if bound is None or len(self._tracked) + sequences <= bound:
            return True
        self.metrics.admission_rejections["max_num_queued_reqs"].inc()
        return False

    def submit(self, items: list[tuple[Sequence, int, str]], sink: asyncio.Queue[Event]) -> list[Tracked]:
        """Queue sequences (with their choice index and finish reason); raises EngineDownError when down."""
        if self.scheduler.down:
            raise EngineDownError("engine is restarting")
        arrival = self.now()
        tracked = []
        for seq, index, reason in items:
            self.scheduler.add(seq)
            t = Tracked(seq, index, sink, reason, arrival)
            self._tracked[seq.seq_id] = t
            tracked.append(t)
        self._publish_state()
        self._wake.set()
        return tracked

    def record_pooling(self, prompts: list[int]) -> None:
        """A pooling request (embeddings, score, ...) ran its prompts without decoding: book their prompt
        tokens and one finished request per prompt. It holds no KV blocks past its forward pass, so the
        simulator does not schedule it."""
        self.metrics.prompt_tokens.inc(sum(prompts))
        self.metrics.request_success["stop"].inc(len(prompts))

    def disconnected(self, tracked: list[Tracked]) -> None:
        """The client of `tracked` went away: aborted, unless this is a disconnect the engine misses
        (`missed_abort_every`, vLLM #54947), whose sequences decode on to their end."""
        self._disconnects += 1
        every = self.missed_abort_every
        if every and self._disconnects % every == 0:
            for t in tracked:
                t.missed_abort = True
            log.info("missed the abort of %d sequences: they decode on", len(tracked))
            return
        self.abort(tracked)

    def abort(self, tracked: list[Tracked]) -> None:
        """Client went away: drop its sequences and free their blocks now, not at the next step; not those
        whose abort the engine missed (`disconnected`)."""
        tracked = [t for t in tracked if not t.missed_abort]
        aborted = 0
        for t in tracked:
            if self._tracked.pop(t.seq.seq_id, None) is None:
                continue
            if self.scheduler.abort(t.seq):
                aborted += 1
                self.metrics.request_success["abort"].inc()
        if aborted:
            log.info("aborted %d sequences after client disconnect", aborted)
            self._publish_state()

    # -- step loop --------------------------------------------------------------------------------

    def _publish_state(self) -> None:
        s = self.scheduler
        self.metrics.set_state(len(s.running), len(s.waiting), s.kv_usage)

    async def _run(self) -> None:
        while True:
            if self.scheduler.down:
                await asyncio.sleep(self.oom_restart_s / self.time_scale)
                self._virtual += self.oom_restart_s
                self._reanchor()
                self.scheduler.restart()
                self._publish_state()
                log.info("engine restarted after KV-cache crash")
                continue
            if not self.scheduler.has_work:
                self._idle = True
                self._wake.clear()
                await self._wake.wait()
                self._virtual = max(self._virtual, self.now())
                self._reanchor()
                self._idle = False
                continue
            result = self.scheduler.step()
            self._virtual += result.duration
            if result.crashed:
                self._handle_crash(result)
                continue
            self._publish_state()
            await self._sleep_until_virtual()
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        """Turn the step's outcome into metrics and client events, stamped with the step's end time."""
        m = self.metrics
        end = self._virtual
        if result.preempted:
            m.preemptions.inc(len(result.preempted))
        if result.prefix_queries:
            m.prefix_cache_queries.inc(result.prefix_queries)
            m.prefix_cache_hits.inc(result.prefix_hits)
        for seq in result.admitted:
            t = self._tracked.get(seq.seq_id)
            if t is not None and t.scheduled_at is None:
                t.scheduled_at = end - result.duration
        for seq in result.emitted:
            m.generation_tokens.inc()
            t = self._tracked.get(seq.seq_id)
            if t is None or seq.status is SeqStatus.ABORTED:
                continue
            if t.first_token_at is None:
                t.first_token_at = end
                m.prompt_tokens.inc(seq.prompt_tokens)
                m.prompt_tokens_cached.inc(seq.num_cached_prompt)
                m.ttft.observe(end - t.arrival)
            elif t.last_token_at is not None:
                m.itl.observe(end - t.last_token_at)
            t.last_token_at = end
            finished = seq.status is SeqStatus.FINISHED
            if finished:
                del self._tracked[seq.seq_id]
                m.request_success[t.finish_reason].inc()
                m.e2e.observe(end - t.arrival)
                queued_until = t.scheduled_at if t.scheduled_at is not None else t.first_token_at
                m.queue_time.observe(max(0.0, queued_until - t.arrival))
            t.sink.put_nowait(Event(t.index, EventKind.TOKEN, seq.num_output, finished))

    def _handle_crash(self, result: StepResult) -> None:
        self.metrics.oom_events.inc()
        self._publish_state()
        for seq in result.failed:
            t = self._tracked.pop(seq.seq_id, None)
            if t is not None:
                t.sink.put_nowait(
                    Event(t.index, EventKind.ERROR, message="engine crashed: KV cache out of memory")
                )
        log.error(
            "engine down for %.1f engine seconds after KV-cache exhaustion (%d sequences failed)",
            self.oom_restart_s,
            len(result.failed),
        )
