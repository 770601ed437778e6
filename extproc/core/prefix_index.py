"""Which leading prompt chunks the in-flight requests of one pool hold, and which of them pay for each.

An engine with a prefix cache (vLLM V1, on by default; SGLang's radix cache) holds a run of identical leading
prompt blocks once, however many running requests share it: a system prompt, few-shot examples, a
conversation resent each turn. A KV budget that books every prompt whole books that run once per request
and refuses work while the cache stands empty. This index lets the budget book each shared chunk as the
engine holds it.

A prompt is identified by its chunks: a chained hash per fixed-size piece of its leading text (each hash
covers its piece and every piece before it, as vLLM's block hash covers its parent's), so two prompts share
exactly the chunks of their common leading text. The index keeps, per chunk, the in-flight requests holding
it in admission order. Of these, the last `replicas` pay for it; the others are *credited* it (their
booking leaves it out):

* One replica: the chunk is booked once, as the engine holds it once.
* `replicas` > 1: the pool's router may send each request to any replica, so a chunk is held at most once
  per replica and at most once per request. Booking it `min(holders, replicas)` times is never below what
  the engine holds, whatever the routing; a prefix-aware router only makes it an over-estimate.
* The *last* holders pay because a chunk stays in the cache until its last holder ends, and the request
  admitted last is usually the one that ends last: the forecast of each payer's trajectory then keeps the
  chunk until about when the engine frees it. When a payer leaves first, the next holder pays from then on
  (`remove` reports the change), so the booking of what is held now is always exact.

Credited chunks always form a leading run of a request's chunks: every holder of chunk i also holds chunk
i-1 (chained hashes), so whoever is among the last payers of chunk i-1 is among those of chunk i too.

Pure and synchronous; memory is bounded by the chunks of the requests in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptChunks:
    """A prompt's leading chunks as chained hashes: `chunk_chars` characters each, of `text_chars` in all."""

    hashes: tuple[int, ...] = ()
    chunk_chars: int = 1
    text_chars: int = 1

    def credit(self, chunks: int, prompt: int) -> int:
        """Prompt tokens the first `chunks` chunks stand for, less one chunk, as that share of `prompt`.

        Less one chunk: the engine shares whole blocks only and recomputes a prompt's last token, so where
        a shared run ends inside an engine block, that block is the request's own. As a share of `prompt`:
        a prompt booked on its byte bound before its exact count (`admission/deciding/provisional.py`) is
        credited in proportion, so what stays booked is never below the exact count's unshared part. Never the
        whole prompt.
        """
        if chunks <= 1 or prompt <= 1:
            return 0
        share = min(1.0, (chunks - 1) * self.chunk_chars / max(1, self.text_chars))
        return min(prompt - 1, int(prompt * share))


NO_CHUNKS = PromptChunks()


class PrefixIndex:
    """Chunk hash -> the lease ids holding it, oldest first."""

    __slots__ = ("_holders", "replicas")

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = max(1, int(replicas))
        self._holders: dict[int, list[str]] = {}

    def __len__(self) -> int:
        """Distinct chunks held by at least one request."""
        return len(self._holders)

    def shared_run(self, chunks: Sequence[int]) -> int:
        """How many leading chunks of a prompt some request in flight already holds."""
        run = 0
        for chunk in chunks:
            if chunk not in self._holders:
                break
            run += 1
        return run

    def add(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        """`lease` now holds `chunks`, and pays for each; returns the holders that each stopped paying for
        some chunks (lease id -> chunks newly credited to it)."""
        credited: dict[str, int] = {}
        for chunk in chunks:
            holders = self._holders.setdefault(chunk, [])
            holders.append(lease)
            if len(holders) > self.replicas:
                older = holders[-self.replicas - 1]
                credited[older] = credited.get(older, 0) + 1
        return credited

    def remove(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        """`lease` released `chunks`; returns the holders that pay again for some of them (lease id ->
        chunks no longer credited to it)."""
        debited: dict[str, int] = {}
        for chunk in chunks:
            holders = self._holders.get(chunk)
            if holders is None:
                continue
            try:
                at = holders.index(lease)  # a lease holds a chunk once
            except ValueError:
                continue
            paid = at >= len(holders) - self.replicas
            del holders[at]
            if not holders:
                del self._holders[chunk]
            elif paid and len(holders) >= self.replicas:
                newer = holders[-self.replicas]
                debited[newer] = debited.get(newer, 0) + 1
        return debited

    def credited(self, lease: str, chunks: Sequence[int]) -> int:
        """Chunks of `lease` it does not pay for (a leading run of its chunks)."""
        run = 0
        for chunk in chunks:
            holders = self._holders.get(chunk, ())
            if lease in holders[: max(0, len(holders) - self.replicas)]:
                run += 1
            else:
                break
        return run
