"""How a key's capacity is split between guaranteed class shares and the burstable pool, under pressure.

A key (say `model:llama`) has a total: N slots and M tokens per minute. Classes may hold guarantees inside
it; what is left is the burstable pool any class may borrow from. When the adaptive scale drops below 1 the
total shrinks, and the cut is taken in a fixed order so that the least important capacity goes first:

1. the burstable pool shrinks, down to nothing;
2. then the guarantees of the lowest class, then the next one up, class by class;
3. the guarantee of the highest class is the last thing touched.

Pure arithmetic, used for both dimensions (slots are whole numbers, tokens are not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SHARED = "_shared"
"""Name of the burstable pool among a key's shares."""


def scaled_total(total: float, scale: float, whole: bool) -> float:
    """The total under `scale`; whole-number totals round down but keep one slot unless the base is zero."""
    if total <= 0:
        return 0.0
    if whole:
        # The epsilon keeps float error from losing a slot: 100 x 0.29 is 28.999999999999996.
        return float(max(1, math.floor(total * scale + 1e-9)))
    return max(1.0, total * scale)


def effective_shares(
    total: float,
    guarantees: Mapping[str, float],
    priority: Sequence[str],
    scale: float,
    whole: bool,
) -> dict[str, float]:
    """Effective capacity of every class guarantee and of the shared pool at `scale`.

    `priority` lists classes highest first; guarantees of classes missing from it are cut before any listed
    class. The shares always add up to the scaled total (or to the sum of guarantees, if that is larger).
    """
    reserved = sum(guarantees.values())
    shared = max(0.0, total - reserved)
    cut = max(0.0, total - scaled_total(total, scale, whole))
    out = {SHARED: max(0.0, shared - cut)}
    cut = max(0.0, cut - shared)
    ranked = [c for c in priority if c in guarantees]
    order = [c for c in guarantees if c not in ranked] + list(reversed(ranked))  # lowest first
    for name in order:
        taken = min(cut, guarantees[name])
        out[name] = guarantees[name] - taken
        cut -= taken
    return out
