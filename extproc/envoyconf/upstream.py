"""The engine the gateway forwards to, as the file Envoy loads its `llm_upstream` cluster from.

In Kubernetes the gateway's Envoy bootstrap (k8s/gateway/envoy.yaml, and the lean rendering of it) holds no
upstream: it loads the cluster from `/etc/envoy-upstream/upstream.yaml`, the `extproc-upstream` ConfigMap
(k8s/gateway/kustomization.yaml), so that one file, which an overlay replaces whole, sets the engine's
service, port and TLS for both profiles (k8s/README.md). `python -m extproc envoy-upstream URL` prints that
file; k8s/gateway/upstream.yaml and k8s/examples/my-vllm/upstream.yaml are its output (tests/unit/
test_upstream_config.py checks that they are current).

Envoy facts relied on (envoyproxy/data-plane-api @ 84e84367, the Envoy 1.40 API):
* Bootstrap.dynamic_resources.cds_config (bootstrap.proto field 2) with a ConfigSource.path_config_source:
  "Path on the filesystem to source and watch for configuration updates"; the file holds a DiscoveryResponse
  (envoy docs, api-docs/xds_protocol.rst, "Filesystem subscriptions"), and Envoy keeps the last valid one if
  an update is rejected. `watched_directory` is what the PathConfigSource comment prescribes for a mounted
  Kubernetes ConfigMap (it is swapped by a symlink move), so an edit in place is picked up too.
* An xDS subscription needs `node.id` and `node.cluster` (Envoy 1.40 refuses the bootstrap without them).
* RouteConfiguration.validate_clusters (route.proto field 7) defaults to true for an inline route table, and
  Envoy then refuses a route to a cluster not known when the listener loads, which a CDS cluster is not yet
  (seen with 1.40, in validate mode and at start); the field's own comment names this case ("using CDS with a
  static route table") for setting it false. The cluster name is held to `llm_upstream` by the tests.
* `envoy --mode validate` checks that the CDS file exists but not what it holds; the tests validate the
  cluster in a static bootstrap and start a real Envoy on the built files (tests/e2e/test_shipped_configs.py).
* The engine's HTTP server closes a keep-alive connection idle for 5 s (vLLM 0.32.0: uvicorn's
  timeout_keep_alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE in vllm/envs.py), and a request sent on a connection it
  just closed fails (503 UC): Envoy closes idle connections first, after `IDLE_TIMEOUT`
  (extensions.upstreams.http.v3.HttpProtocolOptions: common_http_protocol_options.idle_timeout;
  envoy/envoy.yaml explains the choice). That message needs the protocol stated: `explicit_http_config`
  HTTP/1.1, as before.
* Balancing: `Cluster.load_balancing_policy` (cluster.proto; the `lb_policy` enum before it is deprecated)
  with the `envoy.load_balancing_policies.least_request` extension (its `LeastRequest` message, two random
  choices by default): with a name that resolves to every engine (a headless Service) a request goes to the
  engine with fewer requests in flight, not the next in turn. The KV budget books the pool as full as its
  fullest engine (`kvfeed.subscriber.aggregate.spread_tokens`), so how evenly the balancer fills them is how
  much of the pool is used: bench/RESULTS.md section 12 measured round robin, least request and a Service's
  per-connection pick.
* TLS: the `envoy.transport_sockets.tls` socket with an UpstreamTlsContext (tls.proto: `sni`, field 2;
  `common_tls_context`, field 1), whose CertificateValidationContext (common.proto) trusts `trusted_ca`
  (field 1) and checks the server's DNS name (`match_typed_subject_alt_names`, field 15; SanType DNS).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass
from typing import Any

import yaml

UPSTREAM_CLUSTER = "llm_upstream"
"""The cluster every forwarding route of the shipped Envoy configs names."""
MOUNT = "/etc/envoy-upstream"
"""Where the gateway pod mounts the `extproc-upstream` ConfigMap (k8s/gateway/deployment.yaml)."""
UPSTREAM_FILE = "upstream.yaml"
"""The ConfigMap key Envoy's CDS reads (k8s/gateway/envoy.yaml, dynamic_resources)."""
CA_FILE = "ca.crt"
"""The ConfigMap key of the CA that signs an https engine's certificate, next to the cluster."""
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
CONNECT_TIMEOUT = "2s"
"""Time to open a connection to one engine endpoint, the in-cluster value shipped before (a Service hop)."""
IDLE_TIMEOUT = "2s"
"""How long an engine connection may sit idle before Envoy closes it: under the engine's own keep-alive (5 s).
The same as envoy/envoy.yaml's llm_upstream (tests/unit/envoyconf/test_engine_connections.py)."""
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
LEAST_REQUEST = "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
BALANCING = {
    "policies": [
        {
            "typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {"@type": f"type.googleapis.com/{LEAST_REQUEST}"},
            }
        }
    ]
}
"""How Envoy picks among the engines the name resolves to: the one with fewer requests in flight (header)."""
MAX_PER_GATEWAY = 100_000
"""The cluster's circuit breakers, far above any real load: the sidecar, not Envoy's defaults (1,024), is
what bounds the requests an engine gets."""

HEADER = (
    "# Rendered by `python -m extproc envoy-upstream {args}`.\n"
    "# The engine the gateway forwards to, loaded by Envoy's CDS (k8s/README.md).\n"
)


class UpstreamURLError(ValueError):
    """The engine URL cannot be used as given; the message says why."""


@dataclass(frozen=True)
class EngineAddress:
    """Where the engine listens, and whether it speaks TLS (then `sni` is the name its certificate holds
    and `ca` the file, in the Envoy container, of the CA that signed it)."""

    host: str
    port: int
    tls: bool = False
    sni: str | None = None
    ca: str = f"{MOUNT}/{CA_FILE}"

    @classmethod
    def parse(cls, url: str, sni: str | None = None, ca: str | None = None) -> EngineAddress:
        """`http://host:port` or `https://host:port` (the engine's root: no path)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamURLError(f"{url!r}: give http://HOST:PORT or https://HOST:PORT")
        if parts.path.strip("/") or parts.query:
            raise UpstreamURLError(f"{url!r}: give the engine's root, without a path")
        tls = parts.scheme == "https"
        if not tls and (sni is not None or ca is not None):
            raise UpstreamURLError(f"{url!r}: --sni and --ca are for an https engine")
        port = parts.port or (443 if tls else 80)
        name = (sni or parts.hostname) if tls else None
        return cls(parts.hostname, port, tls, name, ca or f"{MOUNT}/{CA_FILE}")


def discovery_type(host: str) -> str:
    """STATIC for an IP literal, STRICT_DNS for a name (a Service's, resolved as the cluster DNS answers)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "STRICT_DNS"
    return "STATIC"


def upstream_cluster(engine: EngineAddress) -> dict[str, Any]:
    """The `llm_upstream` Cluster for this engine."""
    cluster: dict[str, Any] = {
        "name": UPSTREAM_CLUSTER,
        "type": discovery_type(engine.host),
        "connect_timeout": CONNECT_TIMEOUT,
        "dns_lookup_family": "V4_ONLY",
        "load_balancing_policy": BALANCING,
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                "common_http_protocol_options": {"idle_timeout": IDLE_TIMEOUT},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": MAX_PER_GATEWAY,
                    "max_pending_requests": MAX_PER_GATEWAY,
                    "max_requests": MAX_PER_GATEWAY,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": UPSTREAM_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": engine.host, "port_value": engine.port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if engine.tls:
        cluster["transport_socket"] = _tls_socket(engine)
    return cluster


def _tls_socket(engine: EngineAddress) -> dict[str, Any]:
    """TLS to the engine, its certificate checked against `engine.ca` and the name `engine.sni`."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TLS_TYPE,
            "sni": engine.sni,
            "common_tls_context": {
                "validation_context": {
                    "trusted_ca": {"filename": engine.ca},
                    "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": engine.sni}}],
                }
            },
        },
    }


def discovery_response(cluster: dict[str, Any]) -> dict[str, Any]:
    """The file Envoy's CDS reads: a DiscoveryResponse holding the one cluster."""
    return {"resources": [{"@type": CLUSTER_TYPE, **cluster}]}


def clusters_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The clusters of a CDS file, without their `@type` (as a bootstrap's static_resources holds them)."""
    return [{k: v for k, v in r.items() if k != "@type"} for r in response["resources"]]


def render_upstream_yaml(url: str, sni: str | None = None, ca: str | None = None) -> str:
    """The CDS file for the engine at `url`, headed by the command that printed it."""
    engine = EngineAddress.parse(url, sni, ca)
    given = (("--sni", sni), ("--ca", ca))
    args = " ".join([url, *(f"{flag} {value}" for flag, value in given if value is not None)])
    body = yaml.safe_dump(discovery_response(upstream_cluster(engine)), sort_keys=False, width=120)
    return HEADER.format(args=args) + body
