"""The engine an inference pool's endpoint picker chose for a request, read from the request's headers.

Where the sidecar runs after the picker (docs/gateways.md, "Booked on the picked engine"), the picker has set
`x-gateway-destination-endpoint` before the sidecar sees the request: `<ip:port>`, or a list whose first is
the primary and the rest the fallbacks a retry goes down (kubernetes-sigs/gateway-api-inference-extension
docs/proposals/004-endpoint-picker-protocol, protocol v1.0.0). The request is booked on the primary's KV
budget. Read only where the operator trusts it (`admission.inference_pool.trust_destination_endpoint`): in
front of the picker the header is the client's own, and a client must not pick the budget it is booked on.

A value that is not one `host:port` is ignored (the request is booked on the pool, as without a picker), never
refused: the picker, not the client, wrote it, and the pool's budget is the safe reading. The endpoint is
matched against the feed's endpoints (`FeedSample.endpoint`, the pod's `ip:port` under Kubernetes
discovery); one the feed does not know books the pool too, so a made-up value grows no budget.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from extproc.admission.vocabulary.names import DESTINATION_ENDPOINT_HEADER

MAX_ENDPOINT_CHARS = 261
"""The longest `host:port` read: a DNS name's 253 characters, a colon and a five-digit port (an IPv6 address
in brackets is shorter)."""

_ENDPOINT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")


def picked_endpoint(headers: Mapping[str, str], trusted: bool) -> str | None:
    """The primary endpoint the picker named, where the operator trusts the header; else None."""
    if not trusted:
        return None
    value = headers.get(DESTINATION_ENDPOINT_HEADER, "")
    primary = value.split(",", 1)[0].strip()
    if len(primary) > MAX_ENDPOINT_CHARS or not _ENDPOINT_RE.fullmatch(primary):
        return None
    return primary
