"""`make run UPSTREAM=URL` (devstack/upstream.py): the URL's checks, the model and window read from the
server's `/v1/models`, config/local.yaml fitted to them, and Envoy's upstream cluster pointed at it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from devstack.envoy import render_envoy_config
from devstack.processes import Ports
from devstack.stack import LOCAL_CONFIG
from devstack.upstream import Upstream, UpstreamError
from extproc.config import config_warnings, parse_config

CARD = {"object": "list", "data": [{"id": "qwen-7b", "object": "model", "max_model_len": 32768}]}


@pytest.fixture
def server() -> Iterator[str]:
    """A stand-in for vLLM's `/v1/models`, on a free loopback port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(CARD).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("url", ["https://vllm:8000", "vllm:8000", "http://vllm:8000/v1", "http://:8000"])
def test_an_upstream_url_it_cannot_use_is_refused_with_the_reason(url: str) -> None:
    with pytest.raises(UpstreamError, match="--upstream"):
        Upstream.parse(url)


def test_the_served_model_and_window_come_from_the_server(server: str) -> None:
    upstream = Upstream.discover(server + "/")
    assert (upstream.url, upstream.model, upstream.context_window) == (server, "qwen-7b", 32768)
    assert (upstream.host, upstream.port) == ("127.0.0.1", int(server.rsplit(":", 1)[1]))


def test_a_server_that_does_not_answer_is_named() -> None:
    with pytest.raises(UpstreamError, match=r"http://127\.0\.0\.1:9/v1/models"):
        Upstream.discover("http://127.0.0.1:9", timeout_s=2)


def test_the_local_config_is_fitted_to_the_served_model() -> None:
    upstream = Upstream("http://vllm:8000", "vllm", 8000, "qwen-7b", 32768)
    fitted = upstream.sidecar_config(yaml.safe_load(LOCAL_CONFIG.read_text()))
    config = parse_config(fitted)
    assert "llama-3-8b" not in config.models and config.models["qwen-7b"].context_window == 32768
    local = parse_config(yaml.safe_load(LOCAL_CONFIG.read_text())).limits.models["llama-3-8b"]
    assert config.limits.models["qwen-7b"] == local  # the simulated model's limits, moved
    assert config.feedback is not None and config.feedback.kv_budget.enabled
    assert config_warnings(config) == []


@pytest.mark.parametrize(("host", "kind"), [("10.1.2.3", "STATIC"), ("vllm.llm-serving.svc", "STRICT_DNS")])
def test_envoys_upstream_cluster_points_at_the_server(host: str, kind: str) -> None:
    config = render_envoy_config(Ports(), upstream=(host, 8001))
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llm_upstream")
    assert cluster["type"] == kind
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {**address["socket_address"], "address": host, "port_value": 8001}
