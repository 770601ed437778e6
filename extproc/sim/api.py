"""aiohttp handlers for the OpenAI-compatible surface vLLM serves, backed by the simulated engine.

Streaming responses are prepared (headers sent) on the first token, not on arrival, so a request that
fails while still queued (engine crash in oom mode) gets a clean HTTP 500 rather than a half-open SSE
stream. A client that goes away is noticed two ways: aiohttp cancels the handler (the server runs with
handler cancellation on) and writes raise ConnectionResetError; both abort the sequences at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from typing import Any

from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine, EngineDownError, Event, EventKind
from extproc.sim.kvcache import BlockPool
from extproc.sim.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from extproc.sim.protocol import (
    OUTPUT_TOKENS_HEADER,
    ApiError,
    bad_request,
    check_context,
    count_prompts,
    parse_request,
    plan_output,
)
from extproc.sim.scheduler import Scheduler
from extproc.sim.textgen import generate_tokens

log = logging.getLogger(__name__)


class SimState:
    """Per-app state the handlers share: config, engine and the request-level RNG."""

    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.rng = random.Random(config.seed)
        self.request_counter = 0
        self.created = int(time.time())


ENGINE_KEY: web.AppKey[Engine] = web.AppKey("sim_engine", Engine)
STATE_KEY: web.AppKey[SimState] = web.AppKey("sim_state", SimState)


def build_engine(config: SimConfig) -> Engine:
    """Scheduler, block pool and metrics wired from a config (no event loop needed until start)."""
    config.validate()
    pool = BlockPool(config.resolved_num_gpu_blocks(), config.block_size)
    scheduler = Scheduler(config.scheduler_config(), pool, config.timing)
    metrics = EngineMetrics(config.model, config.cache_info(), config.legacy_kv_metric)
    return Engine(scheduler, metrics, config.time_scale, config.oom_restart_seconds)


def build_app(config: SimConfig, engine: Engine | None = None) -> web.Application:
    """The aiohttp application; the engine loop starts and stops with the app."""
    engine = engine or build_engine(config)
    app = web.Application()
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = SimState(config, engine)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)

    async def lifecycle(app: web.Application) -> Any:
        app[ENGINE_KEY].start()
        yield
        await app[ENGINE_KEY].stop()

    app.cleanup_ctx.append(lifecycle)
    return app


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = state.config.model
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": name,
        "parent": None,
        "max_model_len": state.config.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE_KEY].is_up else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


class _Choice:
    """One choice of a response: its planned tokens, finish reason and what has been sent."""

    def __init__(self, index: int, prompt_tokens: int, tokens: list[str], reason: str) -> None:
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.reason = reason
        self.sent = 0
        self.done = False


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    cfg = state.config
    engine = state.engine
    try:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("Invalid JSON body") from None
        req = parse_request(body, chat, request.headers.get(OUTPUT_TOKENS_HEADER), cfg.model)
        prompts = await asyncio.to_thread(count_prompts, req, cfg.encoding)
        for p in prompts:
            check_context(p, req.max_tokens, cfg.max_model_len)
        if not engine.is_up:
            raise ApiError(
                503, "Engine is restarting after a KV-cache out-of-memory crash", "ServiceUnavailableError"
            )
    except ApiError as err:
        return _error_response(err)

    state.request_counter += 1
    req_no = state.request_counter
    choices: list[_Choice] = []
    items = []
    for p_idx, prompt_tokens in enumerate(prompts):
        for j in range(req.n):
            index = p_idx * req.n + j
            count, reason = plan_output(
                prompt_tokens,
                req.max_tokens,
                req.output_override,
                cfg.max_model_len,
                state.rng,
                cfg.output_len_median,
                cfg.output_len_sigma,
            )
            tokens = generate_tokens(count, f"{cfg.seed}:{req_no}:{index}", cfg.encoding)
            choices.append(_Choice(index, prompt_tokens, tokens, reason))
            items.append((engine.new_sequence(prompt_tokens, count), index, reason))
    sink: asyncio.Queue[Event] = asyncio.Queue()
    try:
        tracked = engine.submit(items, sink)
    except EngineDownError:
        return _error_response(
            ApiError(
                503, "Engine is restarting after a KV-cache out-of-memory crash", "ServiceUnavailableError"
            )
        )
    prompt_total = sum(prompts)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    log.debug(
        "request %s: %d prompt(s), %d prompt tokens, %d choices",
        rid,
        len(prompts),
        prompt_total,
        len(choices),
    )
    try:
        if req.stream:
            return await _stream(request, rid, chat, req.include_usage, choices, prompt_total, sink, state)
        return await _collect(rid, chat, choices, prompt_total, sink, state)
    except (asyncio.CancelledError, ConnectionResetError):
        engine.abort(tracked)
        log.info("request %s: client disconnected, sequences aborted", rid)
        raise
    finally:
        # Any path that leaves early (errors included) must not leave sequences holding blocks.
        engine.abort(tracked)


def _usage(prompt_total: int, choices: list[_Choice]) -> dict[str, int]:
    completion = sum(c.sent for c in choices)
    return {
        "prompt_tokens": prompt_total,
        "completion_tokens": completion,
        "total_tokens": prompt_total + completion,
    }


async def _collect(
    rid: str,
    chat: bool,
    choices: list[_Choice],
    prompt_total: int,
    sink: asyncio.Queue[Event],
    state: SimState,
) -> web.Response:
    remaining = len(choices)
    while remaining:
        ev = await sink.get()
        if ev.kind is EventKind.ERROR:
            return _error_response(ApiError(500, ev.message, "InternalServerError"))
        choice = choices[ev.index]
        choice.sent = ev.count
        if ev.finished:
            choice.done = True
            remaining -= 1
    out: list[dict[str, Any]] = []
    for c in choices:
        text = "".join(c.tokens[: c.sent])
        entry: dict[str, Any] = {"index": c.index}
        if chat:
            entry["message"] = {"role": "assistant", "content": text}
        else:
            entry["text"] = text
        entry.update({"logprobs": None, "finish_reason": c.reason, "stop_reason": None})
        out.append(entry)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.config.model,
        "choices": out,
        "usage": _usage(prompt_total, choices),
    }
    return web.json_response(body)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    request: web.Request,
    rid: str,
    chat: bool,
    include_usage: bool,
    choices: list[_Choice],
    prompt_total: int,
    sink: asyncio.Queue[Event],
    state: SimState,
) -> web.StreamResponse:
    created = int(time.time())
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": state.config.model,
    }
    resp: web.StreamResponse | None = None
    remaining = len(choices)
    while remaining:
        ev = await sink.get()
        if ev.kind is EventKind.ERROR:
            err = ApiError(500, ev.message, "InternalServerError")
            if resp is None:
                return _error_response(err)
            await resp.write(_sse(err.body()))
            # The engine died: end the body without [DONE] and close the connection, so a client
            # cannot mistake the partial answer for a complete one but still reads the error event.
            resp.force_close()
            await resp.write_eof()
            return resp
        if resp is None:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
        choice = choices[ev.index]
        out = bytearray()
        if chat and choice.sent == 0:
            out += _sse(
                {**base, "choices": [_chat_delta(choice.index, {"role": "assistant", "content": ""}, None)]}
            )
        for k in range(choice.sent, ev.count):
            last = ev.finished and k == ev.count - 1
            reason = choice.reason if last else None
            text = choice.tokens[k]
            if chat:
                chunk = _chat_delta(choice.index, {"content": text}, reason)
            else:
                chunk = {
                    "index": choice.index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": reason,
                    "stop_reason": None,
                }
            out += _sse({**base, "choices": [chunk]})
        choice.sent = ev.count
        if ev.finished:
            choice.done = True
            remaining -= 1
        await resp.write(bytes(out))
    if resp is None:  # no choices at all cannot happen (n >= 1), kept for type narrowing
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
    if include_usage:
        await resp.write(_sse({**base, "choices": [], "usage": _usage(prompt_total, choices)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chat_delta(index: int, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
