"""Engine behaviour seen over HTTP: metrics, overload (preempt and oom), client aborts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from extproc.admission.vocabulary.tokens import count_chat_prompt
from extproc.sim.scheduler import Overflow
from tests.support.sim import SimFactory, chat_body, json_events, metrics
from tests.support.waiting import poll

KV = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


async def post_json(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_metrics_track_engine_state_and_totals(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(num_gpu_blocks=1000, time_scale=5.0)
    m = await metrics(http, sim)
    assert m[KV] == 0.0 and m[RUNNING] == 0.0 and m[WAITING] == 0.0
    info = "vllm:cache_config_info{block_size=16,cache_dtype=auto,enable_prefix_caching=True,"
    info += "gpu_memory_utilization=0.9,kv_cache_max_concurrency=1.953125,kv_cache_size_tokens=16000,"
    info += "num_cpu_blocks=None,num_gpu_blocks=1000}"
    assert m[info] == 1.0
    assert m["vllm:request_success_total{finished_reason=abort}"] == 0.0

    # Mid-stream: the gauges agree with the scheduler (within the one block a step may add).
    body = chat_body(max_tokens=400, stream=True)
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        for _ in range(4):
            await resp.content.readuntil(b"\n\n")
        m = await metrics(http, sim)
        sched = sim.engine.scheduler
        assert m[RUNNING] == 1.0 and m[WAITING] == 0.0
        assert m[KV] > 0 and abs(m[KV] - sched.kv_usage) <= 1 / 1000 + 1e-9
        await resp.read()

    prompt = count_chat_prompt(body["messages"])
    status, _ = await post_json(http, sim.url + "/v1/chat/completions", chat_body(max_tokens=30, n=2))
    assert status == 200
    await poll(lambda: _gauges_idle(http, sim))
    m = await metrics(http, sim)
    assert m["vllm:generation_tokens_total"] == 400 + 60
    assert m["vllm:prompt_tokens_total"] == prompt * 3
    assert m["vllm:request_success_total{finished_reason=length}"] == 3
    assert m["vllm:num_preemptions_total"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] == 3
    assert m["vllm:e2e_request_latency_seconds_count"] == 3
    assert m["vllm:inter_token_latency_seconds_count"] == 399 + 2 * 29
    assert m["sim_oom_events_total"] == 0


async def _gauges_idle(http: aiohttp.ClientSession, sim: Any) -> bool:
    m = await metrics(http, sim)
    return m[RUNNING] == 0 and m[WAITING] == 0 and m[KV] == 0


async def test_overload_without_limiter_queues_and_preempts(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    # 64 blocks x 16 = 1024 tokens of KV; 16 requests x ~225 tokens need about 3.5x that.
    sim = await start_sim(num_gpu_blocks=64, max_model_len=1024, time_scale=20.0)
    url = sim.url + "/v1/chat/completions"
    tasks = [
        asyncio.create_task(
            post_json(http, url, chat_body(f"request {i}", max_tokens=300, sim_output_tokens=200))
        )
        for i in range(16)
    ]
    peak_waiting = 0.0
    peak_kv = 0.0
    while not all(t.done() for t in tasks):
        m = await metrics(http, sim)
        peak_waiting = max(peak_waiting, m[WAITING])
        peak_kv = max(peak_kv, m[KV])
        await asyncio.sleep(0.01)
    results = [t.result() for t in tasks]
    assert all(status == 200 for status, _ in results)
    assert all(out["usage"]["completion_tokens"] == 200 for _, out in results)
    assert all(out["choices"][0]["finish_reason"] == "stop" for _, out in results)
    m = await metrics(http, sim)
    assert m["vllm:num_preemptions_total"] > 0
    assert peak_waiting > 0 and peak_kv > 0.8
    assert m["vllm:generation_tokens_total"] == 16 * 200
    assert m["vllm:request_queue_time_seconds_sum"] > 0
    assert m[KV] == 0 and m[RUNNING] == 0 and m[WAITING] == 0


async def test_aborted_stream_frees_its_blocks(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(num_gpu_blocks=1000, time_scale=5.0)
    body = chat_body(max_tokens=2000, stream=True)
    resp = await http.post(sim.url + "/v1/chat/completions", json=body)
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    assert (await metrics(http, sim))[KV] > 0
    resp.close()  # drop the connection mid-stream
    await poll(lambda: _gauges_idle(http, sim))
    assert sim.engine.scheduler.pool.num_used == 0
    m = await metrics(http, sim)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1


async def test_client_giving_up_while_queued_leaves_the_queue(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(num_gpu_blocks=1000, max_num_seqs=1, time_scale=5.0)
    url = sim.url + "/v1/chat/completions"
    running = asyncio.create_task(post_json(http, url, chat_body(max_tokens=3000)))

    async def one_running() -> bool:
        return (await metrics(http, sim))[RUNNING] == 1

    await poll(one_running)  # the long request holds the only seat before the short one arrives
    queued = asyncio.create_task(post_json(http, url, chat_body(max_tokens=10)))

    async def one_waiting() -> bool:
        m = await metrics(http, sim)
        return m[WAITING] == 1 and m[RUNNING] == 1

    await poll(one_waiting)
    queued.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await queued

    async def none_waiting() -> bool:
        return (await metrics(http, sim))[WAITING] == 0

    await poll(none_waiting)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    await poll(lambda: _gauges_idle(http, sim))


async def test_oom_mode_crashes_fails_in_flight_and_restarts(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        num_gpu_blocks=64,
        max_model_len=1024,
        overflow=Overflow.OOM,
        time_scale=20.0,
        oom_restart_seconds=30.0,
    )
    url = sim.url + "/v1/chat/completions"
    stream = await http.post(url, json=chat_body(max_tokens=700, stream=True))
    assert stream.status == 200
    first = await stream.content.readuntil(b"\n\n")
    assert first.startswith(b"data: ")
    flood = [
        asyncio.create_task(post_json(http, url, chat_body(f"flood {i}", max_tokens=300))) for i in range(8)
    ]
    results = await asyncio.gather(*flood)
    assert all(status == 500 for status, _ in results)
    assert all(
        out["error"]["type"] == "InternalServerError" and out["error"]["code"] == 500 for _, out in results
    )

    # The stream that was already flowing ends with an error event and no [DONE].
    rest = b""
    with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        async for chunk in stream.content.iter_any():
            rest += chunk
    stream.close()
    frames = [f[len(b"data: ") :].decode() for f in rest.split(b"\n\n") if f]
    assert "[DONE]" not in frames
    assert json_events(frames)[-1]["error"]["code"] == 500

    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    status, out = await post_json(http, url, chat_body(max_tokens=5))
    assert status == 503 and out["error"]["code"] == 503
    m = await metrics(http, sim)
    assert m["sim_oom_events_total"] == 1 and m[KV] == 0 and m[RUNNING] == 0

    async def healthy() -> bool:
        async with http.get(sim.url + "/health") as resp:
            return resp.status == 200

    await poll(healthy, within=10)
    status, out = await post_json(http, url, chat_body(max_tokens=5))
    assert status == 200 and out["usage"]["completion_tokens"] == 5


async def test_legacy_kv_metric_modes(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    from extproc.sim.metrics import LegacyKvMetric

    also = await metrics(http, await start_sim(legacy_kv_metric=LegacyKvMetric.ALSO))
    assert KV in also and "vllm:gpu_cache_usage_perc" in also
    instead = await metrics(http, await start_sim(legacy_kv_metric=LegacyKvMetric.INSTEAD))
    assert KV not in instead and "vllm:gpu_cache_usage_perc" in instead


async def test_a_full_queue_is_refused_with_vllms_503_and_counted(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    """`--max-num-queued-reqs 2`: the third unfinished sequence is refused before the scheduler, with vLLM
    0.32's QueueOverflowError body, and `vllm:admission_rejections_total` counts it; n > 1 counts n."""
    sim = await start_sim(max_num_queued_reqs=2, time_scale=1.0)
    url = sim.url + "/v1/chat/completions"
    long = chat_body(max_tokens=4000, sim_output_tokens=4000, stream=True)
    async with http.post(url, json=long) as first, http.post(url, json=long) as second:
        assert (first.status, second.status) == (200, 200)
        status, body = await post_json(http, url, chat_body(max_tokens=5))
        assert status == 503
        assert body == {
            "error": {
                "message": "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance.",
                "type": "Service Unavailable",
                "param": None,
                "code": 503,
            }
        }
        m = await metrics(http, sim)
        assert m["vllm:admission_rejections_total{reason=max_num_queued_reqs}"] == 1
        assert m[WAITING] + m[RUNNING] == 2
    # The streams gone (aborted), the queue has room again; two sequences of one request count two.
    await poll(lambda: _gauges_idle(http, sim))
    assert (await post_json(http, url, chat_body(max_tokens=5, n=3)))[0] == 503
    assert (await post_json(http, url, chat_body(max_tokens=5, n=2)))[0] == 200
