"""The admission core, protocol-free: this folder's own modules (the top) over seven packages and
`service.py`, which run from the bottom up, each importing only those before it (vocabulary → replies → apis →
intake → capacity → service → deciding → tracking); docs/architecture.md's layer table holds the rule.

Modules of the top, what the protocol layer builds and talks to: `compose.py`
(`build_admission`: the one place the layer is built from its rules, store and clock; `OpenStreams`: the
requests whose protocol streams are open, which the servicer opens and closes, the sidecar closes at shutdown
and the retry hints read), `exchange.py` (`Exchange`: one request's life as an explicit state machine:
routing, then the decision, then the answer; what a translator asks of admission).
"""
