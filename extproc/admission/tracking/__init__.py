"""An admitted request until it settles: `InFlight`, what the inline profile sees of the answer, what the lean
profile's reader and end reports say, and the lean requests nobody watches.

Modules, by their path from this folder: an admitted request until it settles: `inflight.py` (`InFlight`: an
admitted request until it settles: one `observe(Seen)`, one `settle()`, the one cut rule, `learn_pace`),
`engine_run.py` (`EngineRun`: an admitted request's run in its pool's engine tally, and the engines' count of
an answer not seen whole, once the feed has read past its end), `usage_tracker.py` (`ResponseUsageTracker`: a
response's usage as it streams, in its API's dialect), `answer.py` (what the inline profile sees of the
answer), `reading.py` (the lean profile's response path: an API's reading spec, and the reader's findings as
`ResponseFacts`), `unseen.py` (the lean profile's requests whose answers the sidecar never sees: the registry
of their report keys, end reports, the bounded wait, the tick, `ReportChannel`)."""
