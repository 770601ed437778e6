"""Paged KV-cache block pool: fixed-size blocks handed to sequences as they compute tokens.

Only counts are tracked (which physical block a sequence holds does not change any observable), which
keeps the pool O(1) per operation. Allocation is all-or-nothing, as vLLM V1's `allocate_slots` returns
None without side effects when the pool cannot cover the request.
"""

from __future__ import annotations


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` KV entries (ceil division)."""
    return -(-num_tokens // block_size) if num_tokens > 0 else 0


class BlockPool:
    """A fixed number of KV blocks shared by all sequences of one engine."""

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

    def ensure(self, seq_id: int, num_tokens: int) -> bool:
        """Make `seq_id` hold blocks for `num_tokens` tokens; False (and no change) if the pool is short."""
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
