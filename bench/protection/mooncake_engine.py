"""Mooncake's conversation trace on a real vLLM: `python -m bench.protection.mooncake_engine [--requests N]`.

`bench.protection.mooncake` replays Mooncake's FAST'25 traces on engine time through the simulator's prefix
cache; this replays a slice of the conversation trace (one hour of online chat, 36.6 % of prompt blocks
repeat a prefix seen before) against vLLM 0.32.0's CPU build serving the real-engine tier's tiny Llama (128
blocks of 128 tokens, prefix caching on as shipped), so the prefix credit meets the engine's own block
hashing: each trace request's `hash_ids` (its prompt's 512-token blocks, equal ids for equal text) become
`ID_TOKENS` words per id, one cl100k token each (`prefix_load.WORDS`), so equal ids give equal leading
tokens in the rendered prompt and the engine shares what the trace shares. Requests arrive at the trace's
own times (`--speed` compresses them), stream, run their trace's output length (`ignore_eos`) and honour
`retry-after`, as in the shared-system-prompt overload (section 6).

Three ways in one run, as `bench.protection.prefix`: straight to the engine, through the gateway with the
shipped booking (lean profile, bound admission, forecast, prefix sharing; slots out of the way), and with
`kv_budget.prefix_sharing: false`. Reports what `prefix_load.Run` does (output tok/s, preemptions, KV mean
and peak, TTFT, the engine's prefix hit rate, the sidecar's booked peak). Results:
bench/results/mooncake-vllm.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.protection import trace as tr
from bench.protection.engine import start_engine
from bench.protection.mooncake import START_S, TRACES, records, scaled_prompt
from bench.protection.prefix import MODES, through_gateway
from tests.engine.stacks import wait_read_idle
from tests.support import prefix_load
from tests.support.engine import BLOCK_TOKENS, CACHE_TOKENS, MAX_MODEL_LEN, MODEL, Engine
from tests.support.stack import Stack

ID_TOKENS = 32
"""Words (tokens) per trace block id, which stands for 512 tokens: the trace's mean prompt of 12,035 tokens
becomes about 750, so about fifteen requests with their answers fill the tier's 16,384-token cache."""
MAX_OUTPUT = 1_000
"""Answers longer than this are cut to it: the trace's longest would hold the tiny engine for minutes."""


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the slice's first request, at the trace's own speed
    text: str
    output: int


def id_words(block: int) -> list[str]:
    """One trace block id's words: the same id, the same words (its seed)."""
    return prefix_load.words(block, ID_TOKENS).split()


def load(path: Path, start_s: float, count: int) -> list[Request]:
    """`count` requests from `start_s` on, their prompts made from their block ids (the last id's words cut
    to the scaled prompt length, as the trace's last block is partial)."""
    rows: list[Request] = []
    first: float | None = None
    for t, input_length, output_length, ids in records(path, start_s):
        prompt = scaled_prompt(input_length, ids, ID_TOKENS)
        output = max(1, min(MAX_OUTPUT, output_length))
        if prompt + output + 64 >= MAX_MODEL_LEN:  # the template's tokens beside the text
            continue
        first = t if first is None else first
        text = " ".join([w for block in ids for w in id_words(block)][:prompt])
        rows.append(Request(t - first, text, output))
        if len(rows) == count:
            break
    return rows


def body(request: Request) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": request.text}],
        "max_tokens": request.output,
        "ignore_eos": True,
        "stream": True,
    }


def replay(
    engine: Engine, url: str, requests: list[Request], speed: float, gateway: Stack | None = None
) -> prefix_load.Run:
    """Each request sent at its time (divided by `speed`) to `url`, retried on each 429's hint."""

    def send() -> list[prefix_load.Answer]:
        started = time.monotonic()
        deadline = started + 600

        def one(request: Request) -> prefix_load.Answer:
            time.sleep(max(0.0, started + request.at / speed - time.monotonic()))
            return prefix_load.call(url, body(request), deadline)

        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))

    if gateway is None:
        return prefix_load.measured(engine.url, CACHE_TOKENS, send)
    settle = functools.partial(wait_read_idle, gateway)
    return prefix_load.measured(engine.url, CACHE_TOKENS, send, gateway.stack.admin_url, settle)


def run_mode(mode: str, engine: Engine, requests: list[Request], speed: float) -> dict[str, Any]:
    if mode == "direct":
        return {"mode": mode, **replay(engine, engine.url, requests, speed).figures()}
    run = through_gateway(mode, engine, lambda stack: replay(engine, stack.url, requests, speed, stack))
    return {"mode": mode, **run.figures()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.mooncake_engine", description=__doc__)
    parser.add_argument("--requests", type=int, default=120, help="requests from the slice (default 120)")
    parser.add_argument("--speed", type=float, default=1.0, help="arrival-time compression (default 1.0)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=BLOCK_TOKENS,
        help=f"the engine's KV block size; the cache stays {CACHE_TOKENS:,} tokens (default {BLOCK_TOKENS})",
    )
    args = parser.parse_args(argv)
    directory = tr.traces_dir()
    path = None if directory is None else directory / TRACES["conversation"]
    if path is None or not path.is_file():
        raise SystemExit(f"mooncake: traces not found (set ${tr.ENV_VAR} or use ../shared/traces)")
    requests = load(path, START_S, args.requests)
    workdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-vllm-"))
    blocks = CACHE_TOKENS // args.block_tokens
    geometry = ("--block-size", str(args.block_tokens), "--num-gpu-blocks-override", str(blocks))
    process, url = start_engine(workdir, *geometry)
    engine = Engine(process, int(url.rsplit(":", 1)[1]), workdir)
    rows = []
    try:
        for mode in args.modes.split(","):
            row = run_mode(mode, engine, requests, args.speed)
            print(f"mooncake (vllm) {mode}: {row}", flush=True)
            rows.append(row)
    finally:
        process.stop(30)
    span = requests[-1].at / args.speed if requests else 0.0
    result = {"requests": len(requests), "id_tokens": ID_TOKENS, "speed": args.speed, "span_s": span}
    suffix = "" if args.block_tokens == BLOCK_TOKENS else f"-block{args.block_tokens}"
    write_json(f"mooncake-vllm{suffix}.json", {**result, "block_tokens": args.block_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
