"""The lean profile's Envoy config, rendered from the inline one and the path table (one source of truth).

`python -m extproc envoy-config --profile lean` prints it; envoy/envoy-lean.yaml and
k8s/gateway/lean/envoy.yaml are its output for the shipped inline configs, and
tests/unit/envoyconf/test_edge_config.py checks that they are current.
Everything not listed below is the inline config unchanged: listener, edge hardening, local replies,
clusters. Field names are those of the Envoy API protos (envoyproxy/data-plane-api @ 84e84367); every
rendered config passes `envoy --mode validate` on 1.40 (tests/e2e/test_shipped_configs.py).

What changes, and why:

* ext_proc (`ExternalProcessor`): request body BUFFERED only; request headers, response headers and
  response body SKIP/NONE. The request's method, path, client address, tenant header and the headers
  admission reads (names.py `ATTRIBUTE_HEADERS`: deadlines, an inference pool's objective and fairness id,
  the `content-type` an API's body format reads) come as `request_attributes` with the body (Envoy 1.40
  evaluates each entry as a CEL expression, so `request.headers['x-tenant-id']` gives one header).
  `metadata_options.receiving_namespaces` lets the sidecar write the `extproc` namespace
  (extproc/admission/vocabulary/names.py).
* Routes: one per metered path and method (`path` is exact after Envoy's own path normalization; the query
  string is not part of it), split in two: with a `content-length` of at least one byte, the body-only
  mode; without one (HTTP/2 or chunked bodies, or no body at all) a per-route override that also sends the
  request headers, so a body-less request still reaches the sidecar (with the request headers skipped, Envoy
  opens no ext_proc stream at all for a request without a body: seen with 1.40). Free paths pass with ext_proc
  and Lua disabled; OPTIONS is free on every listed path; anything else is a direct 404 (the local-reply
  mappers make it OpenAI JSON).
* Body bound: `request_body_buffer_limit` on the virtual host, and the buffer filter's `max_request_bytes`,
  at `DRAIN_BODY_BYTES` (12 MiB, or `admission.max_body_bytes` if larger), the inline config's bound: a body
  over the sidecar's cap is read whole and refused by the sidecar, so the client, done writing, reads the
  413 (a 413 sent while the body still arrives is often reset, envoy/envoy.yaml explains why). Past the
  bound Envoy answers 413 itself, in the same opening words, naming the bound (`over N bytes`).
* Lifetime bound: every metered route's `max_stream_duration` (RouteAction field 36, MaxStreamDuration:
  "the maximum duration allowed for streams on the route", reset past it) is `admission.max_request_seconds`,
  so a slow or stalled reader cannot hold a slot and its KV without end (free routes keep the listener's).
* A buffer filter (`envoy.filters.http.buffer`) after ext_proc: with the header phase skipped, ext_proc lets
  the request headers continue at once, and the router would open the upstream request before admission.
  The buffer filter holds them until the whole (admitted, possibly rewritten) body is there, and sets the
  final `content-length`.
* header_mutation also removes the engine control headers (extproc/admission/intake/paths.py
  BACKEND_CONTROL_HEADERS): the sidecar cannot remove headers it does not see.
* The virtual host adds `x-ratelimit-*` to responses and `x-vllm-priority` to upstream requests from the
  metadata the sidecar wrote at admission (`%DYNAMIC_METADATA(extproc:NAME)%`; absent metadata adds nothing).
* A Lua filter reads admitted responses (extproc/envoyconf/response.lua) and a gRPC access logger
  (`envoy.access_loggers.http_grpc`) sends one entry per admitted request to the sidecar's gRPC port, filtered
  on the report key, one per refusal Envoy answered itself (`ENVOY_REFUSALS`), so that the sidecar counts
  those too, and one per request whose ext_proc exchange failed (`EXT_PROC_FAILURES`: Envoy's message timer
  fired before the admitting reply landed, so the key was never applied), so that the sidecar refunds what it
  admitted and Envoy never forwarded; nothing else is logged there. The ext_proc filter sends the request's
  `x-request-id` (`request.id`) for that match.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from extproc.admission.intake.paths import (
    BACKEND_CONTROL_HEADERS,
    DEFAULT_TABLE,
    PathRule,
    PathTable,
    RouteKind,
)
from extproc.admission.vocabulary.names import (
    ATTRIBUTE_HEADERS,
    DETAILS_PREFIX,
    EXT_PROC_FAILED_DETAILS,
    FORWARDED_REQUEST_HEADERS,
    LEAN_REQUEST_ATTRIBUTES,
    NAMESPACE,
    RATELIMIT_HEADERS,
    REPORT_KEY,
    header_attribute,
    tenant_attribute,
)
from extproc.config import Config
from extproc.envoyconf.bootstrap import HEADER_MUTATION, http_connection_managers

EXT_PROC = "envoy.filters.http.ext_proc"
LUA = "envoy.filters.http.lua"
BUFFER = "envoy.filters.http.buffer"
EXTPROC_CLUSTER = "llm_admission_extproc"

_TYPES = "type.googleapis.com/envoy.extensions.filters.http"
EXT_PROC_PER_ROUTE = f"{_TYPES}.ext_proc.v3.ExtProcPerRoute"
LUA_PER_ROUTE = f"{_TYPES}.lua.v3.LuaPerRoute"

BODY_MODE: dict[str, str] = {
    "request_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}
"""The filter's mode in this profile: the sidecar sees the request body, nothing else."""

HEADERS_AND_BODY_MODE = BODY_MODE | {"request_header_mode": "SEND"}
"""The mode of a metered route's requests without a content-length (see the module docstring)."""

DRAIN_BODY_BYTES = 12 << 20
"""The most of a request body Envoy reads before refusing it (the inline config's request_body_buffer_limit);
below the sidecar's gRPC receive limit (server.max_receive_message_bytes, 16 MiB)."""

REPORT_FLUSH_INTERVAL = "0.01s"
"""How long Envoy batches access-log entries (CommonGrpcAccessLogConfig.buffer_flush_interval): the bound
on the delay between a request's end and its slot's release, before the sidecar's own work."""

NOT_FOUND = "not found"
"""The last route's name: every path or method the table does not list."""

HEADER = "# Rendered by `python -m extproc envoy-config --profile lean{args}` from {source}: do not edit.\n"


def lua_source() -> str:
    """The response reader (extproc/envoyconf/response.lua), shipped with the package."""
    return resources.files("extproc.envoyconf").joinpath("response.lua").read_text()


def render_lean(
    inline: dict[str, Any],
    table: PathTable = DEFAULT_TABLE,
    max_body_bytes: int = 1 << 20,
    max_request_seconds: float = 1800.0,
) -> dict[str, Any]:
    """The lean profile's Envoy config made from an inline one (see the module docstring)."""
    config = copy.deepcopy(inline)
    max_body_bytes = max(DRAIN_BODY_BYTES, max_body_bytes)  # refused by the sidecar once read: see above
    for hcm in http_connection_managers(config):
        _lean_filters(hcm, max_body_bytes)
        upstream = _upstream_route(hcm)
        metered = {**upstream, "max_stream_duration": lifetime_bound(max_request_seconds)}
        for vhost in hcm["route_config"]["virtual_hosts"]:
            _lean_virtual_host(vhost, table, upstream, metered, max_body_bytes)
        hcm.setdefault("access_log", []).append(_end_report_logger())
        _name_body_bound(hcm, max_body_bytes)
    return config


def _name_body_bound(hcm: dict[str, Any], bound: int) -> None:
    """Envoy's own 413 names the bound it refused the body at (`over N bytes`, the inline config's 12 MiB):
    where the sidecar's cap raised the bound, the rendered mapper says the raised one."""
    if bound == DRAIN_BODY_BYTES:
        return
    for mapper in hcm.get("local_reply_config", {}).get("mappers", []):
        error = mapper.get("body_format_override", {}).get("json_format", {}).get("error", {})
        message = error.get("message")
        if isinstance(message, str) and f"over {DRAIN_BODY_BYTES} bytes" in message:
            error["message"] = message.replace(f"over {DRAIN_BODY_BYTES} bytes", f"over {bound} bytes")


def tenant_header_removed(hcm: dict[str, Any]) -> str | None:
    """The tenant header the config strips from clients (the plain `remove` of header_mutation)."""
    for http_filter in hcm["http_filters"]:
        if http_filter["name"] == HEADER_MUTATION:
            for mutation in http_filter["typed_config"]["mutations"]["request_mutations"]:
                if "remove" in mutation:
                    return str(mutation["remove"])
    return None


def _lean_filters(hcm: dict[str, Any], max_body_bytes: int) -> None:
    filters: list[dict[str, Any]] = hcm["http_filters"]
    tenant = tenant_header_removed(hcm)
    out: list[dict[str, Any]] = []
    for http_filter in filters:
        if http_filter["name"] == HEADER_MUTATION:
            mutations = http_filter["typed_config"]["mutations"]["request_mutations"]
            mutations.extend(
                {"remove_on_match": {"key_matcher": {"exact": h}}} for h in BACKEND_CONTROL_HEADERS
            )
        out.append(http_filter)
        if http_filter["name"] != EXT_PROC:
            continue
        ext_proc = http_filter["typed_config"]
        ext_proc["processing_mode"] = dict(BODY_MODE)
        attributes = list(LEAN_REQUEST_ATTRIBUTES)
        if tenant is not None:
            attributes.append(tenant_attribute(tenant))
        attributes.extend(header_attribute(name) for name in ATTRIBUTE_HEADERS)
        ext_proc["request_attributes"] = attributes
        # No response phase here: the access log brings Envoy's response flags instead (accesslog.py).
        ext_proc.pop("response_attributes", None)
        # Kept: the namespaces an earlier filter forwards (a tenant from metadata, docs/tenants.md).
        options = ext_proc.setdefault("metadata_options", {})
        options["receiving_namespaces"] = {"untyped": [NAMESPACE]}
        out.append(
            {
                "name": BUFFER,
                "typed_config": {
                    "@type": f"{_TYPES}.buffer.v3.Buffer",
                    "max_request_bytes": max_body_bytes,
                },
            }
        )
        out.append(_lua_filter())
    hcm["http_filters"] = out


def _lua_filter() -> dict[str, Any]:
    return {
        "name": LUA,
        "typed_config": {
            "@type": f"{_TYPES}.lua.v3.Lua",
            "default_source_code": {"inline_string": lua_source()},
        },
    }


def lifetime_bound(seconds: float) -> dict[str, Any]:
    """A metered route's `max_stream_duration` (config.route.v3.RouteAction.MaxStreamDuration)."""
    return {"max_stream_duration": f"{seconds:g}s"}


def _upstream_route(hcm: dict[str, Any]) -> dict[str, Any]:
    """The inline config's catch-all route action (`prefix: /`) without its lifetime bound: where metered
    and free requests go (the metered routes get the configured bound back)."""
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            if route.get("match") == {"prefix": "/"} and "route" in route:
                action: dict[str, Any] = dict(route["route"])
                action.pop("max_stream_duration", None)
                return action
    raise ValueError("the inline config has no catch-all route (`prefix: /`) to the upstream")


def _lean_virtual_host(
    vhost: dict[str, Any],
    table: PathTable,
    upstream: dict[str, Any],
    metered: dict[str, Any],
    max_body_bytes: int,
) -> None:
    vhost.pop("typed_per_filter_config", None)  # the inline profile's response phases
    vhost["request_body_buffer_limit"] = max_body_bytes
    vhost["request_headers_to_add"] = [_from_metadata(name) for name in FORWARDED_REQUEST_HEADERS]
    vhost["response_headers_to_add"] = [_from_metadata(name) for name in RATELIMIT_HEADERS]
    vhost["routes"] = routes(table, upstream, metered)


def _from_metadata(name: str) -> dict[str, Any]:
    """A header set from the sidecar's metadata; nothing is added when the metadata is absent (an empty
    value is dropped: HeaderValueOption.keep_empty_value defaults to false)."""
    return {
        "header": {"key": name, "value": f"%DYNAMIC_METADATA({NAMESPACE}:{name})%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }


def routes(
    table: PathTable, upstream: dict[str, Any], metered: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Metered routes (two per rule, to `metered`: the upstream with the lifetime bound), free routes,
    OPTIONS on every listed path, then 404 for the rest."""
    rules = sorted(table.rules.values(), key=lambda rule: rule.prefix is not None)  # exact paths first
    metered = upstream if metered is None else metered
    out: list[dict[str, Any]] = []
    for rule in rules:
        if rule.kind is RouteKind.METERED:
            out.append(_route(f"metered {rule.path}", rule, metered, body=True))
            out.append(_route(f"metered {rule.path} (headers)", rule, metered, body=False))
        elif rule.kind is RouteKind.FREE:
            out.append(_free(f"free {rule.path}", _match(rule, rule.methods), upstream))
    for rule in rules:
        if rule.kind is not RouteKind.DENIED:
            out.append(_free(f"preflight {rule.path}", _match(rule, frozenset({"OPTIONS"})), upstream))
    out.append(
        {
            "name": NOT_FOUND,
            "match": {"prefix": "/"},
            "direct_response": {"status": 404},
            "typed_per_filter_config": _disabled(),
        }
    )
    return out


def _match(rule: PathRule, methods: frozenset[str], content_length: bool = False) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": rule.prefix} if rule.prefix is not None else {"path": rule.path}
    verbs = sorted(methods)
    method = {"exact": verbs[0]} if len(verbs) == 1 else {"safe_regex": {"regex": "|".join(verbs)}}
    headers: list[dict[str, Any]] = [{"name": ":method", "string_match": method}]
    if content_length:
        headers.append({"name": "content-length", "string_match": {"safe_regex": {"regex": "[1-9][0-9]*"}}})
    match["headers"] = headers
    return match


def _route(name: str, rule: PathRule, upstream: dict[str, Any], body: bool) -> dict[str, Any]:
    route: dict[str, Any] = {
        "name": name,
        "match": _match(rule, rule.methods, content_length=body),
        "route": copy.deepcopy(upstream),
    }
    if not body:
        route["typed_per_filter_config"] = {
            EXT_PROC: {
                "@type": EXT_PROC_PER_ROUTE,
                "overrides": {"processing_mode": dict(HEADERS_AND_BODY_MODE)},
            }
        }
    return route


def _free(name: str, match: dict[str, Any], upstream: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "match": match,
        "route": copy.deepcopy(upstream),
        "typed_per_filter_config": _disabled(),
    }


def _disabled() -> dict[str, Any]:
    return {
        EXT_PROC: {"@type": EXT_PROC_PER_ROUTE, "disabled": True},
        LUA: {"@type": LUA_PER_ROUTE, "disabled": True},
    }


CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"

ENVOY_REFUSAL_CODES = (400, 404, 408, 413, 431)
"""Statuses of the refusals Envoy answers itself in this profile (an unlisted path, a body past the bound,
a request too slow, headers too large, a malformed request): logged to the sidecar so that
`extproc_requests_total` counts them with the sidecar's own (extproc/protocol/accesslog.py)."""

ENVOY_REFUSALS = (
    f"response.code in [{', '.join(map(str, ENVOY_REFUSAL_CODES))}]"
    f" && response.code_details != 'via_upstream' && !response.code_details.startsWith('{DETAILS_PREFIX}')"
)
"""CEL (envoy.access_loggers.extension_filters.cel) for Envoy's own refusals: not the upstream's answer, not
the sidecar's ImmediateResponse (its details start with `extproc_`, and the sidecar counted it already)."""


EXT_PROC_FAILURES = f"response.code_details.startsWith('{EXT_PROC_FAILED_DETAILS}')"
"""CEL for requests whose ext_proc exchange failed (the message timer fired): Envoy answered them itself and
never forwarded them; the sidecar refunds what it may have admitted for them
(extproc/protocol/accesslog.py)."""


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": CEL_FILTER, "expression": expression},
        }
    }


def _end_report_logger() -> dict[str, Any]:
    """One access-log entry per admitted request, and one per refusal Envoy answered itself, to the sidecar
    (extproc/protocol/accesslog.py)."""
    admitted = {
        "metadata_filter": {
            "matcher": {
                "filter": NAMESPACE,
                "path": [{"key": REPORT_KEY}],
                "value": {"present_match": True},
            },
            "match_if_key_not_found": False,
        }
    }
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"or_filter": {"filters": [admitted, _cel(ENVOY_REFUSALS), _cel(EXT_PROC_FAILURES)]}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "extproc_end_reports",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
                "buffer_flush_interval": REPORT_FLUSH_INTERVAL,
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the Lua source) as literal blocks, so the shipped YAML stays readable."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render_envoy_yaml(template: Path, sidecar: Config) -> str:
    """The lean rendering of an inline config file, as YAML (the shipped files are this output): an Envoy
    bootstrap, or the Istio EnvoyFilter."""
    inline = yaml.safe_load(template.read_text())
    if inline.get("kind") == "EnvoyFilter":
        lean = render_istio_lean(inline)
    else:
        admission = sidecar.admission
        lean = render_lean(inline, sidecar.paths, admission.max_body_bytes, admission.max_request_seconds)
    return yaml.dump(lean, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


ISTIO_NOTE = """\
# Istio, lean profile: envoy/istio/envoyfilter.yaml with the response read by Envoy (docs/architecture.md).
# Apply this instead of envoyfilter.yaml (same name: it replaces it). Differences, and why:
#   - ext_proc sends the request headers too: behind Istio the routes are your VirtualService's, so the path
#     table, the body cap and the check that a metered request has a body stay in the sidecar. The response
#     phases are off.
#   - a Lua filter (before the router) reads admitted responses; the virtual host adds x-ratelimit-* from the
#     sidecar's metadata; a gRPC access logger on the gateway's http_connection_manager reports each
#     admitted request's end to the sidecar on 127.0.0.1:50051.
# istio-proxy registers envoy.filters.http.lua and envoy.access_loggers.http_grpc (istio/proxy
# bazel/extension_config/extensions_build_config.bzl, read @ 00ef848f; the 1.28 pin 50c73bea was not read for
# these two): check your istio-proxy, and run the end-to-end tests of docs/gateways.md against it.
"""


def render_istio_lean(inline: dict[str, Any]) -> dict[str, Any]:
    """The Istio EnvoyFilter of the lean profile, from the inline one (see ISTIO_NOTE)."""
    doc = copy.deepcopy(inline)
    patches: list[dict[str, Any]] = doc["spec"]["configPatches"]
    out: list[dict[str, Any]] = []
    for patch in patches:
        value = patch["patch"]["value"]
        if patch["applyTo"] == "VIRTUAL_HOST":
            patch["patch"]["value"] = {
                "response_headers_to_add": [_from_metadata(n) for n in RATELIMIT_HEADERS]
            }
        elif patch["applyTo"] == "NETWORK_FILTER":
            value["typed_config"]["access_log"] = [_end_report_logger()]
        elif patch["applyTo"] == "HTTP_FILTER" and value["name"] == EXT_PROC:
            ext_proc = value["typed_config"]
            ext_proc["processing_mode"] = dict(HEADERS_AND_BODY_MODE)
            ext_proc.pop("response_attributes", None)  # no response phase: the access log has the flags
            ext_proc.setdefault("metadata_options", {})["receiving_namespaces"] = {"untyped": [NAMESPACE]}
            lua = copy.deepcopy(patch)
            lua["patch"]["value"] = _lua_filter()
            out.append(patch)
            out.append(lua)
            continue
        out.append(patch)
    doc["spec"]["configPatches"] = out
    return doc
