"""Issue 41's burst on `make run`'s stack: `python -m bench.burst_sim`.

Forty streamed chats of about 1,500 prompt and 300 output tokens, sent at once by the official `openai` SDK
(tests/support/burst.py), through the gateway as `make run` starts it (config/local.yaml, the lean profile,
the simulator's 16,384-token cache, the KV-cache exporter) from a cold start (no pace learned yet), then
straight to the same simulator. Once per `--retries` value (the SDK's default is 2). Prints one row per run:
answered, the 429s the clients met, time to first token p99, wall time, and the simulator's preemptions.
`--config` runs another sidecar config instead (the rows in bench/RESULTS.md compare with the config before
its queue); `--prompt-words 2500 --output-tokens 100` sends prompts long enough (~12 KB) to be counted on the
tokenizer threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from devstack.run import LOCAL_SIM_ARGS
from devstack.stack import LOCAL_CONFIG
from tests.support.burst import CHATS, Shape, burst
from tests.support.stack import Stack, start_stack

CACHE_TOKENS = 1024 * 16


def _preemptions(stack: Stack) -> float:
    return stack.upstream("vllm:num_preemptions_total")


def _wait_feed(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while stack.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        if time.monotonic() > deadline:
            raise RuntimeError("the feed never reported the simulator's cache")
        time.sleep(0.2)


def _wait_idle(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    while stack.upstream("vllm:num_requests_running") + stack.upstream("vllm:num_requests_waiting") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the simulator never went idle")
        time.sleep(0.2)


def run(config_path: Path, retries: int, profile: str, direct: bool, shape: Shape = CHATS) -> None:
    config = yaml.safe_load(config_path.read_text())
    local = start_stack(config, LOCAL_SIM_ARGS, profile=profile, with_exporter=True, envoy_patch=None)
    try:
        stack = Stack(local)
        _wait_feed(stack)
        before = _preemptions(stack)
        result = burst(stack.url, retries, shape=shape)
        print(f"{result.row(f'gateway ({config_path}, {profile}, max_retries={retries})')}, "
              f"preemptions {_preemptions(stack) - before:g}; 429s by reason {dict(result.reasons())}",
              flush=True)  # fmt: skip
        print(f"  429 retry-after s: {[a.retry_after_s for a in result.attempts if a.status == 429]}")
        if direct:
            _wait_idle(stack)
            before = _preemptions(stack)
            result = burst(local.upstream_url, retries, seed=1_000, shape=shape)
            print(f"{result.row(f'straight to the simulator (max_retries={retries})')}, "
                  f"preemptions {_preemptions(stack) - before:g}", flush=True)  # fmt: skip
    finally:
        local.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=LOCAL_CONFIG, help="the sidecar's config")
    parser.add_argument("--retries", type=int, nargs="+", default=[2, 0], help="the SDK's max_retries")
    parser.add_argument("--profile", default="lean", choices=["lean", "inline"])
    parser.add_argument("--no-direct", action="store_true", help="skip the burst straight to the simulator")
    parser.add_argument("--prompt-words", type=int, default=CHATS.prompt_words, help="each chat's prompt")
    parser.add_argument("--output-tokens", type=int, default=CHATS.output_tokens, help="each chat's answer")
    args = parser.parse_args()
    shape = Shape(args.prompt_words, args.output_tokens)
    for retries in args.retries:
        run(args.config, retries, args.profile, not args.no_direct, shape)


if __name__ == "__main__":
    main()
