"""The priority-class setup that the class tests and the admission edge cases share: three classes, a
guarantee per class, a queue for `critical`, and the tenant header that names the class."""

from __future__ import annotations

from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.metrics import Metrics
from tests.support.servicer import Harness, Stream, body_msg, chat, headers_msg

CONFIG: dict[str, Any] = {
    "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
    "admission": {"tenant": {"header": "x-tenant-id"}},
    "classes": [
        {"name": "critical", "queue": {"max_wait_seconds": 3, "max_queued": 2}},
        {"name": "standard"},
        {"name": "batch"},
    ],
    "default_class": "standard",
    "tenants": {"chat": {"class": "critical"}, "nightly": {"class": "batch"}},
    "metrics": {"tenant_allowlist": ["chat"]},
    "models": {"*": {"context_window": 1000, "default_max_tokens": 50}},
    "limits": {
        "models": {
            "m": {
                "max_concurrency": 4,
                "guaranteed": {"critical": {"max_concurrency": 2}, "batch": {"max_concurrency": 1}},
            }
        }
    },
}


async def start(config: dict[str, Any]) -> tuple[Sidecar, grpc.aio.Channel]:
    sidecar = Sidecar(config=parse_config(config), metrics=Metrics())
    await sidecar.start()
    return sidecar, grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")


async def admit(h: Harness, tenant: str | None) -> tuple[Stream, pb.ProcessingResponse]:
    s = h.stream()
    extra = {"x-tenant-id": tenant} if tenant else {}
    await s.send(headers_msg("POST", "/v1/chat/completions", headers=extra))
    return s, await s.send(body_msg(chat(max_tokens=10)))
