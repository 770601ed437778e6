"""Admission as the sidecar builds it, without gRPC or Envoy: an in-process store, a fake clock, and, for
classes that wait, the sidecar's wait queue on that same clock."""

from __future__ import annotations

from typing import Any, Self

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.compose import Admission, build_admission
from extproc.core.clock import FakeClock
from extproc.core.limiter.limiter import LimitSpec
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.rules import admission_rules


class AdmissionRig:
    """Admission over an in-process store of `concurrency` slots (None: unlimited) and a KV usage the test
    sets; `queues`: with the wait queue, configured from the config's classes as the sidecar does."""

    def __init__(self, config: dict[str, Any], concurrency: int | None = None, queues: bool = False) -> None:
        self.clock = FakeClock()
        self.metrics = Metrics()
        self.store = LocalStore(clock=self.clock)
        self.concurrency = concurrency
        rules = admission_rules(config)
        self.queue: AdmissionQueue | None = None
        if queues:
            self.queue = AdmissionQueue(self.store, self.clock, self.metrics)
            self.queue.configure(
                [c.name for c in rules.classes], {c.name: c.max_queued for c in rules.classes}
            )
        self.admission: Admission = build_admission(
            lambda: rules, self.store, self.clock, self.metrics, queue=self.queue
        )
        self.kv_usage: float | None = None
        self.admission.service.deps.kv_usage = lambda _pool: self.kv_usage

    async def start(self, **tenant_slots: int) -> Self:
        """Apply the slots: `concurrency` on `global`, and `tenant_slots` on each named tenant's key."""
        limits = {"global": LimitSpec(max_concurrency=self.concurrency)}
        limits |= {f"tenant:{name}": LimitSpec(max_concurrency=n) for name, n in tenant_slots.items()}
        await self.store.apply_limits(limits)
        return self

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    @property
    def active(self) -> int:
        return self.store.limiter.snapshot(["global"])[0].active
