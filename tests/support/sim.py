"""Helpers for the simulator's component suites: the factory type the `start_sim` fixture yields, a chat body,
SSE parsing and metric snapshots (their bounded poll is tests/support/waiting.py's `poll`). The fixtures
stay in tests/component/sim/conftest.py."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim.server import SimServer

SimFactory = Callable[..., Awaitable[SimServer]]


def chat_body(content: str = "Hello there, simulator.", **extra: Any) -> dict[str, Any]:
    return {"model": "llama-3-8b", "messages": [{"role": "user", "content": content}], **extra}


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    """Raw `data:` payloads of an SSE body, in order."""
    events = []
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            assert frame.startswith(b"data: "), frame
            events.append(frame[len(b"data: ") :].decode())
    return events


def json_events(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(e) for e in events if e != "[DONE]"]


async def metrics(session: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    """Every sample of /metrics keyed by `name{k=v,...}` (labels sorted, model/engine labels dropped)."""
    async with session.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""
            )
            out[key] = sample.value
    return out
