"""Pure limiter math, by job: `limiter/`, `kv/` (the KV budget, with its config), `engine/` (what the feed
says of the engine), `queue/`; on top the stores' port and the injected clock.

Modules, by their path from this folder: `limiter/` (`bucket.py` (TPM bucket: refill, refunds capped at
capacity, debt), `limiter.py` (joint limiter: slots + buckets per key, all-or-nothing, exactly-once leases,
run-time limit and scale changes), `state.py` (the per-key state both stores compute with: free slots, where
tokens fit, retry hints, the tightest status), `split.py` (separate input and output TPM limits as derived
keys `input:<key>` / `output:<key>`), `shares.py` (a key's capacity split between guaranteed class shares and
the burstable pool)); `kv/` (the KV-token budget: `budget.py` (`KvBudget`, a facade over its parts, each with
the state it changes), `config.py` (`KvBudgetConfig`: the budget's settings, which the config package fills),
`metrics.py` (`KvBudgetMetrics`: the budget's `extproc_kv_*` series, which the feed's metrics own), `lease.py`
(one admitted request as the budget books it: footprint, trajectory), `ledger.py` (the leases and the sum of
their footprints, what a new one is expected to generate, what a released one teaches), `booked.py` (what the
leases are booked for: lifetime demand or forecast peak, with the engine's corrections), `pacing.py`
(`BudgetPace`: the paces the forecast and the hints take, when a lease is in the engine's gauges),
`prefix_credit.py` (the prefix credit: shared chunks booked once per replica), `correction.py` (the engine's
samples: KV the leases do not explain, leases it has finished, this replica's figures for the others),
`pool_share.py` (this replica's share of the pool's capacity, beside the other replicas'), `claims.py` (fair
shares: a refusal's claim and its `retry-after`), `credit.py` (the bound on what one tenant's requests may be
booked below their allowances), `fleet.py` (one pool's budget across the gateway replicas), `order.py` (one
order across them for the requests that wait for KV), `prefill.py` (evidence from the engines' prompt counter
that a lease is prefilled, for the downward correction),
`forecast.py` (forecast peak of decoding requests), `prefix.py` (the prompt prefixes in-flight requests share,
booked once per replica), `fairness.py` (tenants' attained KV service and the one claim per pool),
`schedule.py` (a KV refusal's `retry-after`), `completion.py` (expected completion per tenant)); `engine/`
(what the feed says of the engine: `adaptive.py` (KV watermark controller: usage and queue depth to a scale),
`pace.py` (the decode pace per sequence: `LearnedPace`, learned from streams; `PoolPaces`, each pool's
learned, fed or assumed pace that charges and hints read; `usable_rate`, the one validity rule), `tally.py` (a
pool's generation counters over time: a request's share of what its engines generated), `series.py` (readings
over time, bounded: the tally's counters and the other replicas' runs), `done.py` (the requests the engine is
done with, confirmed over feed samples), `counter.py` (one counter of a pool's engines summed as growth: the
prompt tokens they prefilled), `runon.py` (steps an engine ran past a request's count, charged to the requests
that stopped), `steps.py` (the engines' step time against their batch: the pace a batch of another size runs
at, for hints)); `queue/` (waiting for capacity: `waitqueue.py` (`WaitQueue`, the admission order),
`slot_eta.py` (when a slot frees), `slip.py` (`ForecastSlip`: how late capacity comes against the forecast),
`drain.py` (`DrainPace`: how fast a class's queue has lately drained)); and on top `ports.py` (the
`LimiterStore` interface stores implement), `clock.py` (injected time)."""
