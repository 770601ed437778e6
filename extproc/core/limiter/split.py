"""Separate input and output tokens-per-minute limits, as limiter keys of their own.

A key's `input_tokens_per_minute` and `output_tokens_per_minute` (`LimitSpec`) are not buckets of that key's
state: each becomes a derived key, `input:<key>` and `output:<key>`, with a plain tokens-per-minute limit.
A request names the derived keys of its keys beside them, so the joint limiter admits it only when every
bucket holds its part: the total bucket of `<key>` the whole reservation (prompt + reserved completion), the
input bucket the prompt, the output bucket the reserved completion. Settlement charges each bucket its part
of what was used (the prompt as charged, the completion generated), and a bound admission's correction
gives prompt tokens back to the total and input buckets only. Both stores compute every per-key amount with
`key_tokens`, so they agree by construction; a refusal on a derived key names its bucket (`token_reason`),
and its retry-after is that bucket's refill wait.

Why derived keys rather than more buckets per key: everything a key already has (the Redis key layout and
scripts, lease expiry and renewal, the `extproc_limit_*` gauges, the tightest-status headers, lazy reloads,
idle pruning) then serves the split limits unchanged. What they do not share: class guarantees (a derived key
is one pool) and the adaptive scale (fed to `model:<pool>` only), so KV pressure narrows the total bucket and
the slots, not the split limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.core.limiter.state import LimitSpec

INPUT_PREFIX = "input:"
OUTPUT_PREFIX = "output:"


def key_tokens(key: str, total: int, output: int) -> int:
    """The part of `total` tokens (of which `output` are completion) that `key`'s bucket holds."""
    if key.startswith(INPUT_PREFIX):
        return max(0, total - output)
    if key.startswith(OUTPUT_PREFIX):
        return max(0, min(output, total))
    return total


def derived_keys(key: str) -> tuple[str, str]:
    return INPUT_PREFIX + key, OUTPUT_PREFIX + key


def base_key(key: str) -> str:
    """The key a derived key splits (`input:model:m` -> `model:m`); any other key is its own."""
    for prefix in (INPUT_PREFIX, OUTPUT_PREFIX):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def has_split(spec: LimitSpec) -> bool:
    return spec.input_tokens_per_minute is not None or spec.output_tokens_per_minute is not None


def _derived_specs(spec: LimitSpec) -> tuple[LimitSpec, LimitSpec]:
    """The input and output keys' specs: a bucket each where set, else unlimited."""
    return (
        LimitSpec(tokens_per_minute=spec.input_tokens_per_minute),
        LimitSpec(tokens_per_minute=spec.output_tokens_per_minute),
    )


def expand(
    specs: Mapping[str, LimitSpec], defaults: Mapping[str, LimitSpec]
) -> tuple[dict[str, LimitSpec], dict[str, LimitSpec]]:
    """The limiter's spec tables with the derived keys added: each key with a split limit gets its two, and
    so does every configured key under a prefix whose default has one (unlimited where the key has none),
    so that a key configured without split limits is not given its prefix default's."""
    split_prefixes = tuple(p for p, d in defaults.items() if has_split(d))
    out_specs = dict(specs)
    for key, spec in specs.items():
        if has_split(spec) or key.startswith(split_prefixes):
            out_specs.update(zip(derived_keys(key), _derived_specs(spec), strict=True))
    out_defaults = dict(defaults)
    for prefix in split_prefixes:
        out_defaults.update(zip(derived_keys(prefix), _derived_specs(defaults[prefix]), strict=True))
    return out_specs, out_defaults


@dataclass(frozen=True, slots=True)
class SplitIndex:
    """Which limiter keys have split limits, so a request names derived keys only where they exist.

    `split` are the configured keys with a split limit; `plain` the configured keys without one; a key that
    is neither takes its prefix default's (`prefixes`: the prefixes whose default has one). Picklable: it
    crosses the reload child's pipe with the admission rules.
    """

    split: frozenset[str] = frozenset()
    plain: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def of(cls, specs: Mapping[str, LimitSpec], defaults: Mapping[str, LimitSpec]) -> SplitIndex:
        prefixes = tuple(p for p, d in defaults.items() if has_split(d))
        split = frozenset(k for k, s in specs.items() if has_split(s))
        plain = frozenset(k for k in specs if k not in split and k.startswith(prefixes)) if prefixes else None
        return cls(split=split, plain=plain or frozenset(), prefixes=prefixes)

    def keys_for(self, keys: list[str]) -> list[str]:
        """`keys` followed by the derived keys of those with split limits."""
        out = list(keys)
        for key in keys:
            if key in self.split or (key not in self.plain and key.startswith(self.prefixes)):
                out += derived_keys(key)
        return out
