"""Paged KV-cache block pool: fixed-size blocks handed to sequences as they compute tokens.

Two pools share one interface. `BlockPool` only counts blocks (which physical block a sequence holds does
not change any observable when nothing is shared), which keeps it O(1) per operation; it is the pool with
prefix caching off. `PrefixCachingBlockPool` gives blocks identities so that sequences with the same
leading tokens share them, as vLLM 0.32.0's automatic prefix caching does (`vllm/v1/core/block_pool.py`,
`kv_cache_manager.py`, `kv_cache_utils.py`); it costs O(new blocks) per step. In both, allocation is
all-or-nothing, as vLLM V1's `allocate_slots` returns None without side effects when the pool cannot cover
the request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

BlockHasher = Callable[[int], int]
"""The hash of a sequence's `index`-th full block (its tokens and every token before them)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` KV entries (ceil division)."""
    return -(-num_tokens // block_size) if num_tokens > 0 else 0


def cache_seed(namespace: str) -> int:
    """The parent hash of a prompt's first block.

    vLLM chains every block hash from NONE_HASH and adds the LoRA adapter as an extra key to each block
    (kv_cache_utils.py `_gen_lora_extra_hash_keys`, `hash_block_tokens` 695-724), so an adapter's prompts
    never hit the base model's blocks. Seeding the chain with the namespace (the base model or the adapter)
    has the same effect: every hash of the chain differs between namespaces.
    """
    return hash(("extproc.sim prefix cache", namespace))


def hash_blocks(token_ids: Sequence[int], block_size: int, seed: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids`; a trailing partial block has none.

    As vLLM's `hash_block_tokens` (kv_cache_utils.py 695-724): hash(parent hash, the block's token ids), so
    a block's hash stands for its tokens and every token before them. Python's tuple hash stands in for
    vLLM's sha256: the pool lives in one process, and a 64-bit collision is as unlikely as it is harmless
    to a simulation.
    """
    hashes = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class BlockPool:
    """A fixed number of KV blocks shared by all sequences of one engine, counted only (no prefix cache)."""

    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[int, int] = {}
        self._used = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._used

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1, as vLLM's BlockPool.get_usage."""
        return self._used / self.num_blocks

    def held_by(self, seq_id: int) -> int:
        return self._held.get(seq_id, 0)

    def find_cached(self, hash_of: BlockHasher, num_tokens: int) -> list[int]:
        """Cached blocks a sequence of `num_tokens` could start from: none without a prefix cache."""
        return []

    def ensure(
        self, seq_id: int, num_tokens: int, hash_of: BlockHasher | None = None, hits: Sequence[int] = ()
    ) -> bool:
        """Make `seq_id` hold blocks for `num_tokens` tokens; False (and no change) if the pool is short.

        `hash_of` and `hits` serve the prefix-caching pool and are ignored here.
        """
        need = blocks_for_tokens(num_tokens, self.block_size) - self.held_by(seq_id)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        self._held[seq_id] = self.held_by(seq_id) + need
        self._used += need
        return True

    def free(self, seq_id: int) -> int:
        """Return every block of `seq_id` to the pool; returns how many were freed."""
        n = self._held.pop(seq_id, 0)
        self._used -= n
        return n

    def reset(self) -> None:
        """Drop every allocation (engine restart)."""
        self._held.clear()
        self._used = 0


class PrefixCachingBlockPool(BlockPool):
    """Blocks with identities, reference counts and a hash -> block map, as vLLM 0.32.0's BlockPool with
    `enable_caching` (vllm/v1/core/block_pool.py).

    A block is free when no sequence references it (ref 0). A free block may still be cached (it keeps its
    hash and can be hit again) until it is handed out anew; so `usage` counts referenced blocks only, as
    get_usage (877-888) counts cached free blocks as free. The free queue is ordered: blocks are handed out
    from its front; a freed block without a hash goes to the front (reused first), one with a hash to the
    back (evicted last, LRU) (free_blocks 774-805).
    """

    enable_prefix_caching = True

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.reset()

    def reset(self) -> None:
        """Empty pool and cache (engine restart), the free queue in block order as vLLM builds it."""
        self._used = 0
        self._ref = [0] * self.num_blocks
        self._hash: list[int | None] = [None] * self.num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._cached: dict[int, dict[int, None]] = {}  # hash -> blocks holding it, first is the one hit
        self._blocks: dict[int, list[int]] = {}  # seq_id -> its blocks, in token order
        self._num_hashed: dict[int, int] = {}  # seq_id -> leading blocks already registered in the cache

    # -- queries ------------------------------------------------------------------------------------

    def held_by(self, seq_id: int) -> int:
        return len(self._blocks.get(seq_id, ()))

    def blocks_of(self, seq_id: int) -> tuple[int, ...]:
        """The block ids `seq_id` holds, in token order (for tests and debugging)."""
        return tuple(self._blocks.get(seq_id, ()))

    @property
    def num_cached(self) -> int:
        """Blocks registered in the cache, referenced or free."""
        return sum(len(blocks) for blocks in self._cached.values())

    def find_cached(self, hash_of: BlockHasher, num_tokens: int) -> list[int]:
        """The longest run of leading full blocks found in the cache, stopping at the first miss.

        At most `num_tokens - 1` tokens: the last token is always recomputed to get its logits, so a prompt
        of exactly k blocks hits k - 1 of them (kv_cache_manager.py get_computed_blocks 289-300).
        """
        hits: list[int] = []
        cached = self._cached
        for index in range((num_tokens - 1) // self.block_size):
            blocks = cached.get(hash_of(index))
            if blocks is None:
                break
            hits.append(next(iter(blocks)))
        return hits

    # -- allocation ---------------------------------------------------------------------------------

    def ensure(
        self, seq_id: int, num_tokens: int, hash_of: BlockHasher | None = None, hits: Sequence[int] = ()
    ) -> bool:
        """Make `seq_id` hold blocks for `num_tokens` tokens, starting from the cached `hits` (found by
        `find_cached` while it held nothing); False and no change if the pool is short.

        As allocate_slots, the check counts the new blocks plus the hits that are free (ref 0: taking them
        off the free queue uses free blocks too). Then the full blocks up to `num_tokens` are registered
        under their hashes (cache_full_blocks 226-301), so a sibling or a later sequence of the same step
        can hit them; without `hash_of` nothing is registered.
        """
        block_size = self.block_size
        blocks = self._blocks.get(seq_id)
        held = len(blocks) if blocks is not None else 0
        need = -(-num_tokens // block_size) - held - len(hits)
        if need > 0 or hits:
            revived = sum(1 for block in hits if self._ref[block] == 0) if hits else 0
            if max(need, 0) + revived > self.num_blocks - self._used:
                return False
            blocks = self._grow(seq_id, need, hits)
        # Checked here, not in the callee: this runs for every sequence of every step.
        if hash_of is not None and blocks and num_tokens // block_size > self._num_hashed.get(seq_id, 0):
            self._register_full(seq_id, blocks, num_tokens, hash_of)
        return True

    def _grow(self, seq_id: int, need: int, hits: Sequence[int]) -> list[int]:
        """Give `seq_id` its hits, then `need` blocks off the free queue (the caller checked they fit)."""
        blocks = self._blocks.setdefault(seq_id, [])
        if hits:
            self._touch(hits)
            blocks += hits
            self._num_hashed[seq_id] = len(hits)
        if need > 0:
            blocks += self._take_free(need)
        return blocks

    def _touch(self, hits: Sequence[int]) -> None:
        """A hit on a free block takes it off the free queue; every hit gains a reference (touch 752-768)."""
        ref = self._ref
        for block in hits:
            if ref[block] == 0:
                del self._free_queue[block]
                self._used += 1
            ref[block] += 1

    def _take_free(self, n: int) -> list[int]:
        """Pop `n` blocks from the front of the free queue; one still cached loses its hash (evicted from the
        cache, get_new_blocks 666-700)."""
        taken = []
        queue, ref, hashes = self._free_queue, self._ref, self._hash
        for _ in range(n):
            block, _ = queue.popitem(last=False)
            if hashes[block] is not None:
                self._evict(block)
            ref[block] = 1
            taken.append(block)
        self._used += n
        return taken

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        assert block_hash is not None
        holders = self._cached[block_hash]
        del holders[block]
        if not holders:
            del self._cached[block_hash]
        self._hash[block] = None

    def _register_full(self, seq_id: int, blocks: list[int], num_tokens: int, hash_of: BlockHasher) -> None:
        """Register the blocks that `num_tokens` fills and that are not registered yet. A hash already held
        by another block is registered again: duplicates are allowed, a lookup takes the first."""
        done = self._num_hashed.get(seq_id, 0)
        full = num_tokens // self.block_size
        for index in range(done, full):
            block = blocks[index]
            if self._hash[block] is None:
                block_hash = hash_of(index)
                self._hash[block] = block_hash
                self._cached.setdefault(block_hash, {})[block] = None
        self._num_hashed[seq_id] = full

    # -- release ------------------------------------------------------------------------------------

    def free(self, seq_id: int) -> int:
        """Drop `seq_id`'s references, tail block first (single_type_kv_cache_manager.py 581-589), so that
        of its blocks left cached the tail ones are evicted first; returns how many it held."""
        blocks = self._blocks.pop(seq_id, None)
        self._num_hashed.pop(seq_id, None)
        if not blocks:
            return 0
        ref, hashes, queue = self._ref, self._hash, self._free_queue
        to_front = []
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] > 0:
                continue
            self._used -= 1
            if hashes[block] is None:
                to_front.append(block)
            else:
                queue[block] = None  # back of the queue: evicted after every block freed before it
        for block in reversed(to_front):  # prepend_n keeps the list's order at the front
            queue[block] = None
            queue.move_to_end(block, last=False)
        return len(blocks)
