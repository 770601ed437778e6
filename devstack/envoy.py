"""The local stack's Envoy config: the shipped template (or its lean rendering) on the stack's ports, and the
edits tests and benchmarks make to it (a client-chosen tenant, Envoy without the sidecar)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from devstack.processes import Ports
from extproc.config import Config
from extproc.envoyconf.bootstrap import HEADER_MUTATION, http_connection_managers, strip_tenant_header
from extproc.envoyconf.lean import render_lean
from extproc.envoyconf.profiles import ENVOY_TEMPLATE, PROFILES
from extproc.envoyconf.upstream import UPSTREAM_CLUSTER, discovery_type


def render_envoy_config(
    ports: Ports,
    template: Path = ENVOY_TEMPLATE,
    tenant_header: str | None = None,
    profile: str = "inline",
    sidecar: Config | None = None,
    upstream: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The Envoy config with the stack's ports in place of the documented ones, stripping `tenant_header`
    (the sidecar's `admission.tenant.header`) from client requests instead of the template's default. The
    lean profile is rendered from the (inline) template with the sidecar's path table and body cap.
    `upstream` (host, port) replaces the local upstream (a name is resolved by DNS, as a Service would be)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    if tenant_header is not None:
        strip_tenant_header(config, tenant_header)
    if profile == "lean":
        limits = sidecar or Config()
        admission = limits.admission
        config = render_lean(config, limits.paths, admission.max_body_bytes, admission.max_request_seconds)
    config["admin"]["address"]["socket_address"]["port_value"] = ports.envoy_admin
    for listener in config["static_resources"]["listeners"]:
        if listener["name"] == "llm_ingress":
            listener["address"]["socket_address"]["port_value"] = ports.envoy
    for cluster in config["static_resources"]["clusters"]:
        port = {"llm_admission_extproc": ports.grpc, UPSTREAM_CLUSTER: ports.upstream}[cluster["name"]]
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
    if upstream is not None:
        point_upstream_at(config, *upstream)
    return config


def point_upstream_at(config: dict[str, Any], host: str, port: int) -> None:
    """The `llm_upstream` cluster to `host:port`: a static address for an IP literal, else STRICT_DNS."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] != UPSTREAM_CLUSTER:
            continue
        cluster["type"] = discovery_type(host)
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"].update(address=host, port_value=port)


def trust_client_tenant_header(config: dict[str, Any]) -> None:
    """For tests that pick tenants from the client: drop the tenant-header strip, standing in for the authn
    filter that sets the header from verified identity in a real deployment. Never for a served Envoy."""
    for hcm in http_connection_managers(config):
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == HEADER_MUTATION:
                mutations = http_filter["typed_config"]["mutations"]
                kept = [m for m in mutations["request_mutations"] if "remove" not in m]
                mutations["request_mutations"] = kept


def remove_ext_proc(config: dict[str, Any]) -> None:
    """Envoy straight to the upstream: the baseline for tests and benchmarks."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                hcm["http_filters"] = [
                    f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
                ]
                for vhost in hcm["route_config"]["virtual_hosts"]:
                    vhost.pop("typed_per_filter_config", None)
                    for route in vhost["routes"]:
                        route.pop("typed_per_filter_config", None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "llm_admission_extproc"
    ]
