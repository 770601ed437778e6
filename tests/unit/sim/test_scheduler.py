"""Scheduler and block-pool behaviour, driven step by step with no clock."""

from __future__ import annotations

import pytest

from extproc.sim.kvcache import BlockPool, blocks_for_tokens
from extproc.sim.scheduler import (
    EngineDownError,
    Overflow,
    Scheduler,
    SchedulerConfig,
    SeqStatus,
    Sequence,
    StepTiming,
)

_ids = iter(range(1, 1_000_000))


def seq(prompt: int, output: int) -> Sequence:
    return Sequence(next(_ids), prompt, output)


def make(
    num_blocks: int = 100,
    block_size: int = 16,
    max_num_seqs: int = 256,
    budget: int = 8192,
    overflow: Overflow = Overflow.PREEMPT,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, overflow=overflow)
    return Scheduler(cfg, BlockPool(num_blocks, block_size))


def run_until_idle(s: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while s.has_work:
        s.step()
        steps += 1
        assert steps < limit, "scheduler did not drain"
    return steps


def test_blocks_for_tokens() -> None:
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_pool_is_all_or_nothing() -> None:
    pool = BlockPool(3, 16)
    assert pool.ensure(1, 32)
    assert not pool.ensure(2, 32)  # needs 2, only 1 free
    assert pool.held_by(2) == 0 and pool.num_used == 2
    assert pool.ensure(2, 16)
    assert pool.usage == 1.0
    assert pool.free(1) == 2
    assert pool.usage == pytest.approx(1 / 3)


def test_blocks_follow_computed_tokens_during_prefill_and_decode() -> None:
    s = make(block_size=16)
    a = seq(prompt=20, output=30)
    s.add(a)
    r = s.step()
    # Prefill computes the whole prompt, holds ceil(20/16) blocks and samples the first token.
    assert r.admitted == [a] and r.emitted == [a]
    assert r.num_prefill_tokens == 20 and a.num_computed == 20 and a.num_output == 1
    assert s.pool.held_by(a.seq_id) == 2
    # Decode steps add one computed token each; block 3 is needed when token 33 is computed.
    held = []
    for _ in range(14):
        r = s.step()
        assert r.num_decode_tokens == 1 and r.num_prefill_tokens == 0
        held.append(s.pool.held_by(a.seq_id))
    assert a.num_computed == 34
    assert held[:12] == [2] * 12 and held[12:] == [3, 3]


def test_usage_rises_during_decode_and_falls_when_sequences_finish() -> None:
    s = make(num_blocks=50, block_size=4)
    seqs = [seq(prompt=4, output=40) for _ in range(3)]
    for q in seqs:
        s.add(q)
    usages = []
    while s.has_work:
        s.step()
        usages.append(s.kv_usage)
    peak = max(usages)
    assert usages[0] == pytest.approx(3 / 50)
    assert peak == pytest.approx(3 * blocks_for_tokens(4 + 39, 4) / 50)
    assert usages.index(peak) > 5  # grew over decode, not at admission
    assert usages[-1] == 0.0 and s.pool.num_used == 0
    assert all(q.status is SeqStatus.FINISHED and q.num_output == 40 for q in seqs)


def test_preemption_picks_newest_requeues_at_front_and_admits_nothing() -> None:
    s = make(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b, c = seq(4, 100), seq(4, 100), seq(4, 100)
    for q in (a, b, c):
        s.add(q)
    r = s.step()
    assert r.admitted == [a, b] and list(s.waiting) == [c]
    # Both grow to 8 tokens in 2 blocks each (pool full); the next decode step needs a 3rd block for a.
    while True:
        r = s.step()
        if r.preempted:
            break
        assert a.num_tokens <= 9
    assert r.preempted == [b]
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.num_output > 0
    assert list(s.waiting) == [b, c]  # front of the queue, ahead of the older waiting request
    assert r.admitted == []  # a free block and a free seat exist, but a preempting step admits nothing
    assert s.running == [a] and s.pool.held_by(b.seq_id) == 0
    assert s.pool.held_by(a.seq_id) == 3


def test_preempted_sequence_recomputes_prompt_and_generated_tokens() -> None:
    s = make(num_blocks=6, block_size=4, max_num_seqs=2)
    a, b = seq(4, 12), seq(4, 12)
    s.add(a)
    s.add(b)
    preempted_at_output = None
    while s.has_work:
        r = s.step()
        if b in r.preempted:
            preempted_at_output = b.num_output
        if preempted_at_output is not None and b in r.admitted:
            # Re-admission prefills prompt + tokens generated before preemption.
            assert r.num_prefill_tokens >= 4 + preempted_at_output
            break
    assert preempted_at_output is not None
    run_until_idle(s)
    assert a.num_output == 12 and b.num_output == 12 and s.pool.num_used == 0


def test_self_preemption_when_the_victim_is_the_sequence_itself() -> None:
    s = make(num_blocks=2, block_size=4)
    a = seq(8, 10)
    s.add(a)
    s.step()  # prompt fills both blocks, token 9 sampled
    r = s.step()  # computing token 9 needs a third block: a is the only (newest) victim
    assert r.preempted == [a] and r.scheduled == [] and list(s.waiting) == [a]


def test_max_num_seqs_is_respected() -> None:
    s = make(max_num_seqs=2)
    seqs = [seq(10, 5) for _ in range(5)]
    for q in seqs:
        s.add(q)
    r = s.step()
    assert r.admitted == seqs[:2] and len(s.running) == 2 and list(s.waiting) == seqs[2:]
    while s.has_work:
        s.step()
        assert len(s.running) <= 2


def test_token_budget_chunks_prefill_and_counts_decodes() -> None:
    s = make(budget=32)
    long = seq(100, 3)
    s.add(long)
    chunks = []
    while long.num_output == 0:
        r = s.step()
        chunks.append(r.num_prefill_tokens)
    assert chunks == [32, 32, 32, 4]
    # Three decoding sequences use 3 tokens of the budget; a new prompt gets the remaining 29.
    s2 = make(budget=32)
    decoders = [seq(4, 50) for _ in range(3)]
    for q in decoders:
        s2.add(q)
    s2.step()
    newcomer = seq(100, 5)
    s2.add(newcomer)
    r = s2.step()
    assert r.num_decode_tokens == 3 and r.num_prefill_tokens == 29
    assert sum(n for _, n in r.scheduled) <= 32


def test_fcfs_admission_blocks_on_head_of_queue() -> None:
    s = make(num_blocks=4, block_size=4, budget=1000)
    big, small = seq(20, 1), seq(4, 1)  # big needs 5 blocks > 4 free: waits, and so does small behind it
    s.add(seq(4, 3))
    s.step()
    s.add(big)
    s.add(small)
    r = s.step()
    assert r.admitted == [] and list(s.waiting) == [big, small]


def test_abort_frees_blocks_immediately() -> None:
    s = make(block_size=4)
    a, b = seq(40, 100), seq(4, 100)
    s.add(a)
    s.step()
    s.add(b)
    assert s.pool.held_by(a.seq_id) == 10
    assert s.abort(a) and a.status is SeqStatus.ABORTED
    assert s.pool.num_used == 0 and s.running == []
    assert s.abort(b) and list(s.waiting) == []
    assert not s.abort(b)


def test_oom_mode_crashes_fails_everything_and_restarts_empty() -> None:
    s = make(num_blocks=4, block_size=4, max_num_seqs=2, overflow=Overflow.OOM)
    a, b, c = seq(4, 100), seq(4, 100), seq(4, 100)
    for q in (a, b, c):
        s.add(q)
    crash = None
    for _ in range(20):
        r = s.step()
        assert not r.preempted
        if r.crashed:
            crash = r
            break
    assert crash is not None
    assert set(crash.failed) == {a, b, c} and all(q.status is SeqStatus.FAILED for q in (a, b, c))
    assert s.down and s.num_crashes == 1 and s.pool.num_used == 0 and not s.has_work
    with pytest.raises(EngineDownError):
        s.add(seq(4, 1))
    assert s.step().scheduled == []
    s.restart()
    d = seq(4, 2)
    s.add(d)
    run_until_idle(s)
    assert d.status is SeqStatus.FINISHED and not s.down


def test_step_duration_grows_with_batch_and_prefill() -> None:
    t = StepTiming(base_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001)
    assert t.duration(0, 0) == 0.0
    assert t.duration(1, 0) == pytest.approx(0.011)
    assert t.duration(100, 0) == pytest.approx(0.11)
    assert t.duration(1, 1000) == pytest.approx(0.111)
    s = Scheduler(SchedulerConfig(), BlockPool(100, 16), t)
    s.add(seq(100, 2))
    assert s.step().duration == pytest.approx(0.01 + 0.001 + 0.01)
    assert s.step().duration == pytest.approx(0.011)
