"""Benchmarks: protection of the KV cache on replayed Azure traces, the sidecar's own cost, microbenchmarks.

`python -m bench --short` (`make bench`) runs a reduced set in under five minutes; `python -m bench --full`
(`make bench-full`) runs everything `bench/RESULTS.md` reports. Raw results go to `bench/results/`.
"""
