"""The KV budget's settings (`kv_budget` in the config file; docs/feedback.md), beside the budget they set.

Plain data the config package fills from the file and the feed's runtime reads when it builds each pool's
`KvBudget` (`extproc.kvfeed.subscriber.runtime`): kept in the core so the budget's knobs sit with the code
they tune, and importable without the feed or any I/O package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class KvBudgetConfig:
    """The KV-token budget of each pool (`kv_budget` in the config file; docs/feedback.md)."""

    enabled: bool = False
    target_utilization: float = 0.9
    capacity_share: float = 1.0
    booking: Literal["forecast", "lifetime"] = "forecast"  # extproc.core.kv.booked.BookingMode
    # Book a prompt prefix shared by requests in flight once per replica, as the engine's prefix cache holds
    # it (extproc.core.kv.prefix); off: every prompt is booked whole.
    prefix_sharing: bool = True
    # The least share of its completion allowance a request is booked for whatever its tenant's history
    # (extproc.core.kv.completion): forty answers that stop after one token cannot book the next at 0.
    min_completion_ratio: float = 0.1
    # The most of the capacity one tenant's requests in flight may be booked below their completion
    # allowances, in all (extproc.core.kv.credit): a tenant that trained its learned share down cannot burst
    # past the margin the budget keeps; 0 books every request at its whole allowance.
    unconfirmed_share: float = 0.1
    # Fair shares of the cache between tenants (extproc.core.kv.fairness): attained service halves every
    # `service_half_life_seconds`, divided by the tenant's weight (default 1); a refused request claims its
    # KV from later requests of other tenants until it comes back, at most `claim_seconds` after its refusal.
    fair_shares: bool = True
    claim_seconds: float = 10.0
    service_half_life_seconds: float = 30.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
