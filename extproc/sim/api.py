"""aiohttp handlers for the surface vLLM serves, backed by the simulated engine.

Generation APIs (chat, completions, Responses, Anthropic Messages, Cohere chat v2, token-in/token-out,
and SageMaker's `/invocations` dispatching by body shape) run through the engine and write their answers
in their own format (`formats.py`) with the same accounting. Pooling APIs are counted and answered without
decoding.

Streaming responses are prepared (headers sent) on the first token, not on arrival, so a request that
fails while still queued (engine crash in oom mode) gets a clean HTTP 500 rather than a half-open SSE
stream. A client that goes away is noticed two ways: aiohttp cancels the handler (the server runs with
handler cancellation on) and writes raise ConnectionResetError; both abort the sequences at once, but for
every `--missed-abort-every`-th disconnect, which the engine misses as vLLM #54947 reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from extproc.sim import formats
from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine, EngineDownError, Event, EventKind
from extproc.sim.formats import Choice, Format, Reply
from extproc.sim.kvcache import BlockPool, PrefixCachingBlockPool, cache_seed
from extproc.sim.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from extproc.sim.protocol import (
    OUTPUT_TOKENS_HEADER,
    ApiError,
    ParsedRequest,
    bad_request,
    check_context,
    parse_request,
    plan_output,
    queue_overflow,
    read_prompts,
    reads_prefix_cache,
)
from extproc.sim.scheduler import Scheduler, Sequence
from extproc.sim.shapes import (
    parse_cohere_chat,
    parse_generate_tokens,
    parse_messages,
    parse_responses,
    pooling_prompts,
)
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


POOLING_PATHS = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
"""Pooling routes vLLM registers for pooling models (answered minimally, see `_pool`)."""

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("sim_engine", Engine)
STATE_KEY: web.AppKey[SimState] = web.AppKey("sim_state", SimState)


def build_engine(config: SimConfig) -> Engine:
    """Scheduler, block pool and metrics wired from a config (no event loop needed until start)."""
    config.validate()
    pool_class = PrefixCachingBlockPool if config.enable_prefix_caching else BlockPool
    pool = pool_class(config.resolved_num_gpu_blocks(), config.block_size)
    scheduler = Scheduler(config.scheduler_config(), pool, config.timing)
    metrics = EngineMetrics(config.model, config.cache_info(), config.legacy_kv_metric)
    return Engine(
        scheduler,
        metrics,
        config.time_scale,
        config.oom_restart_seconds,
        max_num_queued_reqs=config.max_num_queued_reqs,
        missed_abort_every=config.missed_abort_every,
    )


def build_app(config: SimConfig, engine: Engine | None = None) -> web.Application:
    """The aiohttp application; the engine loop starts and stops with the app."""
    engine = engine or build_engine(config)
    app = web.Application()
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = SimState(config, engine)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/inference/v1/generate", _generate_tokens)
    app.router.add_post("/invocations", _invocations)
    app.router.add_post("/cohere/v2/chat", _cohere_chat)
    for path in POOLING_PATHS:
        app.router.add_post(path, _pool)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)

    async def lifecycle(app: web.Application) -> Any:
        app[ENGINE_KEY].start()
        yield
        await app[ENGINE_KEY].stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def _models(request: web.Request) -> web.Response:
    """vLLM 0.32.0's model list (`vllm/entrypoints/openai/models/serving.py` `show_available_models`, cards
    of `vllm/entrypoints/serve/engine/protocol.py` `ModelCard`): one card per `--served-model-name`, each
    with `root` = the model path and `parent` null, then one per LoRA adapter with `root` = its path and
    `parent` = its base model's name (the first served name when none was given)."""
    state = request.app[STATE_KEY]
    cfg = state.config
    cards = [
        _card(name, state.created, root=cfg.model, max_model_len=cfg.max_model_len)
        for name in (cfg.model, *cfg.aliases)
    ]
    cards += [
        _card(name, state.created, root=f"/adapters/{name}", parent=cfg.model) for name in cfg.lora_adapters
    ]
    return web.json_response({"object": "list", "data": cards})


def _card(
    name: str, created: int, *, root: str, parent: str | None = None, max_model_len: int | None = None
) -> dict[str, Any]:
    permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": created}
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE_KEY].is_up else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


Parser = Callable[[Any, str | None, str], ParsedRequest]


def _chat_parser(body: Any, header: str | None, model: str) -> ParsedRequest:
    return parse_request(body, True, header, model)


def _completions_parser(body: Any, header: str | None, model: str) -> ParsedRequest:
    return parse_request(body, False, header, model)


def _handler(parser: Parser, fmt: Format) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request, parser, fmt)

    return handle


_chat = _handler(_chat_parser, formats.CHAT)
_completions = _handler(_completions_parser, formats.COMPLETIONS)
_responses = _handler(parse_responses, formats.RESPONSES)
_messages = _handler(parse_messages, formats.MESSAGES)
_generate_tokens = _handler(parse_generate_tokens, formats.TOKENS)
_cohere_chat = _handler(parse_cohere_chat, formats.COHERE_CHAT)


async def _invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker: the API is chosen by the body's shape, in vLLM's order (chat, completions, pooling)."""
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error_response(bad_request("Invalid JSON body"), formats.CHAT)
    if isinstance(body, dict) and body.get("messages") is not None:
        return await _serve(request, _chat_parser, formats.CHAT)
    if isinstance(body, dict) and (body.get("prompt") is not None or body.get("prompt_embeds") is not None):
        return await _serve(request, _completions_parser, formats.COMPLETIONS)
    return await _pool(request)


def _error_response(err: ApiError, fmt: Format) -> web.Response:
    return web.json_response(fmt.error_body(err), status=err.status)


async def _read_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("Invalid JSON body") from None


async def _serve(request: web.Request, parser: Parser, fmt: Format) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    cfg = state.config
    engine = state.engine
    try:
        body = await _read_body(request)
        served = cfg.served_name(body)
        req = parser(body, request.headers.get(OUTPUT_TOKENS_HEADER), served)
        seed = cache_seed(cfg.cache_namespace(served)) if cfg.enable_prefix_caching else None
        prompts = await asyncio.to_thread(read_prompts, req, cfg.encoding, cfg.block_size, seed)
        for p in prompts:
            check_context(p.tokens, req.max_tokens, cfg.max_model_len)
        if not engine.is_up:
            raise ApiError(
                503, "Engine is restarting after a KV-cache out-of-memory crash", "ServiceUnavailableError"
            )
        if not engine.admits(len(prompts) * req.n):
            raise queue_overflow()
    except ApiError as err:
        return _error_response(err, fmt)

    state.request_counter += 1
    req_no = state.request_counter
    choices: list[Choice] = []
    items = []
    read_cache = reads_prefix_cache(req)
    firsts: list[Sequence] = []  # each prompt's first sequence: its prefix-cache hit is the prompt's
    for p_idx, prompt in enumerate(prompts):
        prompt_tokens = prompt.tokens
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
            choices.append(Choice(index, prompt_tokens, tokens, reason))
            seq = engine.new_sequence(prompt_tokens, count, prompt.block_hashes, read_cache)
            items.append((seq, index, reason))
            if j == 0:
                firsts.append(seq)
    sink: asyncio.Queue[Event] = asyncio.Queue()
    try:
        tracked = engine.submit(items, sink)
    except EngineDownError:
        return _error_response(
            ApiError(
                503, "Engine is restarting after a KV-cache out-of-memory crash", "ServiceUnavailableError"
            ),
            fmt,
        )
    rid = fmt.rid_prefix + uuid.uuid4().hex
    reply = Reply(rid, cfg.model, sum(p.tokens for p in prompts), choices, req.include_usage, cfg.encoding)
    if cfg.enable_prompt_tokens_details:
        reply.cached_prompt = lambda: sum(seq.num_cached_prompt for seq in firsts)
    log.debug(
        "request %s: %d prompt(s), %d prompt tokens, %d choices",
        rid,
        len(prompts),
        reply.prompt_total,
        len(choices),
    )
    try:
        if req.stream:
            return await _stream(request, reply, fmt, sink)
        return await _collect(reply, fmt, sink)
    except (asyncio.CancelledError, ConnectionResetError):
        engine.disconnected(tracked)
        log.info("request %s: client disconnected", rid)
        raise
    finally:
        # Any path that leaves early (errors included) must not leave sequences holding blocks.
        engine.abort(tracked)


async def _collect(reply: Reply, fmt: Format, sink: asyncio.Queue[Event]) -> web.Response:
    remaining = len(reply.choices)
    while remaining:
        ev = await sink.get()
        if ev.kind is EventKind.ERROR:
            return _error_response(ApiError(500, ev.message, "InternalServerError"), fmt)
        choice = reply.choices[ev.index]
        choice.sent = ev.count
        if ev.finished:
            choice.done = True
            remaining -= 1
    return web.json_response(fmt.body(reply))


async def _stream(
    request: web.Request, reply: Reply, fmt: Format, sink: asyncio.Queue[Event]
) -> web.StreamResponse:
    resp: web.StreamResponse | None = None
    remaining = len(reply.choices)
    while remaining:
        ev = await sink.get()
        if ev.kind is EventKind.ERROR:
            err = ApiError(500, ev.message, "InternalServerError")
            if resp is None:
                return _error_response(err, fmt)
            await resp.write(fmt.stream_error(reply, err))
            # The engine died: end the body without its final event and close the connection, so a client
            # cannot mistake the partial answer for a complete one but still reads the error event.
            resp.force_close()
            await resp.write_eof()
            return resp
        out = bytearray()
        if resp is None:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            out += fmt.prelude(reply)
        choice = reply.choices[ev.index]
        if choice.sent == 0:
            out += fmt.open(reply, choice)
        for k in range(choice.sent, ev.count):
            last = ev.finished and k == ev.count - 1
            choice.sent = k + 1
            out += fmt.token(reply, choice, k, choice.reason if last else None)
        choice.sent = ev.count
        if ev.finished:
            choice.done = True
            remaining -= 1
        await resp.write(bytes(out))
    if resp is None:  # no choices at all cannot happen (n >= 1), kept for type narrowing
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
    await resp.write(fmt.close(reply))
    await resp.write_eof()
    return resp


async def _pool(request: web.Request) -> web.Response:
    """Embeddings, classify, pooling, score and rerank, answered at once without decoding.

    The prompts are counted and booked in the engine's metrics (prompt tokens and one finished request per
    prompt, as vLLM's pooling requests finish), so a test sees exactly what reached the simulator.
    """
    state = request.app[STATE_KEY]
    cfg = state.config
    try:
        body = await _read_body(request)
        prompts = await asyncio.to_thread(pooling_prompts, body, cfg.served_name(body), cfg.encoding)
        for p in prompts:
            if p > cfg.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                    f"request has {p} input tokens. Please reduce the length of the input.",
                    "input_tokens",
                )
        if not state.engine.is_up:
            raise ApiError(
                503, "Engine is restarting after a KV-cache out-of-memory crash", "ServiceUnavailableError"
            )
    except ApiError as err:
        return _error_response(err, formats.CHAT)
    state.engine.record_pooling(prompts)
    total = sum(prompts)
    data = [{"object": "embedding", "index": i, "embedding": [0.0] * 4} for i in range(len(prompts))]
    answer = {
        "id": "embd-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": cfg.model,
        "data": data,
        "results": [{"index": i, "relevance_score": 0.5} for i in range(len(prompts))],
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
    }
    return web.json_response(answer)
