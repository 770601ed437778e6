"""Finding things in an Envoy static bootstrap (the YAML the project ships and renders), shared by the
lean renderer (extproc/lean/render.py) and the local stack's config edits (extproc/stack.py). Plain dicts,
no I/O."""

from __future__ import annotations

from typing import Any

HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
"""The first HTTP filter of envoy/envoy.yaml: it strips client-sent control headers; its plain `remove`
entry is the tenant header."""


def http_connection_managers(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The `typed_config` of every HTTP connection manager of every listener, in order (editable in place)."""
    return [
        network_filter["typed_config"]
        for listener in config["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for network_filter in chain["filters"]
        if network_filter["name"] == HTTP_CONNECTION_MANAGER
    ]
