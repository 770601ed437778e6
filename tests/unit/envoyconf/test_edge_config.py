"""The shipped Envoy configs agree with each other and with the sidecar's config.

envoy/envoy.yaml is the reference; k8s/gateway/envoy.yaml and the Istio EnvoyFilter must carry the same
edge hardening, the same ext_proc settings and the same local replies, or one gateway flavour silently
loses a protection. The Envoy side of each setting is exercised in tests/e2e/test_edge_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.envoy import render_envoy_config, trust_client_tenant_header
from devstack.processes import Ports
from devstack.stack import tenant_header_of
from extproc.admission.intake.paths import BACKEND_CONTROL_HEADERS, DEFAULT_TABLE, RouteKind
from extproc.admission.replies.headers import ratelimit_headers
from extproc.admission.replies.refusals import envoy_too_large_message
from extproc.admission.vocabulary.names import (
    ATTRIBUTE_HEADERS,
    DETAILS_PREFIX,
    NAMESPACE,
    RATELIMIT_HEADERS,
    REPORT_KEY,
    header_attribute,
    tenant_attribute,
)
from extproc.config import AdmissionConfig, parse_config
from extproc.core.limiter.limiter import RateLimitStatus
from extproc.envoyconf.lean import (
    BODY_MODE,
    DRAIN_BODY_BYTES,
    ENVOY_REFUSALS,
    lua_source,
    render_envoy_yaml,
    render_lean,
)
from extproc.envoyconf.profiles import ENVOY_TEMPLATE

REPO = Path(__file__).resolve().parents[3]
K8S_ENVOY = REPO / "k8s" / "gateway" / "envoy.yaml"
ISTIO = REPO / "envoy" / "istio" / "envoyfilter.yaml"
HARDENING = (
    "request_headers_timeout",
    "request_timeout",
    "max_request_headers_kb",
    "common_http_protocol_options",
    "local_reply_config",
    "stream_idle_timeout",
)


def hcm_of(config: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return hcm


def http_filter(hcm: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(f for f in hcm["http_filters"] if f["name"] == name)["typed_config"]
    return found


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def istio_patches() -> list[dict[str, Any]]:
    patches: list[dict[str, Any]] = yaml.safe_load(ISTIO.read_text())["spec"]["configPatches"]
    return patches


def istio_value(apply_to: str, name: str | None = None) -> dict[str, Any]:
    for patch in istio_patches():
        value: dict[str, Any] = patch["patch"]["value"]
        if patch["applyTo"] == apply_to and (name is None or value.get("name") == name):
            return value
    raise AssertionError(f"no {apply_to} {name} patch")


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return hcm_of(yaml.safe_load(ENVOY_TEMPLATE.read_text()))


def test_k8s_gateway_envoy_has_the_reference_hardening_and_filters(reference: dict[str, Any]) -> None:
    k8s = hcm_of(yaml.safe_load(K8S_ENVOY.read_text()))
    for key in HARDENING:
        assert k8s[key] == reference[key], key
    assert [f["name"] for f in k8s["http_filters"]] == [f["name"] for f in reference["http_filters"]]
    for f in reference["http_filters"]:
        assert http_filter(k8s, f["name"]) == f["typed_config"], f["name"]
    assert k8s["route_config"]["virtual_hosts"] == reference["route_config"]["virtual_hosts"]


def message_413(hcm: dict[str, Any]) -> str:
    """The words of Envoy's own 413 (its local-reply mapper)."""
    for mapper in hcm["local_reply_config"]["mappers"]:
        if mapper["filter"]["extension_filter"]["typed_config"]["expression"] == "response.code == 413":
            message: str = mapper["body_format_override"]["json_format"]["error"]["message"]
            return message
    raise AssertionError("no 413 mapper")


def test_istio_envoyfilter_has_the_reference_hardening_and_filters(reference: dict[str, Any]) -> None:
    merged = istio_value("NETWORK_FILTER", "envoy.filters.network.http_connection_manager")["typed_config"]
    # Behind Istio Envoy's 413 comes at the listener's buffer limit (2 MiB), and says so (test below).
    istio_413 = envoy_too_large_message(istio_value("LISTENER")["per_connection_buffer_limit_bytes"])
    as_reference = yaml.safe_load(json.dumps(merged).replace(istio_413, message_413(reference)))
    for key in HARDENING:
        if key == "stream_idle_timeout":
            continue  # Istio's own default (or the operator's ProxyConfig) stays
        assert as_reference[key] == reference[key], key
    filters = [p["patch"]["value"] for p in istio_patches() if p["applyTo"] == "HTTP_FILTER"]
    for f in filters:
        assert f["typed_config"] == http_filter(reference, f["name"]), f["name"]
    vhost = reference["route_config"]["virtual_hosts"][0]
    assert istio_value("VIRTUAL_HOST")["typed_per_filter_config"] == vhost["typed_per_filter_config"]
    listener = yaml.safe_load(ENVOY_TEMPLATE.read_text())["static_resources"]["listeners"][0]
    assert istio_value("LISTENER") == {
        "per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"]
    }


def test_every_envoy_bound_fits_the_sidecar_config(reference: dict[str, Any]) -> None:
    ext_proc = http_filter(reference, "envoy.filters.http.ext_proc")
    max_message = seconds(ext_proc["max_message_timeout"])
    # The sidecar's stated bound is the one Envoy runs with.
    assert AdmissionConfig().envoy_max_message_timeout_seconds == max_message
    # The body-phase bound also covers the sidecar's decision, queueing included.
    assert seconds(reference["request_timeout"]) > max_message
    assert 0 < seconds(reference["request_headers_timeout"]) < seconds(reference["request_timeout"])
    # Envoy buffers a body up to the sidecar's own cap, so the sidecar answers a too-large body.
    vhost = reference["route_config"]["virtual_hosts"][0]
    assert vhost["request_body_buffer_limit"] > AdmissionConfig().max_body_bytes
    gateway = parse_config(yaml.safe_load((REPO / "k8s" / "gateway" / "config.yaml").read_text()))
    assert gateway.admission.envoy_max_message_timeout_seconds == max_message
    assert vhost["request_body_buffer_limit"] > gateway.admission.max_body_bytes
    # ... and the sidecar can receive the largest body Envoy buffers for it.
    assert vhost["request_body_buffer_limit"] == DRAIN_BODY_BYTES
    assert DRAIN_BODY_BYTES < AdmissionConfig().max_body_bytes * 16 <= 16 << 20


def test_every_shipped_proxy_buffers_at_least_what_the_sidecar_assumes() -> None:
    """A stream left before `admission.proxy_buffer_bytes` passed is charged what passed (no reader could
    hold the engine back before the proxy's buffer filled): every shipped Envoy buffers at least that, or a
    slow reader behind a smaller buffer would be charged what it read."""
    assumed = AdmissionConfig().proxy_buffer_bytes
    for path in [ENVOY_TEMPLATE, *shipped_beside_the_reference()]:
        document = yaml.safe_load(path.read_text())
        limits = [v for k, v in walk_items(document) if k == "per_connection_buffer_limit_bytes"]
        assert limits and min(limits) >= assumed, (path, limits)


def test_envoys_own_413_names_the_bound_it_refused_at(reference: dict[str, Any]) -> None:
    """The 413 Envoy sends itself names the most it reads of a body: the virtual host's buffer limit, or
    behind Istio (no route of ours) the listener's; a lean rendering whose sidecar cap raises the bound says
    the raised one. The sidecar's 413 names the body's size and admission.max_body_bytes (refusals.py)."""
    vhost = reference["route_config"]["virtual_hosts"][0]
    assert message_413(reference) == envoy_too_large_message(vhost["request_body_buffer_limit"])
    assert message_413(hcm_of(yaml.safe_load(K8S_ENVOY.read_text()))) == message_413(reference)
    merged = istio_value("NETWORK_FILTER", "envoy.filters.network.http_connection_manager")["typed_config"]
    listener = istio_value("LISTENER")["per_connection_buffer_limit_bytes"]
    assert message_413(merged) == envoy_too_large_message(listener)
    raised = DRAIN_BODY_BYTES + (4 << 20)
    lean = hcm_of(render_lean(yaml.safe_load(ENVOY_TEMPLATE.read_text()), max_body_bytes=raised))
    assert message_413(lean) == envoy_too_large_message(raised)
    assert lean["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] == raised


MESSAGE_TIMEOUT_S = 5.0
"""The shipped ext_proc message_timeout, sized in envoy/envoy.yaml's header: the sidecar's worst legitimate
message is a body at the 12 MiB bound parsed and counted off the loop (`COUNT_12_MIB_S` on one idle core of
a two-core host), doubled on a core shared with another busy process, after up to
`admission.tokenizer_max_wait_seconds` for its lane; the timeout is twice that."""
COUNT_12_MIB_S = 1.0


def test_every_shipped_ext_proc_message_timeout_is_sized_for_a_busy_core(reference: dict[str, Any]) -> None:
    ext_proc = http_filter(reference, "envoy.filters.http.ext_proc")
    worst = AdmissionConfig().tokenizer_max_wait_seconds + 2 * COUNT_12_MIB_S
    assert seconds(ext_proc["message_timeout"]) == MESSAGE_TIMEOUT_S >= 2 * worst
    assert seconds(ext_proc["max_message_timeout"]) > MESSAGE_TIMEOUT_S
    for path in shipped_beside_the_reference():
        timeouts = [v for k, v in walk_items(yaml.safe_load(path.read_text())) if k == "message_timeout"]
        assert timeouts == [ext_proc["message_timeout"]], path
    for profile in ("inline", "lean"):
        policy = yaml.safe_load(
            (REPO / "k8s" / "envoy-gateway" / profile / "envoyextensionpolicy.yaml").read_text()
        )
        assert [p["messageTimeout"] for p in policy["spec"]["extProc"]] == [ext_proc["message_timeout"]]


def shipped_beside_the_reference() -> list[Path]:
    """Every shipped Envoy config but the reference (envoy/envoy.yaml): the Kubernetes gateway's, the Istio
    EnvoyFilters (the inference pool's too) and the lean renderings."""
    inference_pool = REPO / "k8s" / "inference-pool" / "istio" / "envoyfilter.yaml"
    return [K8S_ENVOY, *LEAN_FILES, inference_pool, ISTIO]


def walk_items(node: Any) -> list[tuple[str, Any]]:
    """Every (key, value) pair of a parsed YAML document, nested ones included."""
    if isinstance(node, dict):
        pairs = list(node.items())
        return pairs + [pair for value in node.values() for pair in walk_items(value)]
    if isinstance(node, list):
        return [pair for item in node for pair in walk_items(item)]
    return []


def test_filter_mode_skips_the_response_and_the_virtual_host_turns_it_on(reference: dict[str, Any]) -> None:
    """A reply to a request no route saw (an HTTP/1 codec error) must not wait for the sidecar."""
    mode = http_filter(reference, "envoy.filters.http.ext_proc")["processing_mode"]
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "NONE")
    vhost = reference["route_config"]["virtual_hosts"][0]
    override = vhost["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
    assert override == {**mode, "response_header_mode": "SEND", "response_body_mode": "STREAMED"}


def test_tenant_header_of_shipped_configs_is_the_one_envoy_strips(reference: dict[str, Any]) -> None:
    gateway = yaml.safe_load((REPO / "k8s" / "gateway" / "config.yaml").read_text())
    assert strip_list(reference) == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-envoy-"}}},
        {"remove": tenant_header_of(gateway)},
    ]


def strip_list(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    mutations: list[dict[str, Any]] = http_filter(hcm, "envoy.filters.http.header_mutation")["mutations"][
        "request_mutations"
    ]
    return mutations


@pytest.mark.parametrize("configured", ["X-Org-Id", "x-tenant-id", "tenant"])
def test_stack_renders_exactly_the_configured_tenant_header(configured: str) -> None:
    sidecar = {"admission": {"tenant": {"header": configured}}}
    header = tenant_header_of(sidecar)
    assert header == parse_config(sidecar).admission.tenant.header == configured.lower()
    hcm = hcm_of(render_envoy_config(Ports.free(), tenant_header=header))
    removed = [m["remove"] for m in strip_list(hcm) if "remove" in m]
    assert removed == [configured.lower()]
    assert {"remove_on_match": {"key_matcher": {"prefix": "x-envoy-"}}} in strip_list(hcm)


def test_stack_without_a_tenant_header_keeps_the_template_strip() -> None:
    assert tenant_header_of({}) is None
    hcm = hcm_of(render_envoy_config(Ports.free(), tenant_header=None))
    assert [m["remove"] for m in strip_list(hcm) if "remove" in m] == ["x-tenant-id"]


def test_trusting_client_tenants_drops_only_the_tenant_strip() -> None:
    config = render_envoy_config(Ports.free(), tenant_header="x-tenant")
    trust_client_tenant_header(config)
    assert strip_list(hcm_of(config)) == [{"remove_on_match": {"key_matcher": {"prefix": "x-envoy-"}}}]


def test_backend_metrics_route_comes_before_the_catch_all(reference: dict[str, Any]) -> None:
    routes = reference["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    assert names.index("backend_metrics") < names.index("llm")
    metrics = routes[names.index("backend_metrics")]
    assert metrics["match"] == {"path_separated_prefix": "/metrics"}
    assert metrics["direct_response"] == {"status": 404}


def test_local_replies_leave_the_sidecar_replies_alone_and_cover_every_status(
    reference: dict[str, Any],
) -> None:
    mappers = reference["local_reply_config"]["mappers"]
    expressions = [m["filter"]["extension_filter"]["typed_config"]["expression"] for m in mappers]
    # First: the sidecar's replies, untouched (no body or format override).
    assert expressions[0] == f"response.code_details.startsWith('{DETAILS_PREFIX}')"
    assert set(mappers[0]) == {"filter"}
    # Last: a catch-all, so no Envoy reply is ever plain text.
    assert expressions[-1] == "true"
    for mapper in mappers[1:]:
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] in {"invalid_request_error", "server_error", "requests"}
    assert "local_reply_config" in reference and "body_format" not in reference["local_reply_config"]


# ------------------------------------------------------------------------------------------------------------
# The lean profile: rendered from the inline configs and the path table, never edited by hand.

LEAN_FILES = {
    REPO / "envoy" / "envoy-lean.yaml": (ENVOY_TEMPLATE, None),
    REPO / "k8s" / "gateway" / "lean" / "envoy.yaml": (K8S_ENVOY, REPO / "k8s" / "gateway" / "config.yaml"),
    REPO / "envoy" / "istio" / "envoyfilter-lean.yaml": (ISTIO, None),
}


@pytest.mark.parametrize("shipped", list(LEAN_FILES), ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_lean_configs_are_the_rendering_of_the_inline_ones(shipped: Path) -> None:
    template, sidecar = LEAN_FILES[shipped]
    config = parse_config(yaml.safe_load(sidecar.read_text())) if sidecar is not None else parse_config({})
    assert yaml.safe_load(shipped.read_text()) == yaml.safe_load(render_envoy_yaml(template, config)), (
        f"stale: python -m extproc envoy-config --profile lean --template {template.relative_to(REPO)}"
    )
    assert shipped.read_text().startswith("# Rendered by `python -m extproc envoy-config --profile lean")


@pytest.fixture(scope="module")
def lean() -> dict[str, Any]:
    return hcm_of(yaml.safe_load((REPO / "envoy" / "envoy-lean.yaml").read_text()))


def test_lean_keeps_the_inline_edge_hardening(reference: dict[str, Any], lean: dict[str, Any]) -> None:
    for key in HARDENING:
        assert lean[key] == reference[key], key


def test_lean_ext_proc_sees_the_request_body_only_with_the_attributes_admission_needs(
    lean: dict[str, Any],
) -> None:
    ext_proc = http_filter(lean, "envoy.filters.http.ext_proc")
    assert ext_proc["processing_mode"] == BODY_MODE
    assert ext_proc["request_attributes"] == [
        "source.address",
        "request.method",
        "request.path",
        "request.id",
        tenant_attribute(AdmissionConfig().tenant.header or "x-tenant-id"),
        *(header_attribute(name) for name in ATTRIBUTE_HEADERS),
    ]
    assert ext_proc["metadata_options"]["receiving_namespaces"] == {"untyped": [NAMESPACE]}
    names = [f["name"] for f in lean["http_filters"]]
    # The buffer filter holds the request headers until the admitted body is there: none go upstream early.
    assert names == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]
    assert http_filter(lean, "envoy.filters.http.lua")["default_source_code"]["inline_string"] == lua_source()
    removed = [
        m["remove_on_match"]["key_matcher"].get("exact") for m in strip_list(lean) if "remove_on_match" in m
    ]
    assert set(BACKEND_CONTROL_HEADERS) <= set(removed)


def test_lean_routes_follow_the_path_table(lean: dict[str, Any]) -> None:
    vhost = lean["route_config"]["virtual_hosts"][0]
    routes = vhost["routes"]
    metered = [r for r in DEFAULT_TABLE.rules.values() if r.kind is RouteKind.METERED]
    by_name = {r["name"]: r for r in routes}
    for rule in metered:
        body = by_name[f"metered {rule.path}"]
        headers = by_name[f"metered {rule.path} (headers)"]
        assert body["match"]["path"] == headers["match"]["path"] == rule.path
        assert "typed_per_filter_config" not in body  # the filter's body-only mode
        mode = headers["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
            "processing_mode"
        ]
        assert mode["request_header_mode"] == "SEND"
        assert routes.index(body) < routes.index(headers)
    # Everything that reaches the upstream without the sidecar is a free path (or a CORS preflight).
    for route in routes:
        per_route = route.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {})
        if per_route.get("disabled") and "route" in route:
            assert route["name"].startswith(("free ", "preflight ")), route["name"]
    assert routes[-1]["name"] == "not found" and routes[-1]["direct_response"] == {"status": 404}
    # Over-cap bodies are read whole, then refused by the sidecar: the client can read the 413.
    assert vhost["request_body_buffer_limit"] == DRAIN_BODY_BYTES > AdmissionConfig().max_body_bytes


def test_metered_routes_carry_the_lifetime_bound_and_free_routes_do_not(
    reference: dict[str, Any], lean: dict[str, Any]
) -> None:
    bound = {"max_stream_duration": f"{AdmissionConfig().max_request_seconds:g}s"}
    inline_routes = {r["name"]: r for r in reference["route_config"]["virtual_hosts"][0]["routes"]}
    assert inline_routes["llm"]["route"]["max_stream_duration"] == bound
    assert "max_stream_duration" not in inline_routes["health"]["route"]
    for route in lean["route_config"]["virtual_hosts"][0]["routes"]:
        if "route" not in route:
            continue
        expected = bound if route["name"].startswith("metered ") else None
        assert route["route"].get("max_stream_duration") == expected, route["name"]
    configured = parse_config({"admission": {"max_request_seconds": 90}})
    rendered = yaml.safe_load(render_envoy_yaml(ENVOY_TEMPLATE, configured))
    chat = next(
        r
        for r in hcm_of(rendered)["route_config"]["virtual_hosts"][0]["routes"]
        if r["name"] == "metered /v1/chat/completions"
    )
    assert chat["route"]["max_stream_duration"] == {"max_stream_duration": "90s"}


def test_lean_response_headers_come_from_the_admission_metadata(lean: dict[str, Any]) -> None:
    status = RateLimitStatus(
        limit_requests=8,
        remaining_requests=7,
        reset_requests_s=0.5,
        limit_tokens=1000,
        remaining_tokens=900,
        reset_tokens_s=2.0,
    )
    names = [name for name, _ in ratelimit_headers(status)]
    vhost = lean["route_config"]["virtual_hosts"][0]
    added = {h["header"]["key"]: h["header"]["value"] for h in vhost["response_headers_to_add"]}
    assert set(names) == set(added) == set(RATELIMIT_HEADERS)
    for name in names:
        assert added[name] == f"%DYNAMIC_METADATA({NAMESPACE}:{name})%"


def test_lean_reports_admitted_requests_envoys_own_refusals_and_failed_ext_proc_to_the_sidecar(
    lean: dict[str, Any],
) -> None:
    logger = next(a for a in lean["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    admitted, refused, failed = logger["filter"]["or_filter"]["filters"]
    expression = refused["extension_filter"]["typed_config"]["expression"]
    assert expression == ENVOY_REFUSALS and "via_upstream" in expression and "extproc_" in expression
    # The details Envoy 1.40 gives a message timeout: ext_proc_error_per-message_timeout_exceeded.
    failures = failed["extension_filter"]["typed_config"]["expression"]
    assert failures == "response.code_details.startsWith('ext_proc_error')"
    matcher = admitted["metadata_filter"]
    assert matcher["matcher"] == {
        "filter": NAMESPACE,
        "path": [{"key": REPORT_KEY}],
        "value": {"present_match": True},
    }
    assert matcher["match_if_key_not_found"] is False
    common = logger["typed_config"]["common_config"]
    assert common["grpc_service"] == http_filter(lean, "envoy.filters.http.ext_proc")["grpc_service"]
