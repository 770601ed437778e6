"""Edge cases of the admission path: ways around admission, queue races, a dead feed, hostile pools."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.intake.paths import DEFAULT_TABLE, RouteKind
from extproc.admission.intake.request import Api
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.clock import monotonic
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.classes import CONFIG as CLASS_CONFIG
from tests.support.classes import admit, start
from tests.support.servicer import Harness, body_msg, chat, header_map, headers_msg
from tests.support.waiting import eventually


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/%63hat/completions",
        "/v1/chat%2Fcompletions",
        "/v1/chat%252Fcompletions",
        "//v1//chat/completions/",
        "/v1/x/../chat/completions",
        "/v1/./chat/completions?stream=1#frag",
    ],
)
def test_every_spelling_a_router_serves_is_admitted(path: str) -> None:
    rule = DEFAULT_TABLE.route("post", path)
    assert rule is not None and rule.kind is RouteKind.METERED and rule.api == Api("chat")


@pytest.mark.parametrize(
    "path", ["/v1/models", "/v1/chat/completionsX", "/v2/chat/completions", "/", "/metrics", "/v1/%6Dodels"]
)
def test_other_paths_are_refused_when_posted(path: str) -> None:
    assert DEFAULT_TABLE.route("POST", path) is None


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/", "/v1//models?x=1", "/version", "/health"])
def test_free_paths_pass(path: str) -> None:
    rule = DEFAULT_TABLE.route("GET", path)
    assert rule is not None and rule.kind is RouteKind.FREE


async def test_buffered_body_followed_by_trailers_is_admitted_at_once() -> None:
    """With trailers, Envoy's BUFFERED body arrives with end_of_stream unset; waiting for more lets it
    through unadmitted."""
    config: dict[str, Any] = {
        "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "limits": {"global": {"max_concurrency": 0}},
    }
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    try:
        s = h.stream()
        await s.send(headers_msg("POST", "/v1/chat/completions"))
        reply = await s.send(body_msg(chat(), eos=False))
        assert reply.immediate_response.status.code == 429
        s.cancel()
    finally:
        await channel.close()
        await sidecar.stop(grace_s=0)


async def test_shadow_class_is_not_broken_by_waiters_of_a_higher_class() -> None:
    config = json.loads(json.dumps(CLASS_CONFIG))
    config["classes"][2]["shadow"] = True  # batch in shadow mode while critical queues
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    try:
        held = [await admit(h, "chat") for _ in range(3)]
        waiter = h.stream()
        await waiter.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
        await waiter.call.write(body_msg(chat(max_tokens=10)))
        await asyncio.wait_for(waiter.call.read(), 5)
        await eventually(lambda: h.metric("extproc_queue_depth", **{"class": "critical"}) == 1)
        s, reply = await admit(h, "nightly")
        assert reply.HasField("request_body")  # its own guarantee, no error
        s2, reply2 = await admit(h, "nightly")
        assert reply2.HasField("request_body")  # shadow: would be refused, passes
        assert h.metric("extproc_requests_total", decision="shadow_rejected", **{"class": "batch"}) == 1
        for stream in [*(x for x, _ in held), waiter, s, s2]:
            stream.cancel()
    finally:
        await channel.close()
        await sidecar.stop(grace_s=0)


async def test_lower_class_newcomers_cannot_take_the_pool_from_waiting_higher_classes() -> None:
    config = json.loads(json.dumps(CLASS_CONFIG))
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    try:
        held = [await admit(h, "chat") for _ in range(3)]  # 2 guaranteed + the pool's 1
        waiter = h.stream()
        await waiter.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
        await waiter.call.write(body_msg(chat(max_tokens=10)))
        await asyncio.wait_for(waiter.call.read(), 5)
        await eventually(lambda: h.metric("extproc_queue_depth", **{"class": "critical"}) == 1)
        held[2][0].cancel()  # the pool slot frees; standard has no guarantee and must not take it first
        s, reply = await admit(h, None)
        if reply.HasField("immediate_response"):
            assert header_map(reply.immediate_response.headers)["x-extproc-reject-reason"] == "concurrency"
        admitted = await asyncio.wait_for(waiter.call.read(), 5)
        assert admitted.HasField("request_body")
        assert reply.HasField("immediate_response"), "standard overtook the waiting critical request"
        for stream in [*(x for x, _ in held[:2]), waiter, s]:
            stream.cancel()
    finally:
        await channel.close()
        await sidecar.stop(grace_s=0)


async def test_waiter_timing_out_while_its_acquire_is_in_flight_leaks_nothing() -> None:
    class SlowStore(LocalStore):
        """A store whose acquire takes a network round trip, as a shared store does."""

        async def acquire(
            self,
            keys: Any,
            tokens: int,
            holder: str | None = None,
            use_pool: bool = True,
            output_tokens: int = 0,
        ) -> Any:
            await asyncio.sleep(0.3)
            return self.limiter.acquire(keys, tokens, holder, use_pool, output_tokens)

    store = SlowStore()
    await store.apply_limits({"global": LimitSpec(max_concurrency=1)}, {}, ("c",))
    queue = AdmissionQueue(store, monotonic, Metrics())
    queue.configure(("c",), {"c": 10})
    first = store.limiter.acquire(["global"], 1, "c")
    assert isinstance(first, Lease)

    async def free_soon() -> None:
        await asyncio.sleep(0.05)
        await store.release(first, 1)

    task = asyncio.ensure_future(free_soon())
    assert await queue.wait(["global"], 1, "c", "t", max_wait_s=0.2) is None
    await task
    await asyncio.sleep(0.6)  # the pump's acquire lands after the deadline
    assert store.limiter.snapshot(["global"])[0].active == 0


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_feed_that_never_delivers_holds_model_pools_at_the_stale_scale() -> None:
    config = {
        "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "limits": {"models": {"m": {"max_concurrency": 10}}},
        "feedback": {"exporters": [f"127.0.0.1:{_dead_port()}"]},
        "kv_budget": {"enabled": True},
    }
    sidecar = Sidecar(config=parse_config(config), metrics=Metrics())
    await sidecar.start()
    assert sidecar.store is not None  # start() builds it
    try:
        snap = sidecar.store.snapshot()
        model = next(s for s in snap if s.key == "model:m")
        assert model.scale == pytest.approx(0.6)
        assert model.effective_concurrency == 6
        # Made-up model names get no budget (and no metric series).
        assert sidecar.feedback.budget("made-up-model-name") is None
        assert sidecar.feedback.budget("m") is not None
        # A reload that keeps the feed does not hand out full limits in between.
        await sidecar.apply_config(parse_config({**config, "log_level": "debug"}))
        model = next(s for s in sidecar.store.snapshot() if s.key == "model:m")
        assert model.scale == pytest.approx(0.6)
        # Turning feedback off gives base limits back.
        await sidecar.apply_config(
            parse_config({k: v for k, v in config.items() if k not in ("feedback", "kv_budget")})
        )
        model = next(s for s in sidecar.store.snapshot() if s.key == "model:m")
        assert model.scale == 1.0
    finally:
        await sidecar.stop(grace_s=0)


async def test_lease_granted_after_the_rpc_ended_is_settled_at_once() -> None:
    """A wait that swallowed the RPC's cancellation must not leave a lease or a KV-budget entry behind."""
    from extproc.admission.exchange import Exchange, Phase, RequestHead
    from extproc.core.kv.budget import KvBudget

    store = LocalStore()
    await store.apply_limits({"global": LimitSpec(max_concurrency=1)})
    budget = KvBudget(capacity_tokens=100_000)
    sidecar = Sidecar(config=parse_config({}), store=store, metrics=Metrics())
    sidecar.admission.deps.kv_budget = lambda _pool: budget
    exchange = Exchange(sidecar.admission)
    exchange.close()  # the done-callback already ran before the lease existed
    exchange.request_headers(RequestHead("POST", "/v1/chat/completions", {}))
    verdicts = [v async for v in exchange.request_body(chat(max_tokens=10))]
    assert len(verdicts) == 1
    assert exchange.phase is Phase.SETTLED
    await sidecar.admission.drain()
    assert store.limiter.snapshot(["global"])[0].active == 0
    assert budget.leases == 0


async def test_invented_model_names_share_one_limited_key_and_aliases_count_against_their_pool() -> None:
    """A model name the config does not know must not mint fresh, unlimited limits."""
    import grpc

    config: dict[str, Any] = {
        "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "models": {"*": {"context_window": 1000}, "llama": {}, "llama-sql-lora": {"pool": "llama"}},
        "limits": {"models": {"*": {"max_concurrency": 2}, "llama": {"max_concurrency": 1}}},
    }
    sidecar = Sidecar(config=parse_config(config), metrics=Metrics())
    await sidecar.start()
    assert sidecar.store is not None  # start() builds it
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    h = Harness(sidecar, channel)

    async def send(model: str) -> tuple[Any, Any]:
        s = h.stream()
        await s.send(headers_msg("POST", "/v1/chat/completions"))
        body = json.dumps({"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        return s, await s.send(body_msg(body.encode()))

    try:
        held = []
        for name in ("made-up-1", "made-up-2"):
            s, reply = await send(name)
            assert reply.HasField("request_body"), name
            held.append(s)
        s, reply = await send("made-up-3")
        assert reply.immediate_response.status.code == 429  # the shared model:* key is full
        s.cancel()
        s, reply = await send("llama")
        assert reply.HasField("request_body")
        held.append(s)
        s, reply = await send("llama-sql-lora")
        assert reply.immediate_response.status.code == 429  # the adapter counts against llama's pool
        s.cancel()
        keys = {snap.key for snap in sidecar.store.snapshot()}
        assert "model:made-up-1" not in keys and "model:llama-sql-lora" not in keys
        for s in held:
            s.cancel()
        await eventually(lambda: h.metric("extproc_active_requests") == 0)
    finally:
        await channel.close()
        await sidecar.stop(grace_s=0)
