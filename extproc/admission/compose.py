"""The one place the admission layer is put together: from the rules, limiter store and clock (and, where
the sidecar has them, the KV feed's signals, the wait queue and worker threads) to a running `Admission`.

The sidecar (extproc/app.py) and the unit tests build it the same way, so a test's exchange is the
sidecar's exchange without gRPC: `build_admission(...).exchange()`. The rules are admission's own type
(extproc/admission/intake/rules.py), which the config package builds once per load; nothing here reads a
config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.exchange import Exchange
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.service import AdmissionService, Deps, Holder
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.core.clock import Clock
from extproc.core.engine.tally import EngineTally
from extproc.core.kv.budget import KvBudget
from extproc.core.ports import LimiterStore
from extproc.metrics import Metrics


class KvSignals(Protocol):
    """What admission reads from the KV feed (extproc/kvfeed/subscriber/runtime.py `FeedbackRuntime`)."""

    def budget(self, pool: str) -> KvBudget | None: ...

    def endpoint_budget(self, pool: str, endpoint: str) -> tuple[str, KvBudget] | None: ...

    def budget_changed(self, pool: str) -> None: ...

    def kv_usage(self, pool: str) -> float | None: ...

    def decode_rate(self, pool: str) -> float | None: ...

    def engine_tally(self, pool: str) -> EngineTally | None: ...

    def feeds_pool(self, pool: str) -> bool: ...

    def engine_refused(self, pool: str) -> None: ...

    def engine_down_for(self, pool: str) -> float | None: ...


class OpenStream(Protocol):
    """A request whose protocol stream is open (an `Exchange`): closed at shutdown, and read for the lease
    it holds (retry hints count only what this replica holds open)."""

    @property
    def inflight(self) -> Holder | None: ...

    def close(self) -> None: ...


class OpenStreams:
    """The requests whose protocol streams are open here: what the servicer opens and closes, the sidecar
    counts and closes at shutdown, and the retry hints read for the leases they hold (`holders`, registered
    with the service)."""

    def __init__(self) -> None:
        self._open: set[OpenStream] = set()

    def add(self, stream: OpenStream) -> None:
        self._open.add(stream)

    def discard(self, stream: OpenStream) -> None:
        self._open.discard(stream)

    def __len__(self) -> int:
        return len(self._open)

    def holders(self) -> Iterator[Holder]:
        """The admitted requests of the open streams."""
        return (inflight for stream in self._open if (inflight := stream.inflight) is not None)

    def close_all(self) -> None:
        """On shutdown after the grace period: settle what is still open with what is known."""
        for stream in list(self._open):
            stream.close()


@dataclass(frozen=True)
class Admission:
    """The admission layer: the shared service, the open streams, and the lean profile's bookkeeping of
    unseen answers."""

    service: AdmissionService
    streams: OpenStreams
    unseen: UnseenStreams

    def exchange(self, reported: bool = False) -> Exchange:
        """A new request: inline (its answer seen message by message), or `reported` (lean: the proxy
        reports its end)."""
        return Exchange(self.service, self.unseen if reported else None)

    def opened(self, exchange: Exchange) -> None:
        """A protocol stream opened for `exchange`: open until `closed` (`OpenStreams`: closed at
        shutdown, read for its lease by the retry hints), and counted in `extproc_streams_active`."""
        self.streams.add(exchange)
        self.service.metrics.streams.inc()

    def closed(self, exchange: Exchange) -> None:
        self.streams.discard(exchange)
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
        deps.endpoint_budget = signals.endpoint_budget
        deps.budget_changed = signals.budget_changed
        deps.kv_usage = signals.kv_usage
        deps.feeds_pool = signals.feeds_pool
        deps.engine_refused = signals.engine_refused
        deps.engine_down_for = signals.engine_down_for
        deps.engine_tally = signals.engine_tally
    if served_as is not None:
        deps.served_as = served_as
    service = AdmissionService(deps)
    if queue is not None:
        queue.starts = service.capacity_starts  # waiters' deadlines, weighed against the open leases here
    if signals is not None:
        service.paces.fed = signals.decode_rate  # the engines' pace: until one is learned, and a floor
        deps.kv_budget = _assuming_pace(signals.budget, service)
        deps.endpoint_budget = _engine_assuming_pace(signals.endpoint_budget, service)
    streams = OpenStreams()
    service.holders.append(streams.holders)  # before the unseen requests': the open streams are read first
    return Admission(service, streams, UnseenStreams(service))


def _assuming_pace(
    budgets: Callable[[str], KvBudget | None], service: AdmissionService
) -> Callable[[str], KvBudget | None]:
    """The pools' KV budgets, each told the decode pace assumed where none is learned or fed
    (`admission.assumed_decode_tokens_per_second`, as reloaded), which its refusals' `retry-after` takes
    with no other (`KvBudget.hint_rate`): the first burst after a start, before the feed has a pace."""

    def budget(pool: str) -> KvBudget | None:
        found = budgets(pool)
        if found is not None:
            found.assume_pace(service.paces.default_tokens_per_second)
        return found

    return budget


def _engine_assuming_pace(
    budgets: Callable[[str, str], tuple[str, KvBudget] | None], service: AdmissionService
) -> Callable[[str, str], tuple[str, KvBudget] | None]:
    """The engines' KV budgets (a picker named the engine), each told the assumed pace as a pool's is."""

    def budget(pool: str, endpoint: str) -> tuple[str, KvBudget] | None:
        found = budgets(pool, endpoint)
        if found is not None:
            found[1].assume_pace(service.paces.default_tokens_per_second)
        return found

    return budget
