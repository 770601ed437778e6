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

Pure and synchronous; memory is bounded by the chunks of the requests in flight. Each admission, release and
candidate's check costs a few dict operations per chunk of its prompt, however many requests hold the chunk;
a change of `replicas` costs the shared chunks (`PrefixIndex`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptChunks:
    """A prompt's leading chunks as chained hashes: at most `chunk_chars` characters each (each text of the
    prompt cut on its own), of `text_chars` in all; `text_ends`, how many chunks each text ends after; and,
    once the prompt is counted, the tokens of its texts up to each one's end (`text_tokens`, cumulative)."""

    hashes: tuple[int, ...] = ()
    chunk_chars: int = 1
    text_chars: int = 1
    text_ends: tuple[int, ...] = ()
    text_tokens: tuple[int, ...] = ()

    def credit(self, chunks: int, prompt: int, block: int = 0) -> int:
        """Prompt tokens the first `chunks` chunks stand for: the counted tokens of the whole texts they
        cover, cut to whole engine blocks of `block` tokens (none: uncut), never the whole prompt; nothing
        before the prompt is counted.

        In tokens, not as a share of the characters: a shared English system prompt before 1,500 Chinese
        characters of the request's own was credited 842 of its 1,161 tokens at the prompt's average tokens
        per character, and its own part booked 665 of its 1,507 tokens; a prefix of `=` lines before a tail
        of digits, 630 of 4,498. A text partly covered is not credited (its tokens are not known by the
        character); nor are the chat template's frames around the texts, which the engine shares too: both
        err toward booking more. The engine shares whole blocks only, and recomputes a prompt's last token
        (vllm 0.32.0 v1/core/kv_cache_manager.py, `get_computed_blocks`: a hit of at most `num_tokens - 1`,
        in whole blocks), so the run is cut there: where it ends inside a block, that block is the request's
        own. The cut counts from the first text, the engine's from the prompt's first token (the template's
        preamble before it): the engine's shared blocks, counted from further on, are never fewer. Cut as a
        whole block off the run instead, a request sharing a 1,666-token system prompt in 128-token blocks
        (vLLM's CPU build) was booked 124 tokens of the engine's shared block as its own.
        A prompt booked on its byte bound is credited nothing until its exact count comes
        (`admission/deciding/provisional.py`), then in tokens of that count.
        """
        if chunks <= 0 or prompt <= 1 or not self.text_tokens:
            return 0
        covered = bisect.bisect_right(self.text_ends, chunks)
        if covered == 0:
            return 0
        run = max(0, min(prompt - 1, self.text_tokens[covered - 1]))
        return run - run % block if block > 0 else run


NO_CHUNKS = PromptChunks()


class _Shared:
    """A chunk two or more requests hold: its payers (the last `replicas` holders, or all while fewer) and the
    holders credited it, each oldest first."""

    __slots__ = ("credited", "payers")

    def __init__(self, payers: OrderedDict[str, None], credited: dict[str, None]) -> None:
        self.payers = payers  # ordered: a holder paying again joins at the front, as the oldest payer
        self.credited = credited  # only ever grows at the end, its newest leaves from the end (`popitem`)


class PrefixIndex:
    """Chunk hash -> the lease ids holding it, in admission order, as counted structures.

    A chunk one request holds maps to that lease id; a shared one to its payers and its credited holders
    (`_Shared`), so every change is a few dict operations per chunk, whatever the number of holders: `add` and
    `remove` of a lease are O(its chunks), `would_credit` (a candidate's check) too, without changing
    anything, and `set_replicas` visits the shared chunks only, moving just the holders whose payment
    changes. A lease holds each chunk once (chained hashes never repeat within a prompt).
    """

    __slots__ = ("_replicas", "_shared", "_solo")

    def __init__(self, replicas: int = 1) -> None:
        self._replicas = max(1, int(replicas))
        self._solo: dict[int, str] = {}  # chunk -> its one holder, who pays for it
        self._shared: dict[int, _Shared] = {}  # chunks held by two or more

    @property
    def replicas(self) -> int:
        """How many of a chunk's holders pay for it, at most (`set_replicas` changes it)."""
        return self._replicas

    def __len__(self) -> int:
        """Distinct chunks held by at least one request."""
        return len(self._solo) + len(self._shared)

    def shared_run(self, chunks: Sequence[int]) -> int:
        """How many leading chunks of a prompt some request in flight already holds."""
        solo, shared = self._solo, self._shared
        run = 0
        for chunk in chunks:
            if chunk not in solo and chunk not in shared:
                break
            run += 1
        return run

    def add(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        """`lease` now holds `chunks`, and pays for each; returns the holders that each stopped paying for
        some chunks (lease id -> chunks newly credited to it)."""
        credited: dict[str, int] = {}
        replicas, solo, shared = self._replicas, self._solo, self._shared
        for chunk in chunks:
            held = shared.get(chunk)
            if held is None:
                other = solo.setdefault(chunk, lease)
                if other is lease:
                    continue  # a chunk nobody held: its one holder pays
                del solo[chunk]
                if replicas == 1:
                    shared[chunk] = _Shared(OrderedDict({lease: None}), {other: None})
                    credited[other] = credited.get(other, 0) + 1
                else:
                    shared[chunk] = _Shared(OrderedDict({other: None, lease: None}), {})
                continue
            payers = held.payers
            payers[lease] = None
            if len(payers) > replicas:
                older = payers.popitem(last=False)[0]  # the oldest payer is now one too many
                held.credited[older] = None
                credited[older] = credited.get(older, 0) + 1
        return credited

    def would_credit(self, chunks: Sequence[int]) -> dict[str, int]:
        """What `add` of a new lease holding `chunks` would return, changing nothing: the oldest payer of each
        chunk that already has `replicas` holders."""
        credited: dict[str, int] = {}
        replicas, solo, shared = self._replicas, self._solo, self._shared
        for chunk in chunks:
            held = shared.get(chunk)
            if held is not None:
                payers = held.payers
                if len(payers) < replicas:
                    continue
                older = next(iter(payers))
            elif replicas == 1 and chunk in solo:
                older = solo[chunk]
            else:
                continue
            credited[older] = credited.get(older, 0) + 1
        return credited

    def remove(self, lease: str, chunks: Sequence[int]) -> dict[str, int]:
        """`lease` released `chunks`; returns the holders that pay again for some of them (lease id ->
        chunks no longer credited to it)."""
        debited: dict[str, int] = {}
        solo, shared = self._solo, self._shared
        for chunk in chunks:
            held = shared.get(chunk)
            if held is None:
                if solo.get(chunk) == lease:
                    del solo[chunk]
                continue
            payers, rest = held.payers, held.credited
            if lease in rest:
                del rest[lease]
            elif lease in payers:
                del payers[lease]
                if rest:  # the newest credited holder pays from now on, as the oldest payer
                    newer = rest.popitem()[0]
                    payers[newer] = None
                    payers.move_to_end(newer, last=False)
                    debited[newer] = debited.get(newer, 0) + 1
            else:
                continue
            if len(payers) + len(rest) == 1:  # one holder left: it pays (a credited one has payers after it)
                del shared[chunk]
                solo[chunk] = next(iter(payers))
        return debited

    def credited(self, lease: str, chunks: Sequence[int]) -> int:
        """Chunks of `lease` it does not pay for (a leading run of its chunks)."""
        shared = self._shared
        run = 0
        for chunk in chunks:
            held = shared.get(chunk)
            if held is None or lease not in held.credited:
                break
            run += 1
        return run

    def set_replicas(self, replicas: int) -> dict[str, int]:
        """Let the last `replicas` holders of each chunk pay; returns the change of each holder's credited
        chunks (lease id -> chunks newly credited, negative: paid again). Only the chunks held more than the
        smaller of the two counts change: of a shared chunk, the newest credited holders pay again, or the
        oldest payers are credited."""
        replicas = max(1, int(replicas))
        before, self._replicas = self._replicas, replicas
        changes: dict[str, int] = {}
        if replicas > before:
            for held in self._shared.values():
                payers, rest = held.payers, held.credited
                while rest and len(payers) < replicas:
                    newer = rest.popitem()[0]
                    payers[newer] = None
                    payers.move_to_end(newer, last=False)
                    changes[newer] = changes.get(newer, 0) - 1
        elif replicas < before:
            for held in self._shared.values():
                payers, rest = held.payers, held.credited
                while len(payers) > replicas:
                    older = payers.popitem(last=False)[0]
                    rest[older] = None
                    changes[older] = changes.get(older, 0) + 1
        return changes
