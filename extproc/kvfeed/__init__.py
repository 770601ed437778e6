"""The KV-cache feed: engines' metrics pages read on each node and streamed to every sidecar.

This package's top holds what both sides share: engine profiles (`engines`), the metrics-page parser
(`parse`), the scraper and its targets, `FeedSample` (`sample`) and its protobuf form (`proto/`). Its two
sides are the subpackages: `exporter/` runs on the node (the DaemonSet process, `python -m
extproc.kvfeed.exporter`) and `subscriber/` in the sidecar (watching exporters, aggregation per pool,
adaptive scales and KV budgets). The top imports neither side, and the two sides never import each other.

The protobuf package stays `extproc.feedback.v1` (proto/feedback.proto): its name is in the gRPC method
paths (`/extproc.feedback.v1.KvFeed/Watch`), the wire API between exporters and sidecars of any version.

Modules, by their path from this folder: the KV-cache feed; this row is what both sides share: `engines.py`
(one `EngineProfile` per engine: what the feed reads from it), `parse.py` (an engine's metrics page to
per-model KV and queue signals), `scraper.py` (one scrape of a server into feed samples, never raising for a
bad target), `targets.py` (scrape targets: where, what kind, which model), `listing.py` (the names a server
serves per pool, from its model list), `pace.py` (`EnginePaceMeter`: an endpoint's measured decode pace from
two scrapes, and the feed's own bound on a pace), `sample.py` (`FeedSample`, its validation and its protobuf
form) and `proto/` (protobuf package `extproc.feedback.v1`: the wire API, unchanged by the folder's name);
imports neither side.
"""
