"""The local stack for development, tests and benchmarks: the simulator, the sidecar and a real Envoy on
127.0.0.1 as processes (`make run`, `python -m devstack`). Outside the product: the sidecar's package
(extproc/) never imports it, and the wheel and the image ship extproc alone.

- `processes`: free ports, the Envoy binary and its command line, child processes, waiting for HTTP.
- `envoy`: the Envoy config of a stack (the shipped template, or its lean rendering, on the stack's ports).
- `stack`: `LocalStack`, the three processes (and the KV-cache exporter) wired together.
- `run`: `make run` in the foreground, with its banner.
"""

import os

# The stack's processes start through a fork (devstack/processes.py); gRPC's fork handlers must not run in
# it: off before gRPC loads (tests/conftest.py says why).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
