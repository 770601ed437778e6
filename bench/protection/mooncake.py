"""Shared prefixes on the simulator, in engine time: Mooncake's FAST'25 traces through the protection modes.

`python -m bench.protection.mooncake [--full]` replays a slice of Mooncake's conversation trace (one hour of
online chat, 36.6 % of prompt blocks repeat a prefix seen before) and of its synthetic multi-turn trace
(64.0 %) with `bench.protection.offline`'s replay: the sidecar's pure core (limiter, KV budget, adaptive
scale) in front of the simulator's scheduler with vLLM's prefix cache (`PrefixCachingBlockPool`). Each
trace request's `hash_ids` (its prompt's 512-token blocks, equal ids for equal text) become its prompt:
`ID_TOKENS` tokens per id, so the engine's cache and the budget see the trace's sharing; prompts are scaled
by ID_TOKENS / 512 to the benchmark's deployment (51,584 KV tokens, 8,192-token window), as the Azure
replay scales its trace to it, and answers keep their lengths.

Modes: `envoy` (straight to the engine), `feedback, whole prompts` (the KV budget as before prefix
sharing: `kv_budget.prefix_sharing: false`), `feedback` (the shipped booking), and the oracle client (its
`max_tokens` is the exact answer length, every answer streams) with prefix sharing: the best booking can
do. Results: bench/results/protection-mooncake[-short].json.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.protection import trace as tr
from bench.protection.offline import Policy, Prefixes, Replay, oracle_budget, policy_for
from bench.protection.run import Deployment, size_limits
from extproc.core.kv.budget import BookingMode, KvBudget

TRACES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}
ID_TOKENS = 64
"""Tokens per trace block id after scaling (Mooncake's ids stand for 512 tokens): the trace's mean prompt of
12,035 tokens becomes about 1,500, as the Azure conversation trace's 1,155."""
START_S = 600.0


def records(path: Path, start_s: float) -> Iterator[tuple[float, int, int, list[int]]]:
    """The trace's requests from `start_s` on: (seconds into the trace, input and output length in the
    trace's tokens, block ids)."""
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            t = rec["timestamp"] / 1000
            if t >= start_s:
                yield t, rec["input_length"], rec["output_length"], rec["hash_ids"]


def scaled_prompt(input_length: int, ids: list[int], id_tokens: int) -> int:
    """A prompt's length with each 512-token block id scaled to `id_tokens`, never past its ids' (the last
    block is partial)."""
    return min(math.ceil(input_length * id_tokens / 512), len(ids) * id_tokens)


def load(
    path: Path, start_s: float, count: int, max_model_len: int
) -> tuple[list[tr.TraceRequest], Prefixes]:
    """`count` requests from `start_s` on: scaled prompts, and their block ids."""
    rows = []
    for t, input_length, output, ids in records(path, start_s):
        prompt = scaled_prompt(input_length, ids, ID_TOKENS)
        if prompt + output >= max_model_len:
            continue  # past the scaled window: the trace's longest prompts
        rows.append((t, prompt, output, tuple(ids)))
        if len(rows) == count:
            break
    t0 = rows[0][0]
    trace = [tr.TraceRequest(t - t0, prompt, out, "mooncake") for t, prompt, out, _ in rows]
    return trace, Prefixes([ids for *_, ids in rows], ID_TOKENS)


def unshared(policy: Policy) -> Policy:
    """The policy with every prompt booked whole, as before prefix sharing."""
    build = policy.budget
    assert build is not None

    def budget(capacity: int) -> KvBudget:
        made = build(capacity)
        made.prefix_sharing = False
        return made

    return replace(policy, budget=budget)


def scenarios(trace: list[tr.TraceRequest], dep: Deployment) -> list[tuple[str, Policy | None]]:
    shipped = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert shipped is not None and shipped.budget is not None
    probe = shipped.budget(dep.kv_tokens)
    assert probe.booking is BookingMode.FORECAST and probe.prefix_sharing
    return [
        ("envoy", None),
        ("feedback, whole prompts", unshared(shipped)),
        ("feedback", shipped),
        ("feedback, oracle client", replace(shipped, budget=oracle_budget(0.9), oracle=True)),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.mooncake", description=__doc__)
    parser.add_argument("--full", action="store_true", help="1,200 requests per trace (default 500)")
    parser.add_argument("--rates", default="1,2,4", help="arrival-rate multipliers, comma-separated")
    args = parser.parse_args(argv)
    directory = tr.traces_dir()
    if directory is None or not all((directory / name).is_file() for name in TRACES.values()):
        raise SystemExit(f"mooncake: traces not found (set ${tr.ENV_VAR} or use ../shared/traces)")
    dep = Deployment()
    rows = []
    for name, file in TRACES.items():
        trace, prefixes = load(directory / file, START_S, 1200 if args.full else 500, dep.max_model_len)
        for rate in (float(r) for r in args.rates.split(",")):
            for mode, policy in scenarios(trace, dep):
                outcome = Replay(trace, dep, policy, rate, prefixes=prefixes).run()
                label = f"{name} {rate:g}x {mode}"
                print(f"{label:44s} {outcome.line()}", flush=True)
                rows.append({"trace": name, "scenario": mode, "rate": rate, **asdict(outcome)})
    result = {"requests_per_trace": 1200 if args.full else 500, "id_tokens": ID_TOKENS, "rows": rows}
    write_json(f"protection-mooncake{'' if args.full else '-short'}.json", result)
    return result


if __name__ == "__main__":
    main()
