"""The node side of the KV feed: the exporter DaemonSet process (`python -m extproc.kvfeed.exporter`),
which scrapes the engines on its node and serves their samples over gRPC."""
