"""The node side of the KV feed: the exporter DaemonSet process (`python -m extproc.kvfeed.exporter`),
which scrapes the engines on its node and serves their samples over gRPC.

Modules, by their path from this folder: the feed's node side, the exporter DaemonSet process (`python -m
extproc.kvfeed.exporter`): `app.py` (scrape the node's servers every second, serve the feed and `/metrics`),
`cli.py` (its command line), `discovery.py` (its targets: a static list, or the inference pods of its node),
`hub.py` (samples fanned out to every watcher, a slow one hurting none), `service.py` (the `KvFeed.Watch` gRPC
stream), `metrics.py` (its own metrics, `extproc_exporter_*`); never imports the subscriber.
"""
