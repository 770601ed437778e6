"""Finding and editing things in an Envoy static bootstrap (the YAML the project ships and renders), shared by
the lean renderer (extproc/envoyconf/lean.py) and the local stack's config edits (devstack/). Plain dicts,
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


def strip_tenant_header(config: dict[str, Any], header: str) -> None:
    """Point the template's tenant-header removal at `header`: the sidecar trusts that header only because
    Envoy removes any client-sent copy, so the two names must be the same."""
    replaced = 0
    for hcm in http_connection_managers(config):
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] != HEADER_MUTATION:
                continue
            for mutation in http_filter["typed_config"]["mutations"]["request_mutations"]:
                if "remove" in mutation:
                    mutation["remove"] = header.lower()
                    replaced += 1
    if replaced != 1:
        raise ValueError(f"the Envoy template must remove exactly one tenant header, found {replaced}")
