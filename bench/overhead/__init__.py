"""The sidecar's own cost: added latency, throughput per CPU core, streamed-chunk cost, event-loop lag."""
