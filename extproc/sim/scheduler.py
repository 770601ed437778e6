"""Clock-free continuous-batching scheduler modelled on vLLM V1 (`vllm/v1/core/sched/scheduler.py`).

One call to `Scheduler.step()` is one engine iteration: it picks the sequences that run, allocates their
KV blocks, applies the forward pass (tokens computed, at most one token sampled per sequence) and returns
what happened plus the modelled duration. It never reads a clock or sleeps, so tests drive it step by
step and the asyncio driver (`engine.py`) decides how long each step takes in wall time.

Behaviour that matters to the sidecar, as in vLLM V1:
- running sequences are served first, within `max_num_batched_tokens`; prompts are prefilled in chunks;
- blocks are allocated only for tokens computed so far, so KV usage grows during decode;
- when a running sequence cannot get its next block, the newest running sequence is preempted
  (recompute): its blocks are freed, its computed progress reset to 0 (generated tokens are kept and
  recomputed), and it goes to the front of the waiting queue; nothing new is admitted in such a step;
- waiting sequences are admitted FCFS while seats (`max_num_seqs`), budget and blocks allow;
- with a prefix-caching pool, a waiting sequence with nothing computed (new, or resumed after preemption)
  starts from the longest run of cached leading blocks (`get_computed_blocks`), computes only the rest, and
  its full blocks are registered as they are allocated, so siblings and later sequences share them.
In `oom` overflow mode the same shortage crashes the engine instead (every sequence fails).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from extproc.sim.kvcache import BlockPool

_PRIVATE_BLOCK = "extproc.sim private block"

log = logging.getLogger(__name__)


class Overflow(enum.StrEnum):
    """What the engine does when a running sequence cannot get a KV block."""

    PREEMPT = "preempt"
    OOM = "oom"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class EngineDownError(RuntimeError):
    """Raised when work is submitted while the engine is down after a crash."""


@dataclass(eq=False)
class Sequence:
    """One generated sequence (a request with n > 1 is n sequences, as vLLM V1 fans it out).

    `prompt_hashes` are the chained hashes of the prompt's full blocks (`kvcache.hash_blocks`), shared by
    the sequences of one request; without them the prompt is shared with nobody. `read_cache` is False when
    the request asks for prompt logprobs, which skips the lookup as vLLM's `skip_reading_prefix_cache` does.
    """

    seq_id: int
    prompt_tokens: int
    max_output_tokens: int
    num_output: int = 0
    num_computed: int = 0
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    prompt_hashes: tuple[int, ...] = ()
    read_cache: bool = True
    num_cached_prompt: int = 0  # prompt tokens hit at its first scheduling (vllm:prompt_tokens_cached)

    def block_hash(self, index: int) -> int:
        """Hash of the sequence's `index`-th full block.

        Prompt blocks have the prompt's hashes. A block holding generated tokens (or a prompt block without
        a known hash) gets one private to the sequence: vLLM hashes output blocks too, so a preempted
        sequence hits its own surviving blocks when it resumes, but no other sequence generated the same
        tokens, so nobody else does.
        """
        if index < len(self.prompt_hashes):
            return self.prompt_hashes[index]
        return hash((_PRIVATE_BLOCK, self.seq_id, index))

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens; all but the last sampled one need KV before the next sample."""
        return self.prompt_tokens + self.num_output

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits (vLLM names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    overflow: Overflow = Overflow.PREEMPT


@dataclass(frozen=True)
class StepTiming:
    """Modelled duration of one iteration in engine seconds.

    duration = base + per_seq * scheduled sequences + per_prefill_token * prefill tokens.
    `base` is the weight-read floor of a decode step, `per_seq` the extra attention/KV reads per sequence
    in the batch, `per_prefill_token` the compute cost of one prompt token. See docs/simulator.md.
    """

    base_s: float = 0.0065
    per_seq_s: float = 0.0001
    per_prefill_token_s: float = 0.00004

    def duration(self, num_seqs: int, num_prefill_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        return self.base_s + self.per_seq_s * num_seqs + self.per_prefill_token_s * num_prefill_tokens


@dataclass
class StepResult:
    """Everything one iteration did; the driver turns it into metrics and client events."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    emitted: list[Sequence] = field(default_factory=list)  # sampled one token (index num_output - 1)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    crashed: bool = False
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_queries: int = 0  # tokens of the new sequences admitted that looked up the prefix cache
    prefix_hits: int = 0  # of which found cached
    duration: float = 0.0


class Scheduler:
    """Waiting queue, running batch and block pool of one engine."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, timing: StepTiming | None = None) -> None:
        self.config = config
        self.pool = pool
        self.timing = timing or StepTiming()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.down = False
        self.num_preemptions = 0
        self.num_crashes = 0

    # -- queue management -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence at the back of the waiting queue (FCFS)."""
        if self.down:
            raise EngineDownError("engine is down")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Remove a sequence wherever it is and free its blocks at once; False if it was already gone."""
        if seq.status is SeqStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        self.pool.free(seq.seq_id)
        seq.status = SeqStatus.ABORTED
        return True

    def restart(self) -> None:
        """Bring a crashed engine back, empty."""
        self.pool.reset()
        self.waiting.clear()
        self.running.clear()
        self.down = False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    # -- one iteration ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, allocate and run one iteration; see the module docstring for the policy."""
        result = StepResult()
        if self.down:
            return result
        budget = self.config.max_num_batched_tokens

        # 1. Running sequences first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            scheduled = True
            while not self.pool.ensure(seq.seq_id, seq.num_computed + num_new, seq.block_hash):
                if self.config.overflow is Overflow.OOM:
                    self._crash(result)
                    return result
                victim = self.running.pop()  # newest running sequence
                self._preempt(victim, result)
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            result.scheduled.append((seq, num_new))
            budget -= num_new
            i += 1

        # 2. Admit from the head of the waiting queue, unless this step preempted.
        if not result.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                hits = self._cache_hits(seq)
                hit_tokens = len(hits) * self.pool.block_size
                num_new = min(seq.num_tokens - hit_tokens, budget)
                if not self.pool.ensure(seq.seq_id, hit_tokens + num_new, seq.block_hash, hits):
                    break
                self._start_from_cache(seq, hit_tokens, result)
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                result.admitted.append(seq)
                result.scheduled.append((seq, num_new))
                budget -= num_new

        # 3. Forward pass: advance computed tokens, sample where a sequence is fully computed.
        for seq, num_new in result.scheduled:
            is_decode = seq.num_output > 0 and seq.num_uncomputed == 1
            if is_decode:
                result.num_decode_tokens += num_new
            else:
                result.num_prefill_tokens += num_new
            seq.num_computed += num_new
            if seq.num_computed == seq.num_tokens:
                seq.num_output += 1
                result.emitted.append(seq)
                if seq.num_output >= seq.max_output_tokens:
                    self.running.remove(seq)
                    self.pool.free(seq.seq_id)
                    seq.status = SeqStatus.FINISHED
                    result.finished.append(seq)

        result.duration = self.timing.duration(len(result.scheduled), result.num_prefill_tokens)
        return result

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting sequence starts from: looked up only when nothing is computed yet (new or
        preempted), with prefix caching on and the request not asking for prompt logprobs."""
        if seq.num_computed or not seq.read_cache:
            return []
        return self.pool.find_cached(seq.block_hash, seq.num_tokens)

    def _start_from_cache(self, seq: Sequence, hit_tokens: int, result: StepResult) -> None:
        """Admitted: the hit counts as computed. A new sequence's lookup is booked in the prefix-cache
        counters at admission (vLLM's scheduler.py 1314-1317 and kv_cache_manager.py
        `record_prefix_cache_stats` 253-262: a lookup that did not admit is not counted; a resumed
        sequence's goes to the preempted stats, which are not exported) and its hit as its cached prompt
        tokens (`prefill_stats`, set on the first scheduling only)."""
        seq.num_computed = hit_tokens
        if seq.num_preemptions:
            return
        seq.num_cached_prompt = hit_tokens
        if self.pool.enable_prefix_caching and seq.read_cache:
            result.prefix_queries += seq.num_tokens
            result.prefix_hits += hit_tokens

    def _preempt(self, victim: Sequence, result: StepResult) -> None:
        """vLLM's `_preempt_request` (scheduler.py 1571-1616): blocks freed (tail first), progress reset,
        front of the queue; on its next admission the prefix lookup runs again and may find its own blocks
        still cached."""
        self.pool.free(victim.seq_id)
        victim.num_computed = 0
        victim.num_preemptions += 1
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        result.preempted.append(victim)
        log.debug("preempted sequence %d (output %d tokens)", victim.seq_id, victim.num_output)

    def _crash(self, result: StepResult) -> None:
        """No block for a running sequence in oom mode: every sequence fails and the engine goes down."""
        failed = [*self.running, *self.waiting]
        for seq in failed:
            seq.status = SeqStatus.FAILED
        self.running.clear()
        self.waiting.clear()
        self.pool.reset()
        self.down = True
        self.num_crashes += 1
        result.crashed = True
        result.failed = failed
        result.scheduled = []
        log.warning("KV cache exhausted in oom mode: engine crashed, %d sequences failed", len(failed))
