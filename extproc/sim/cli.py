"""Command line for `python -m extproc.sim`: every SimConfig knob is a flag with its default shown.

Prints one line `extproc.sim listening on http://HOST:PORT ...` on stdout when ready, so a parent
process can wait for it, and shuts down cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from extproc.geometry.deployment import GpuDeployment, ModelGeometry
from extproc.sim.config import SimConfig
from extproc.sim.metrics import LegacyKvMetric
from extproc.sim.scheduler import Overflow, StepTiming
from extproc.sim.server import SimServer

log = logging.getLogger("extproc.sim")


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    g, m, t = d.gpu, d.geometry, d.timing
    p = argparse.ArgumentParser(
        prog="python -m extproc.sim",
        description="vLLM-like inference simulator: OpenAI API, paged KV cache, continuous batching, "
        "preemption, vLLM Prometheus metrics. Defaults model Llama-3-8B bf16 on one H100 80GB.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="address to listen on")
    s.add_argument("--port", type=int, default=d.port, help="TCP port (0 = pick a free port)")
    s.add_argument("--model", default=d.model, help="served model name (model_name label, /v1/models id)")
    s.add_argument(
        "--served-model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another served name of the model (vLLM's further --served-model-name values); repeatable",
    )
    s.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter of the model, listed at /v1/models with parent=--model; repeatable",
    )
    s.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")

    c = p.add_argument_group("KV cache and model geometry")
    c.add_argument(
        "--max-model-len", type=int, default=d.max_model_len, help="context length (prompt + output)"
    )
    c.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    c.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="number of KV blocks; overrides the value derived from geometry and GPU memory",
    )
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="share the KV blocks of identical prompt prefixes (vLLM's automatic prefix caching)",
    )
    c.add_argument("--num-layers", type=int, default=m.num_layers, help="transformer layers")
    c.add_argument("--num-kv-heads", type=int, default=m.num_kv_heads, help="KV (GQA) heads per layer")
    c.add_argument("--head-dim", type=int, default=m.head_dim, help="attention head dimension")
    c.add_argument(
        "--dtype-bytes", type=int, default=m.dtype_bytes, help="bytes per KV element (2 = bf16, 1 = fp8)"
    )
    c.add_argument(
        "--weights-gib", type=float, default=m.weights_gib, help="model weights in GiB (whole model)"
    )
    c.add_argument(
        "--gpu-memory-gib", type=float, default=g.gpu_memory_gib, help="total memory of one GPU in GiB"
    )
    c.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=g.gpu_memory_utilization,
        help="fraction of GPU memory vLLM may use (weights + activations + KV)",
    )
    c.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=g.tensor_parallel,
        help="GPUs sharing weights and KV heads",
    )
    c.add_argument(
        "--overhead-gib",
        type=float,
        default=g.overhead_gib,
        help="per-GPU activation peak, CUDA graphs and non-torch memory, in GiB",
    )

    b = p.add_argument_group("batching and overflow")
    b.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max running sequences per step")
    b.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget per step"
    )
    b.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=d.max_num_queued_reqs,
        help="vLLM's bound on unfinished requests (waiting + running): past it a request gets vLLM's 503 "
        "(default: unbounded)",
    )
    b.add_argument(
        "--missed-abort-every",
        type=int,
        default=d.missed_abort_every,
        help="miss every n-th client disconnect, decoding the answer on to its end as vLLM issue #54947 "
        "reports (default 0: abort every one)",
    )
    b.add_argument(
        "--overflow",
        choices=[o.value for o in Overflow],
        default=d.overflow.value,
        help="when a running sequence finds no free block: preempt the newest (vLLM) or crash the engine",
    )
    b.add_argument(
        "--oom-restart-seconds",
        type=float,
        default=d.oom_restart_seconds,
        help="engine seconds the engine stays down after an oom crash (divided by --time-scale in wall time)",
    )

    tm = p.add_argument_group("timing")
    tm.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="run the engine clock N times faster than wall time",
    )
    tm.add_argument(
        "--step-base-ms", type=float, default=t.base_s * 1e3, help="fixed cost of one engine step"
    )
    tm.add_argument(
        "--decode-per-seq-ms",
        type=float,
        default=t.per_seq_s * 1e3,
        help="extra step cost per scheduled sequence (decode slows as the batch grows)",
    )
    tm.add_argument(
        "--prefill-per-token-ms",
        type=float,
        default=t.per_prefill_token_s * 1e3,
        help="step cost per prompt token",
    )

    o = p.add_argument_group("outputs and metrics")
    o.add_argument(
        "--seed", type=int, default=d.seed, help="seed for generated text and drawn output lengths"
    )
    o.add_argument(
        "--output-len-median",
        type=float,
        default=d.output_len_median,
        help="median of the log-normal output length used when a request names no length",
    )
    o.add_argument(
        "--output-len-sigma",
        type=float,
        default=d.output_len_sigma,
        help="sigma of that log-normal (log space)",
    )
    o.add_argument(
        "--legacy-kv-metric",
        choices=[v.value for v in LegacyKvMetric],
        default=d.legacy_kv_metric.value,
        help="off: only vllm:kv_cache_usage_perc; also: add vllm:gpu_cache_usage_perc; "
        "instead: only vllm:gpu_cache_usage_perc (vLLM <= 0.8)",
    )
    o.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=d.enable_prompt_tokens_details,
        help="report usage.prompt_tokens_details.cached_tokens (prefix-cache hits), as vLLM's flag",
    )
    o.add_argument(
        "--encoding", default=d.encoding, help="tiktoken encoding for prompt and output token counts"
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        aliases=tuple(args.served_model_alias),
        lora_adapters=tuple(args.lora_adapter),
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        geometry=ModelGeometry(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype_bytes=args.dtype_bytes,
            weights_gib=args.weights_gib,
        ),
        gpu=GpuDeployment(
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel=args.tensor_parallel_size,
            overhead_gib=args.overhead_gib,
        ),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_queued_reqs=args.max_num_queued_reqs,
        missed_abort_every=args.missed_abort_every,
        timing=StepTiming(
            base_s=args.step_base_ms / 1e3,
            per_seq_s=args.decode_per_seq_ms / 1e3,
            per_prefill_token_s=args.prefill_per_token_ms / 1e3,
        ),
        time_scale=args.time_scale,
        overflow=Overflow(args.overflow),
        oom_restart_seconds=args.oom_restart_seconds,
        seed=args.seed,
        output_len_median=args.output_len_median,
        output_len_sigma=args.output_len_sigma,
        legacy_kv_metric=LegacyKvMetric(args.legacy_kv_metric),
        encoding=args.encoding,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )


async def serve(config: SimConfig) -> None:
    """Run until SIGTERM/SIGINT, then stop the server and the engine."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = SimServer(config)
    await server.start()
    print(
        f"extproc.sim listening on {server.url} model={config.model} "
        f"num_gpu_blocks={config.resolved_num_gpu_blocks()} block_size={config.block_size} "
        f"overflow={config.overflow.value} time_scale={config.time_scale:g}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"extproc.sim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # the port taken (a local stack's simulator already on 8000), or not ours to bind
        print(
            f"extproc.sim: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    return 0
