"""A burst on the real vLLM with the `openai` SDK's default retries: `python -m bench.protection.burst`.

Issue 28's target: 40 requests of about 1,400 prompt and 500 output tokens sent at once to the real-engine
tier's vLLM (16,384-token cache: about eight of them fit), each by the `openai` SDK with its default policy
(2 retries, honouring `retry-after` up to 60 s): at least 36 of 40 answered through the gateway, and 0
preemptions. The same burst straight to the engine is the reference (vLLM queues everything, and preempts
as the answers outgrow the cache). The gateway is the lean profile with the shipped protection (bound
admission, the KV budget at 0.9 with forecast booking), as tests/engine/test_protection_engine.py runs it,
warmed with one short stream so the pool has a decode pace (its KV refusals' `retry-after` is forecast at it).
It runs twice: with no class queue (every request the KV budget cannot take now is refused at once, with the
forecast `retry-after`), and with a class that queues for 90 s (a request waits for its KV as for a slot, and
Envoy's `max_message_timeout` is raised to let it: `admission.envoy_max_message_timeout_seconds`).

Prints one line per mode and writes bench/results/burst-engine.json. Needs the engine venv
(`make engine-env`).

`--chats` runs issue 41's burst instead (tests/support/burst.py): forty streamed chats of about 1,500
prompt and 300 output tokens at once, straight to vLLM, then through a gateway started cold (no pace
learned, no warm-up) with the config `make run UPSTREAM=` writes for this engine (config/local.yaml fitted
by devstack/upstream.py: the shipped `interactive` class queues 25 s), once per SDK `max_retries` in
`--retries`; TTFT is from a request's first attempt to its first token. Writes
bench/results/burst-engine-chats.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import yaml

from bench.common import write_json
from devstack.stack import LOCAL_CONFIG
from devstack.upstream import Upstream
from extproc.envoyconf.bootstrap import http_connection_managers
from tests.engine.stacks import engine_config, engine_host_envoy, start_gateway, wait_idle
from tests.support import burst as chat_burst
from tests.support.engine import CACHE_TOKENS, MAX_MODEL_LEN, MODEL, Engine, running_engine
from tests.support.stack import Stack, http, metric

REQUESTS = 40
PROMPT_WORDS = 1_270
"""About 1,400 prompt tokens with the tiny model's tokenizer (1,000 of these words count about 1,100)."""
OUTPUT_TOKENS = 500
SDK_RETRIES = 2
"""The `openai` SDK's default `max_retries`."""
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "falcon", "ember"]
OUT = "burst-engine.json"


@dataclass
class Outcome:
    mode: str
    answered: int
    refused: int
    failed: int
    preemptions: float
    seconds: float
    gateway_refusals: float = 0.0
    attempts: tuple[dict[str, Any], ...] = ()


def prompt(seed: int) -> str:
    """Distinct prompts: identical ones would share cached prefix blocks."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(PROMPT_WORDS))


ATTEMPTS: list[dict[str, Any]] = []
"""Every attempt's answer as the client saw it: when, status, reason, hint (for the results file)."""
STARTED = [0.0]


def _record(response: httpx.Response) -> None:
    headers = response.headers
    ATTEMPTS.append(
        {
            "at_s": round(time.monotonic() - STARTED[0], 2),
            "status": response.status_code,
            "reason": headers.get("x-extproc-reject-reason", ""),
            "retry_after_s": float(headers.get("retry-after-ms", "0")) / 1000,
        }
    )


def one(url: str, seed: int) -> str:
    """One request as an application sends it: the SDK's default retries, its own backoff and hints."""
    http_client = httpx.Client(event_hooks={"response": [_record]}, timeout=600)
    with openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=SDK_RETRIES, http_client=http_client
    ) as client:
        try:
            client.completions.create(model=MODEL, prompt=prompt(seed), max_tokens=OUTPUT_TOKENS)
        except openai.RateLimitError:
            return "refused"
        except openai.APIError:
            return "failed"
    return "answered"


def burst(url: str, base_seed: int) -> tuple[list[str], float]:
    started = STARTED[0] = time.monotonic()
    ATTEMPTS.clear()
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        results = list(pool.map(lambda i: one(url, base_seed + i), range(REQUESTS)))
    return results, time.monotonic() - started


def preemptions(engine: Engine) -> float:
    return metric(f"{engine.url}/metrics", "vllm:num_preemptions_total")


def run(mode: str, engine: Engine, url: str, seed: int, gateway: Stack | None = None) -> Outcome:
    before = preemptions(engine)
    refusals = gateway.sidecar("extproc_requests_total", decision="rejected") if gateway else 0.0
    results, seconds = burst(url, seed)
    after = gateway.sidecar("extproc_requests_total", decision="rejected") if gateway else 0.0
    outcome = Outcome(
        mode=mode,
        answered=results.count("answered"),
        refused=results.count("refused"),
        failed=results.count("failed"),
        preemptions=preemptions(engine) - before,
        seconds=round(seconds, 1),
        gateway_refusals=after - refusals,
        attempts=tuple(ATTEMPTS),
    )
    print(replace(outcome, attempts=()), flush=True)
    refused = [a for a in ATTEMPTS if a["status"] == 429]
    reasons = Counter(a["reason"] for a in refused)
    hints = sorted(a["retry_after_s"] for a in refused)
    print(f"  refusals by reason {dict(reasons)}; retry-after s {hints}", flush=True)
    return outcome


def protected_config(queue_s: float) -> dict[str, Any]:
    """The shipped protection; with `queue_s`, one class whose requests wait that long for capacity (KV
    included) before they are refused."""
    config = engine_config()
    config["admission"]["bound_admission"] = True
    config["kv_budget"] = {"enabled": True, "target_utilization": 0.9}
    if queue_s > 0:
        config["classes"] = [{"name": "standard", "queue": {"max_wait_seconds": queue_s}}]
        config["default_class"] = "standard"
        config["admission"]["envoy_max_message_timeout_seconds"] = queue_s + QUEUE_MARGIN_S
    return config


QUEUE_MARGIN_S = 5
"""Envoy's `max_message_timeout` over the class's wait: the sidecar extends the message timer by the wait
(rounded up, plus a second) while a request queues, and Envoy caps that at its `max_message_timeout`."""


def envoy_for(queue_s: float) -> Callable[[dict[str, Any]], None]:
    """The engine host's Envoy, its `max_message_timeout` raised to let a request wait `queue_s`."""

    def patch(config: dict[str, Any]) -> None:
        engine_host_envoy(config)
        for hcm in http_connection_managers(config):
            for http_filter in hcm["http_filters"]:
                typed = http_filter.get("typed_config", {})
                if "max_message_timeout" in typed and queue_s + QUEUE_MARGIN_S > 30:
                    typed["max_message_timeout"] = f"{queue_s + QUEUE_MARGIN_S:g}s"

    return patch


def wait_fed(gateway: Stack) -> None:
    """Until the gateway's KV feed reports the engine's capacity, at most 60 s."""
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        if time.monotonic() > deadline:
            raise RuntimeError("the KV feed never reported the engine's capacity")
        time.sleep(0.2)


def through_gateway(engine: Engine, profile: str, seed: int, queue_s: float) -> Outcome:
    local = start_gateway(
        engine, protected_config(queue_s), profile, with_exporter=True, envoy_patch=envoy_for(queue_s)
    )
    try:
        gateway = Stack(local)
        wait_fed(gateway)
        warm = {"model": MODEL, "prompt": prompt(1), "max_tokens": 64, "stream": True}
        assert http("POST", f"{gateway.url}/v1/completions", warm).status == 200
        wait_idle(gateway)
        mode = f"gateway-{profile}" + (f"-queue-{queue_s:g}s" if queue_s > 0 else "")
        return run(mode, engine, gateway.url, seed, gateway)
    finally:
        local.stop()


def shipped_config(engine: Engine) -> dict[str, Any]:
    """config/local.yaml as `make run UPSTREAM=` fits it to this engine (devstack/upstream.py)."""
    upstream = Upstream(engine.url, "127.0.0.1", engine.port, MODEL, MAX_MODEL_LEN)
    return upstream.sidecar_config(yaml.safe_load(LOCAL_CONFIG.read_text()))


@dataclass
class ChatOutcome:
    mode: str
    retries: int
    answered: int
    refusals: int
    ttft_p99_s: float
    wall_s: float
    preemptions: float


def _chats(mode: str, engine: Engine, url: str, retries: int, seed: int) -> ChatOutcome:
    before = preemptions(engine)
    result = chat_burst.burst(url, retries, seed, MODEL)
    row = ChatOutcome(
        mode,
        retries,
        result.answered,
        result.refusals,
        round(result.ttft_p99_s, 2),
        round(result.wall_s, 1),
        preemptions(engine) - before,
    )
    print(f"{result.row(f'{mode} (max_retries={retries})')}, preemptions {row.preemptions:g}", flush=True)
    return row


def chats_through_shipped(engine: Engine, retries: int, seed: int) -> ChatOutcome:
    """Issue 41's burst through a gateway started cold with the shipped config fitted to the engine."""
    local = start_gateway(engine, shipped_config(engine), "lean", with_exporter=True)
    try:
        gateway = Stack(local)
        wait_fed(gateway)
        return _chats("gateway, shipped config", engine, gateway.url, retries, seed)
    finally:
        local.stop()


def chat_rows(engine: Engine, retries: list[int], direct: bool) -> None:
    rows: list[ChatOutcome] = []
    if direct:
        rows.append(_chats("straight to vLLM", engine, engine.url, chat_burst.SDK_DEFAULT_RETRIES, 5_000))
        wait_engine_idle(engine)
    for index, count in enumerate(retries):
        rows.append(chats_through_shipped(engine, count, 6_000 + 100 * index))
        wait_engine_idle(engine)
    results = {"requests": chat_burst.REQUESTS, "rows": [asdict(r) for r in rows]}
    write_json("burst-engine-chats.json", results)


def wait_engine_idle(engine: Engine) -> None:
    """Until vLLM runs and queues nothing (an earlier burst's last answers), at most 120 s."""
    deadline = time.monotonic() + 120
    page = f"{engine.url}/metrics"
    while metric(page, "vllm:num_requests_running") + metric(page, "vllm:num_requests_waiting") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine never went idle")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="+", default=["lean"], choices=["lean", "inline"])
    parser.add_argument("--no-direct", action="store_true", help="skip the burst straight to the engine")
    parser.add_argument(
        "--queue",
        type=float,
        nargs="+",
        default=[0.0, 90.0],
        help="class queue waits to run the gateway with (0: no queue, KV refusals at once)",
    )
    parser.add_argument("--chats", action="store_true", help="issue 41's streamed chats, shipped config")
    parser.add_argument("--retries", type=int, nargs="+", default=[2, 0], help="with --chats: max_retries")
    args = parser.parse_args()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="burst-") as tmp, running_engine(Path(tmp)) as engine:
        if args.chats:
            chat_rows(engine, args.retries, not args.no_direct)
            return
        if not args.no_direct:
            outcomes.append(run("direct", engine, engine.url, 5_000))
            time.sleep(5)
        for index, profile in enumerate(args.profiles):
            for queue_s in args.queue:
                outcomes.append(through_gateway(engine, profile, 6_000 + 100 * index, queue_s))
    write_json(OUT, {"requests": REQUESTS, "outcomes": [asdict(o) for o in outcomes]})


if __name__ == "__main__":
    main()
