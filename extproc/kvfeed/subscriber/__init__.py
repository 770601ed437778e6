"""The sidecar side of the KV feed: watching the exporters (`client`), aggregation per pool, the adaptive
scales and KV budgets the limits follow (`runtime`)."""
