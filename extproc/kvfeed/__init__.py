"""The KV-cache feed: engines' metrics pages read on each node and streamed to every sidecar.

This package's top holds what both sides share: engine profiles (`engines`), the metrics-page parser
(`parse`), the scraper and its targets, `FeedSample` (`sample`) and its protobuf form (`proto/`). Its two
sides are the subpackages: `exporter/` runs on the node (the DaemonSet process, `python -m
extproc.kvfeed.exporter`) and `subscriber/` in the sidecar (watching exporters, aggregation per pool,
adaptive scales and KV budgets). The top imports neither side, and the two sides never import each other.

The protobuf package stays `extproc.feedback.v1` (proto/feedback.proto): its name is in the gRPC method
paths (`/extproc.feedback.v1.KvFeed/Watch`), the wire API between exporters and sidecars of any version.
"""
