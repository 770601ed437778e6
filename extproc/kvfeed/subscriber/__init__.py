"""The sidecar side of the KV feed: watching the exporters (`client`), aggregation per pool, the adaptive
scales and KV budgets the limits follow (`runtime`).

Modules, by their path from this folder: the feed's sidecar side: `client.py` (watching the exporters, the
newest sample per node, endpoint and model), `aggregate.py` (aggregation per pool), `endpoints.py` (one engine
read alone, for the budget of a picked engine), `engine_budgets.py` (which budgets are one engine's, and when
one goes), `served.py` (each served name mapped to its pool), `readtime.py` (when a sample was read, on the
sidecar's clock), `loop.py` (`FeedbackLoop`: the feed to per-pool limit scales), `runtime.py` (adaptive scales
and KV budgets, and their metrics), `fleet.py` (each pool's KV figures exchanged with the other replicas
through the store's `KvBoard`), `metrics.py` (its metrics), `settings.py` (its plain-data settings, which the
config package fills); never imports the exporter.
"""
