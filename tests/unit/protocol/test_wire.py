"""Header values as Envoy sends them (extproc/protocol/messages.py `header_values`)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.protocol.messages import header_values


def test_raw_values_are_decoded_value_is_the_fallback_and_keys_are_lowercased() -> None:
    message = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                base_pb2.HeaderValue(key="X-Tenant-Id", raw_value="équipe".encode()),
                base_pb2.HeaderValue(key="x-old-proxy", value="plain"),  # `value`: older proxies
                base_pb2.HeaderValue(key="x-bad", raw_value=b"a\xffb"),
                base_pb2.HeaderValue(key="x-empty"),
            ]
        )
    )
    assert header_values(message) == {
        ":path": "/v1/chat/completions",
        "x-tenant-id": "équipe",
        "x-old-proxy": "plain",
        "x-bad": "a\ufffdb",
        "x-empty": "",
    }
