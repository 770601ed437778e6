"""The two profiles (how Envoy and the sidecar split a request's work) and the inline template the lean one is
rendered from, for the command line (`python -m extproc envoy-config`) and the local stack."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout the package runs from: the Envoy templates live beside it, not in the wheel."""
ENVOY_TEMPLATE = REPO / "envoy" / "envoy.yaml"
"""The inline profile's Envoy config, the source of the lean rendering."""

PROFILES = ("inline", "lean")
"""How Envoy and the sidecar split a request's work (docs/architecture.md): `inline` sends the sidecar every
message of a request, response chunks included; `lean` sends it the request body, reads the response with a
Lua filter and reports each request's end through the gRPC access log."""
DEFAULT_PROFILE = "lean"
"""`make run`'s profile, chosen by measurement (bench/RESULTS.md, overhead of both profiles): it takes the
response path out of Python."""
