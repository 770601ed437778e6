"""Benchmarks: protection of the KV cache on replayed Azure traces, the sidecar's own cost, microbenchmarks.

`python -m bench --short` (`make bench`) runs a reduced set in under five minutes; `python -m bench --full`
(`make bench-full`) runs everything `bench/RESULTS.md` reports. Raw results go to `bench/results/`.
"""

import os

# The stack's processes start through a fork (devstack/processes.py); gRPC's fork handlers must not run in
# it: off before gRPC loads (tests/conftest.py says why).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
