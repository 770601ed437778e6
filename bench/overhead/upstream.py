"""A no-op OpenAI-style upstream on raw asyncio: fixed JSON, or a fixed SSE stream, answered at once.

Raw asyncio HTTP/1.1 (keep-alive, content-length bodies) instead of aiohttp so that the upstream's own CPU
and latency stay far below what is measured in front of it. `python -m bench.overhead.upstream --port N`.

A body containing `"stream": true` gets `--chunks` SSE events (or as many as its `"x_chunks"` says), one per
write with `--chunk-gap-ms` between them (so Envoy forwards each as its own body chunk, like a token
stream), then a usage chunk when the
request asked for `include_usage` (the sidecar injects it), then `[DONE]`.

`GET /metrics` answers a fixed vLLM metrics page (the names of vllm 0.33.0 vllm/v1/metrics/loggers.py, as
extproc/kvfeed/engines.py reads them): 30 % KV usage of 27,000 blocks of 16 tokens, so a sidecar in the
shipped config sees a fresh feed, full limits and a KV budget with a known capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": " ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()

_STREAM = re.compile(rb'"stream"\s*:\s*true')
_INCLUDE_USAGE = re.compile(rb'"include_usage"\s*:\s*true')
_CHUNKS = re.compile(rb'"x_chunks"\s*:\s*(\d+)')


def _chunk(index: int) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": {"content": " the"}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE_CHUNK = (
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench-model",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    + b"\n\n"
)


METRICS_PAGE = b"""\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b"} 0.3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-3-8b"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-3-8b"} 1.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama-3-8b"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="27000"} 1.0
"""

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunks: int, gap_s: float
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            if head.startswith(b"GET /metrics"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                    + str(len(METRICS_PAGE)).encode()
                    + b"\r\n\r\n"
                    + METRICS_PAGE
                )
            elif _STREAM.search(body):
                writer.write(SSE_HEAD)
                wanted = _CHUNKS.search(body)
                for i in range(int(wanted.group(1)) if wanted else chunks):
                    writer.write(_chunked(_chunk(i)))
                    await writer.drain()
                    if gap_s:
                        await asyncio.sleep(gap_s)
                if _INCLUDE_USAGE.search(body):
                    writer.write(_chunked(USAGE_CHUNK))
                writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(COMPLETION)).encode()
                    + b"\r\n\r\n"
                    + COMPLETION
                )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve(port: int, chunks: int, gap_s: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, chunks, gap_s), "127.0.0.1", port, limit=1 << 16, backlog=1024
    )
    print(f"upstream listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--chunk-gap-ms", type=float, default=2.0)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.chunks, args.chunk_gap_ms / 1000))


if __name__ == "__main__":
    main()
