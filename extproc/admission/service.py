"""The admission service: the dependencies every request shares, whatever its protocol profile.

`AdmissionService` holds the rules, the limiter store, the KV budgets, the wait queue, the metrics and the
tokenizer threads, and the few operations that need them together: acquiring a lease so that a cancelled
caller can never leak one, settling through its `Settler` (capacity/settler.py), retry hints from the
leases held here (their holders registered by those who keep them: the open protocol streams by
compose.py's `OpenStreams`, the lean profile's requests awaiting their end report by `UnseenStreams`,
tracking/unseen.py). It decides nothing: a request's decision is `Decision`
(deciding/decision.py), its admitted life `InFlight` (tracking/inflight.py), the two joined by `Exchange`
(exchange.py); `compose.py` builds the whole from the rules, store and clock. It names nothing above it:
what it reads of an admitted request is the narrow `Holder` it declares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.hints import SlotHints
from extproc.admission.capacity.lanes import Lanes
from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.capacity.settler import Settler
from extproc.admission.intake.request import ParsedRequest
from extproc.admission.intake.reservation import count_prompt_tokens
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.vocabulary.policy import ModelPolicy
from extproc.admission.vocabulary.prompt import Count
from extproc.core.clock import Clock, monotonic
from extproc.core.engine.adaptive import never_down
from extproc.core.engine.pace import PoolPaces
from extproc.core.engine.tally import EngineTally, no_tally
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import Lease, Rejection
from extproc.core.ports import LimiterStore
from extproc.core.queue.slot_eta import OpenLease, hint_within
from extproc.metrics import LabelledChildren, Metrics

log = logging.getLogger(__name__)

ENGINE_RETRY_AFTER_S = 1.0
"""The least `retry-after` sent with an engine's refusal, and the one sent while nothing is open here to
forecast from: as for the sidecar's own refusals, a client told "now" spends its retries at once."""


@dataclass
class Deps:
    """What every request needs; `rules` is read per request so a reload applies to new requests only."""

    rules: Callable[[], AdmissionRules]
    store: LimiterStore
    metrics: Metrics
    executor: Executor | None = None
    clock: Clock = monotonic
    kv_budget: Callable[[str], KvBudget | None] = lambda _pool: None
    # The KV budget of one engine of the pool, under the key its changes are published with; None where the
    # feed does not know that engine now (the pool's budget then books the request).
    endpoint_budget: Callable[[str, str], tuple[str, KvBudget] | None] = lambda _pool, _endpoint: None
    budget_changed: Callable[[str], None] = lambda _pool: None
    kv_usage: Callable[[str], float | None] = lambda _pool: None
    engine_tally: Callable[[str], EngineTally | None] = no_tally  # the engines' own counts, from the feed
    feeds_pool: Callable[[str], bool] = lambda _pool: False  # whether the KV feed reports this pool
    # The engine refused an admitted request of this pool (its queue full): the pool's scale drops at once.
    engine_refused: Callable[[str], None] = lambda _pool: None
    # Seconds the feed has shown no live endpoint of this pool (None: not down): refused up front.
    engine_down_for: Callable[[str], float | None] = never_down
    # The name whose policy and pool a requested model uses (an engine-listed alias or adapter: its base
    # pool); None refuses it as a model the engines do not serve (kvfeed.subscriber.runtime.served_as).
    # Asked with the rules the request is admitted under, so one request never mixes two configs.
    served_as: Callable[[str, AdmissionRules], str | None] = lambda model, _rules: model
    queue: AdmissionQueue | None = None
    settle_executor: Executor | None = None


class Holder(Protocol):
    """An admitted request as the retry hints read it (an `InFlight`, extproc/admission/tracking/): the lease
    it holds on a key, if any. Declared here so the service never names the in-flight code above it."""

    def open_lease(self, key: str) -> OpenLease | None: ...


@dataclass(eq=False)
class AdmissionService:
    """What every request shares (see the module docstring)."""

    deps: Deps
    _pending: set[asyncio.Future[Any]] = field(default_factory=set)
    paces: PoolPaces = field(default_factory=PoolPaces)
    slot_hints: SlotHints = field(default_factory=SlotHints)
    lanes: Lanes = field(init=False)
    # Holders of leases here: the open streams' requests (compose.py `OpenStreams`), and the lean profile's
    # requests whose stream ended before their end report came (extproc/admission/tracking/unseen.py).
    holders: list[Callable[[], Iterable[Holder]]] = field(default_factory=list)
    child: LabelledChildren = field(default_factory=LabelledChildren)
    settler: Settler = field(init=False)
    # The deps' own rules, clock and metrics, held as they are (not wrapped): every request reads them.
    # `rules()` is the rules current now, what a request arriving now is decided by; a decision reads them
    # once and passes them on, so a reload in the middle never mixes two configs in one decision.
    rules: Callable[[], AdmissionRules] = field(init=False)
    clock: Clock = field(init=False)
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        deps = self.deps
        self.rules, self.clock, self.metrics = deps.rules, deps.clock, deps.metrics
        # The hook read per call: the composition may fill it in after the service is built.
        self.settler = Settler(
            deps.store,
            deps.metrics,
            self.child,
            self.track,
            lambda pool: deps.engine_refused(pool),
            deps.queue,
        )
        tokenizing = deps.rules().tokenizing
        self.lanes = Lanes(deps.executor, tokenizing.threads, clock=deps.clock)
        self.lanes.configure(tokenizing)

    # -- counting ------------------------------------------------------------------------------------------

    def count(self, decision: str, reason: str, model_label: str, klass: str, tenant: str | None) -> None:
        """One decision, counted once: by model and class, and by tenant (allow-listed or `other`)."""
        self.child(self.metrics.requests, decision, reason, model_label, klass).inc()
        if tenant is not None:
            label = self.rules().tenant_label(tenant)
            self.child(self.metrics.tenant_requests, label, decision).inc()

    def count_admitted(self, admitted: Admitted) -> None:
        """One admission, counted once: as a decision, in the tokens it reserves, among those active."""
        label = admitted.model_label
        self.count("admitted", "ok", label, admitted.klass.name, admitted.tenant)
        self.child(self.metrics.tokens_reserved, label).inc(admitted.plan.total)
        self.metrics.active.inc()

    # -- tokenizing -----------------------------------------------------------------------------------------

    async def count_prompts(self, req: ParsedRequest, policy: ModelPolicy, lane: str) -> list[Count]:
        """Count a request's prompts without letting one client's floods delay anybody else.

        A small prompt is counted on the event loop (cheaper than a thread hop, and it never queues behind
        large ones). A large prompt goes to the tokenizer threads through its client's lane (`lanes.py`):
        fair turns between clients, a backlog per client bounded by the time it takes (LaneFull beyond it).
        Counting itself stops once a prompt is proven larger than the context window.
        """
        if req.text_bytes <= self.rules().tokenizing.inline_count_bytes:
            return count_prompt_tokens(req, policy)
        return await self.lanes.run(lane, req.text_bytes, count_prompt_tokens, req, policy)

    # -- retry hints ----------------------------------------------------------------------------------------

    def retry_hint(self, rejection: Rejection) -> Rejection:
        """A slot refusal's `retry-after` from the leases open here on its key (`hints.py`)."""
        return self.slot_hints.apply(rejection, self.clock(), self._open_leases)

    def capacity_starts(
        self, rejection: Rejection, runs: Sequence[float], held: Sequence[float]
    ) -> list[float] | None:
        """Seconds until each of a line of requests refused so is expected to have its capacity, each
        holding it for its run, beside slots `held` that long by leases not open yet (`hints.py`
        `SlotHints.starts`)."""
        return self.slot_hints.starts(rejection, self._open_leases, runs, held)

    def _open_leases(self, key: str) -> list[OpenLease]:
        """The requests that hold a lease on `key` here: those whose streams are open, and (lean) those
        whose end report has not arrived, the request ended or not: each holds its slot until it settles."""
        inflights: dict[int, Holder] = {}
        for held in self.holders:
            inflights |= {id(f): f for f in held()}
        return [lease for f in inflights.values() if (lease := f.open_lease(key)) is not None]

    # -- leases --------------------------------------------------------------------------------------------

    async def acquire(
        self, keys: list[str], tokens: int, holder: str, use_pool: bool = True, output_tokens: int = 0
    ) -> Lease | Rejection:
        """Acquire so that a lease granted while the caller is being cancelled is given back, not leaked;
        `output_tokens` of `tokens` are the reserved completion (what an `output:` key's bucket holds)."""
        future = asyncio.ensure_future(
            self.deps.store.acquire(keys, tokens, holder, use_pool=use_pool, output_tokens=output_tokens)
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._give_back_if_granted)
            raise

    def _give_back_if_granted(self, done: asyncio.Future[Lease | Rejection]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        lease = done.result()
        if isinstance(lease, Lease):
            self.track(asyncio.ensure_future(self.deps.store.release(lease, 0)))

    def track(self, future: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Keep a background settlement alive until it ends, so shutdown can wait for it."""
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def engine_retry_after(self, admitted: Admitted) -> float:
        """The `retry-after` of the engine's refusal of `admitted` (settled already, so not counted among
        the open leases): when a slot of its pool is expected to free, from the leases open here, as for
        the sidecar's own slot refusals (`hints.py`); at least `ENGINE_RETRY_AFTER_S`, at most what SDKs
        honour."""
        key = next((k for k in admitted.lease.keys if k.startswith("model:")), None)
        eta = None if key is None else self.slot_hints.hint(key, self.clock(), self._open_leases)
        return hint_within(eta, ENGINE_RETRY_AFTER_S)

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait for settlements already started, so shutdown never drops a refund."""
        while self._pending:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._pending), return_exceptions=True)
