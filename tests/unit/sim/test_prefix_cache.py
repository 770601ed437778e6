"""Prefix caching as vLLM 0.32.0 does it: the block pool's hits, sharing, eviction order and all-or-nothing
allocation, and the scheduler starting sequences from their cached prefix. Driven step by step, no clock."""

from __future__ import annotations

import random

import pytest

from extproc.sim.api import build_engine
from extproc.sim.cli import build_parser, config_from_args
from extproc.sim.config import SimConfig
from extproc.sim.kvcache import (
    BlockPool,
    PrefixCachingBlockPool,
    cache_seed,
    hash_blocks,
)
from extproc.sim.scheduler import Scheduler, SchedulerConfig, Sequence, StepResult

_ids = iter(range(1, 1_000_000))
SEED = cache_seed("m")


def prompt_seq(tokens: list[int], output: int = 50, block_size: int = 4) -> Sequence:
    """A sequence whose prompt is `tokens`, hashed as the API hashes it."""
    hashes = hash_blocks(tokens, block_size, SEED)
    return Sequence(next(_ids), len(tokens), output, prompt_hashes=hashes)


def alloc(pool: BlockPool, seq: Sequence, num_tokens: int | None = None) -> list[int]:
    """Admit `seq` as the scheduler does: look up its hits, then allocate the rest; returns the hits."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    hits = pool.find_cached(seq.block_hash, num_tokens)
    assert pool.ensure(seq.seq_id, num_tokens, seq.block_hash, hits)
    return hits


def span(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- hashing --------------------------------------------------------------------------------------------


def test_block_hashes_cover_full_blocks_and_chain_over_the_prefix() -> None:
    a = hash_blocks(span(0, 40), 16, SEED)
    assert len(a) == 2  # 40 tokens: two full blocks, the partial third has no hash
    b = hash_blocks([*span(0, 16), *span(100, 24)], 16, SEED)
    assert b[0] == a[0] and b[1] != a[1]
    c = hash_blocks([99, *span(1, 39)], 16, SEED)
    assert c[0] != a[0] and c[1] != a[1]  # block 1's tokens are equal, but its parent differs
    assert hash_blocks(span(0, 40), 16, cache_seed("adapter"))[0] != a[0]
    assert hash_blocks(span(0, 15), 16, SEED) == ()


# -- block pool -----------------------------------------------------------------------------------------


def test_a_shared_prefix_is_hit_and_held_once() -> None:
    pool = PrefixCachingBlockPool(100, 4)
    a = prompt_seq(span(0, 40))  # 10 full blocks
    assert alloc(pool, a) == []
    assert pool.num_cached == 10
    b = prompt_seq([*span(0, 40), *span(500, 8)])
    hits = alloc(pool, b)
    assert hits == list(pool.blocks_of(a.seq_id))
    assert pool.held_by(b.seq_id) == 12 and pool.blocks_of(b.seq_id)[:10] == pool.blocks_of(a.seq_id)
    assert pool.num_used == 12 and pool.usage == pytest.approx(12 / 100)


def test_a_partial_block_is_never_shared() -> None:
    pool = PrefixCachingBlockPool(100, 4)
    a = prompt_seq(span(0, 18))  # 4 full blocks and 2 tokens of a fifth
    alloc(pool, a)
    assert pool.num_cached == 4
    b = prompt_seq(span(0, 24))  # has A's 18 tokens and more: its fifth block is full
    assert len(alloc(pool, b)) == 4
    assert pool.blocks_of(b.seq_id)[4] != pool.blocks_of(a.seq_id)[4]
    # A's fifth block fills with its own generated tokens: cached, but under a hash no prompt has.
    a.num_output = 3
    assert pool.ensure(a.seq_id, 20, a.block_hash)
    assert pool.num_cached == 4 + 2 + 1  # A's 4, B's 2 beyond them, A's filled fifth
    c = prompt_seq(span(0, 24))
    assert len(pool.find_cached(c.block_hash, c.num_tokens)) == 5  # B's fifth block, not A's
    assert pool.find_cached(c.block_hash, c.num_tokens)[4] == pool.blocks_of(b.seq_id)[4]


def test_the_last_token_is_recomputed_when_the_prompt_is_whole_blocks() -> None:
    pool = PrefixCachingBlockPool(100, 4)
    a = prompt_seq(span(0, 16))
    alloc(pool, a)
    b = prompt_seq(span(0, 16))
    hits = alloc(pool, b)
    assert len(hits) == 3  # 15 tokens at most: the fourth block is computed again, in a block of its own
    assert pool.num_used == 5
    # Both fourth blocks carry the same hash now (duplicates are allowed); a lookup takes the first.
    assert pool.num_cached == 5
    c = prompt_seq(span(0, 17))
    assert pool.find_cached(c.block_hash, c.num_tokens) == list(pool.blocks_of(a.seq_id))


def test_usage_counts_referenced_blocks_only() -> None:
    pool = PrefixCachingBlockPool(20, 4)
    a = prompt_seq(span(0, 40))
    alloc(pool, a)
    assert pool.usage == pytest.approx(10 / 20)
    assert pool.free(a.seq_id) == 10
    # Still cached, but free: vLLM's get_usage counts them as free.
    assert pool.usage == 0.0 and pool.num_free == 20 and pool.num_cached == 10
    b = prompt_seq(span(0, 41))
    assert len(alloc(pool, b)) == 10
    assert pool.num_used == 11 and pool.num_free == 9


def test_cached_free_blocks_are_evicted_lru_with_a_freed_requests_tail_first() -> None:
    pool = PrefixCachingBlockPool(8, 4)
    a, c = prompt_seq(span(0, 16)), prompt_seq(span(100, 16))
    alloc(pool, a)
    alloc(pool, c)
    pool.free(a.seq_id)  # freed first: least recently used
    pool.free(c.seq_id)

    def cached_run(seq: Sequence) -> int:
        return len(pool.find_cached(seq.block_hash, seq.num_tokens + 1))

    assert cached_run(a) == 4 and cached_run(c) == 4
    d = prompt_seq(span(200, 4))
    alloc(pool, d)  # one new block: A's tail block is evicted, A's head still hits
    assert cached_run(a) == 3 and cached_run(c) == 4
    assert pool.ensure(d.seq_id, 16, d.block_hash)  # three more: the rest of A
    assert cached_run(a) == 0 and cached_run(c) == 4
    assert pool.ensure(d.seq_id, 20, d.block_hash)  # then C, tail first
    assert cached_run(c) == 3


def test_a_hit_makes_blocks_recently_used_again() -> None:
    pool = PrefixCachingBlockPool(8, 4)
    a, c = prompt_seq(span(0, 16)), prompt_seq(span(100, 16))
    alloc(pool, a)
    alloc(pool, c)
    pool.free(a.seq_id)
    pool.free(c.seq_id)
    again = prompt_seq(span(0, 17))
    assert len(alloc(pool, again)) == 4  # A's blocks taken off the free queue ...
    assert len(pool.find_cached(c.block_hash, 17)) == 3  # ... so its 17th token's block evicts C's tail
    pool.free(again.seq_id)  # A's blocks go back behind C's; the unhashed one to the front
    d = prompt_seq(span(200, 8))
    alloc(pool, d)
    # d reuses the unhashed block first (LIFO), then evicts C's next tail block: A's prefix, used more
    # recently, survives whole.
    assert len(pool.find_cached(a.block_hash, 17)) == 4
    assert len(pool.find_cached(c.block_hash, 17)) == 2


def test_allocation_with_hits_is_all_or_nothing() -> None:
    pool = PrefixCachingBlockPool(6, 4)
    a = prompt_seq(span(0, 16))
    alloc(pool, a)
    pool.free(a.seq_id)
    x = prompt_seq(span(100, 8))
    alloc(pool, x)  # takes the two never-used blocks
    assert pool.num_free == 4 and pool.num_cached == 4 + 2
    b = prompt_seq([*span(0, 16), *span(300, 8)])  # 6 blocks: A's 4 cached (all free) + 2 new
    hits = pool.find_cached(b.block_hash, b.num_tokens)
    assert len(hits) == 4
    # 2 new blocks + 4 free hits to take off the free queue > 4 free blocks: refused, nothing changed.
    assert not pool.ensure(b.seq_id, b.num_tokens, b.block_hash, hits)
    assert pool.held_by(b.seq_id) == 0 and pool.num_used == 2 and pool.num_free == 4
    assert pool.find_cached(b.block_hash, b.num_tokens) == hits
    pool.free(x.seq_id)
    assert pool.ensure(b.seq_id, b.num_tokens, b.block_hash, hits)
    assert pool.num_used == 6


def test_hits_on_blocks_in_use_take_no_free_block() -> None:
    pool = PrefixCachingBlockPool(6, 4)
    a = prompt_seq(span(0, 16))
    alloc(pool, a)  # running: its blocks have ref 1
    b = prompt_seq([*span(0, 16), *span(300, 8)])
    hits = pool.find_cached(b.block_hash, b.num_tokens)
    assert len(hits) == 4 and pool.num_free == 2
    assert pool.ensure(b.seq_id, b.num_tokens, b.block_hash, hits)
    assert pool.num_used == 6
    pool.free(a.seq_id)  # still referenced by B: nothing returns to the free queue
    assert pool.num_used == 6 and pool.num_free == 0


def test_counting_pool_ignores_hashes() -> None:
    pool = BlockPool(100, 4)
    a, b = prompt_seq(span(0, 40)), prompt_seq(span(0, 40))
    assert alloc(pool, a) == [] and alloc(pool, b) == []
    assert pool.num_used == 20


def test_reset_empties_the_cache() -> None:
    pool = PrefixCachingBlockPool(10, 4)
    a = prompt_seq(span(0, 16))
    alloc(pool, a)
    pool.reset()
    assert pool.num_used == 0 and pool.num_cached == 0 and pool.held_by(a.seq_id) == 0
    assert pool.find_cached(a.block_hash, 17) == []


# -- scheduler ------------------------------------------------------------------------------------------


def sched(pool: BlockPool, max_num_seqs: int = 256, budget: int = 8192) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), pool)


def test_two_sequences_sharing_a_10_block_prefix_hold_10_fewer_blocks() -> None:
    system = span(0, 160)  # 10 blocks of 16

    def run(pool: BlockPool) -> tuple[int, StepResult]:
        s = sched(pool)
        s.add(prompt_seq([*system, *span(1000, 40)], block_size=16))
        s.add(prompt_seq([*system, *span(2000, 40)], block_size=16))
        result = s.step()
        assert len(result.admitted) == 2
        return pool.num_used, result

    used_off, off = run(BlockPool(100, 16))
    used_on, on = run(PrefixCachingBlockPool(100, 16))
    assert used_off == 2 * 13 and used_on == used_off - 10
    assert on.num_prefill_tokens == off.num_prefill_tokens - 160
    assert (on.prefix_queries, on.prefix_hits) == (400, 160)
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)


def test_n_siblings_share_their_prompt_blocks() -> None:
    pool = PrefixCachingBlockPool(100, 16)
    s = sched(pool)
    hashes = hash_blocks(span(0, 40), 16, SEED)  # 2 full blocks + 8 tokens
    siblings = [Sequence(next(_ids), 40, 30, prompt_hashes=hashes) for _ in range(3)]
    for q in siblings:
        s.add(q)
    r = s.step()
    assert r.admitted == siblings
    assert pool.num_used == 3 + 1 + 1  # the first holds 3; the others share 2 and own their partial block
    assert [q.num_cached_prompt for q in siblings] == [0, 32, 32]
    assert (r.prefix_queries, r.prefix_hits) == (120, 64)
    # Their generated tokens differ: the partial blocks fill with private content, never shared.
    while siblings[0].num_computed < 48:
        s.step()
    assert pool.num_cached == 2 + 3


def test_a_preempted_sequence_hits_its_own_surviving_blocks() -> None:
    pool = PrefixCachingBlockPool(8, 4)
    s = sched(pool, max_num_seqs=2)
    a, b = prompt_seq(span(0, 8), output=12), prompt_seq(span(100, 8), output=12)
    s.add(a)
    s.add(b)
    preempted_with = 0
    resumed_new = 0
    while s.has_work and not resumed_new:
        r = s.step()
        if b in r.preempted:
            preempted_with = b.num_tokens
        elif preempted_with and b in r.admitted:
            (resumed_new,) = [n for q, n in r.scheduled if q is b]
            assert r.prefix_queries == 0  # a resumed request is not counted in the exported counters
    assert preempted_with == 17 and resumed_new
    # B held 4 full blocks (8 prompt + 8 generated tokens). Freed tail first, its 4th block went to A; the
    # other three, one of them holding generated tokens, are hit again: only 17 - 12 tokens recomputed.
    assert preempted_with - resumed_new == 12
    assert b.num_cached_prompt == 0  # only its first scheduling books cached prompt tokens


def test_prompt_logprobs_skip_the_lookup() -> None:
    pool = PrefixCachingBlockPool(100, 4)
    s = sched(pool)
    s.add(prompt_seq(span(0, 40)))
    s.step()
    q = prompt_seq(span(0, 40))
    q.read_cache = False
    s.add(q)
    r = s.step()
    assert q in r.admitted and q.num_cached_prompt == 0
    assert (r.prefix_queries, r.prefix_hits) == (0, 0)


@pytest.mark.parametrize(("num_blocks", "read_cache"), [(40, False), (400, True)])
def test_without_sharing_both_pools_schedule_identically(num_blocks: int, read_cache: bool) -> None:
    """The prefix-caching pool changes nothing but sharing: on prompts with nothing in common a loaded
    scheduler (chunked prefill, seats, preemption when lookups are off) takes the same decisions step for
    step as the counting pool."""
    rng = random.Random(7)
    shapes = [(rng.randint(1, 90), rng.randint(1, 60)) for _ in range(60)]

    def trace(pool: BlockPool) -> list[tuple[object, ...]]:
        s = sched(pool, max_num_seqs=16, budget=64)
        order: dict[int, int] = {}
        for i, (prompt, output) in enumerate(shapes):
            q = prompt_seq(span(1000 * i, prompt), output)
            q.read_cache = read_cache
            order[q.seq_id] = i
            s.add(q)
        steps: list[tuple[object, ...]] = []
        while s.has_work:
            r = s.step()
            steps.append(([(order[q.seq_id], n) for q, n in r.scheduled], len(r.preempted), pool.num_used))
            assert len(steps) < 20_000
        return steps

    counting = trace(BlockPool(num_blocks, 4))
    caching = trace(PrefixCachingBlockPool(num_blocks, 4))
    assert any(preempted for _, preempted, _ in counting) == (not read_cache)
    assert caching == counting


# -- configuration --------------------------------------------------------------------------------------


def test_prefix_caching_is_on_by_default_and_the_flags_follow_vllm() -> None:
    assert SimConfig().enable_prefix_caching
    assert config_from_args(build_parser().parse_args([])).enable_prefix_caching
    off = config_from_args(build_parser().parse_args(["--no-enable-prefix-caching"]))
    assert not off.enable_prefix_caching
    assert config_from_args(build_parser().parse_args(["--enable-prefix-caching"])).enable_prefix_caching
    assert SimConfig(num_gpu_blocks=100).cache_info()["enable_prefix_caching"] == "True"
    assert off.cache_info()["enable_prefix_caching"] == "False"


def test_engine_pool_follows_the_flag_and_adapters_have_their_own_namespace() -> None:
    assert isinstance(build_engine(SimConfig(num_gpu_blocks=1000)).scheduler.pool, PrefixCachingBlockPool)
    off = build_engine(SimConfig(num_gpu_blocks=1000, enable_prefix_caching=False)).scheduler.pool
    assert type(off) is BlockPool
    cfg = SimConfig(model="base", aliases=("alias",), lora_adapters=("ad",))
    assert cfg.cache_namespace("alias") == cfg.cache_namespace("base") == "base"
    assert cfg.cache_namespace("ad") == "ad"
