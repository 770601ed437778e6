"""The one place the admission layer is put together: from the rules, limiter store and clock (and, where
the sidecar has them, the KV feed's signals, the wait queue and worker threads) to a running `Admission`.

The sidecar (extproc/app.py) and the unit tests build it the same way, so a test's exchange is the
sidecar's exchange without gRPC: `build_admission(...).exchange()`. The rules are admission's own type
(extproc/admission/intake/rules.py), which the config package builds once per load; nothing here reads a
config.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.exchange import Exchange
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.service import AdmissionService, Deps
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.core.clock import Clock
from extproc.core.kv_budget import KvBudget
from extproc.core.ports import LimiterStore
from extproc.metrics import Metrics


class KvSignals(Protocol):
    """What admission reads from the KV feed (extproc/kvfeed/subscriber/runtime.py `FeedbackRuntime`)."""

    def budget(self, pool: str) -> KvBudget | None: ...

    def budget_changed(self, pool: str) -> None: ...

    def kv_usage(self, pool: str) -> float | None: ...

    def decode_rate(self, pool: str) -> float | None: ...

    def feeds_pool(self, pool: str) -> bool: ...

    def engine_refused(self, pool: str) -> None: ...


@dataclass(frozen=True)
class Admission:
    """The admission layer: the shared service, and the lean profile's bookkeeping of unseen answers."""

    service: AdmissionService
    unseen: UnseenStreams

    def exchange(self, reported: bool = False) -> Exchange:
        """A new request: inline (its answer seen message by message), or `reported` (lean: the proxy
        reports its end)."""
        return Exchange(self.service, self.unseen if reported else None)

    def opened(self, exchange: Exchange) -> None:
        """A protocol stream opened for `exchange`: open until `closed` (the service closes it at shutdown
        and reads its lease for retry hints), and counted in `extproc_streams_active`."""
        self.service.register(exchange)
        self.service.metrics.streams.inc()

    def closed(self, exchange: Exchange) -> None:
        self.service.unregister(exchange)
        self.service.metrics.streams.dec()


def build_admission(
    rules: Callable[[], AdmissionRules],
    store: LimiterStore,
    clock: Clock,
    metrics: Metrics,
    *,
    signals: KvSignals | None = None,
    queue: AdmissionQueue | None = None,
    executor: Executor | None = None,
    settle_executor: Executor | None = None,
    served_as: Callable[[str, AdmissionRules], str | None] | None = None,
) -> Admission:
    """Admission over `store`, reading `rules()` per request (a reload applies to new requests only).

    `served_as` names the model whose rules and pool a requested name uses (the feed's served names, read
    with the rules the request is admitted under); without it every name is itself."""
    deps = Deps(
        rules=rules,
        store=store,
        metrics=metrics,
        executor=executor,
        clock=clock,
        queue=queue,
        settle_executor=settle_executor,
    )
    if signals is not None:
        deps.kv_budget = signals.budget
        deps.budget_changed = signals.budget_changed
        deps.kv_usage = signals.kv_usage
        deps.feeds_pool = signals.feeds_pool
        deps.engine_refused = signals.engine_refused
    if served_as is not None:
        deps.served_as = served_as
    service = AdmissionService(deps)
    if queue is not None:
        queue.starts = service.capacity_starts  # waiters' deadlines, weighed against the open leases here
    if signals is not None:
        service.decode_rates.fed = signals.decode_rate  # the feed's pace, until one is learned
    return Admission(service, UnseenStreams(service))
