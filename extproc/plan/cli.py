"""`extproc plan`: size a deployment and its sidecar limits before it exists (docs/planning.md)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.geometry.capacity import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DeploymentSpec,
    plan_capacity,
)
from extproc.geometry.deployment import DEFAULT_BLOCK_SIZE
from extproc.geometry.model import KV_CACHE_DTYPE_BYTES, ModelConfigError, ModelSpec, load_model_config
from extproc.geometry.presets import GPU_PRESETS, MODEL_PRESETS, GpuSpec, model_preset
from extproc.plan.traffic import TrafficError, TrafficSample, load_trace, synthetic_sample

if TYPE_CHECKING:
    from extproc.plan.planner import Plan, TrafficProfile
    from extproc.plan.render import Rehearsal

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_GPU = "h100-80gb"


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help, once. argparse's ArgumentDefaultsHelpFormatter appends it to
    every option: after a help that already names the default ("default: model name (default: None)"), and
    as "(default: None)" or "(default: False)" for an option that is simply off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="size a deployment (KV capacity) and suggest the sidecar's limits",
        description="Size a vLLM deployment from a model config and a GPU, suggest the sidecar's limits "
        "with the arithmetic shown, and optionally rehearse them on the simulator (docs/planning.md).",
        formatter_class=DefaultsOnceFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-config",
        metavar="PATH|PRESET",
        default=None,
        help=f"a Hugging Face config.json, or a preset name (default, without --model: {DEFAULT_MODEL})",
    )
    m.add_argument(
        "--model", metavar="PRESET", default=None, help="a preset name (same as --model-config NAME)"
    )
    m.add_argument("--served-model-name", default=None, help="model name clients send (default: model name)")
    m.add_argument("--weights-gib", type=float, default=None, help="whole-model weights (quantized models)")
    m.add_argument("--list-presets", action="store_true", help="list built-in models and GPUs, then exit")
    d = p.add_argument_group("deployment (vllm serve flags)")
    d.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPU_PRESETS), help="GPU preset")
    d.add_argument("--gpu-memory-gib", type=float, default=None, help="total GPU memory as vLLM sees it")
    d.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth (TB/s) for step timing")
    d.add_argument("--bf16-tflops", type=float, default=None, help="dense bf16 TFLOPS for step timing")
    d.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per stage sharing each layer")
    d.add_argument("--pipeline-parallel", type=int, default=1, help="stages the layers are split into")
    d.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction vLLM may use")
    d.add_argument("--max-model-len", type=int, default=None, help="default: max_position_embeddings")
    d.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    d.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPE_BYTES], help="auto: model dtype"
    )
    d.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="sequences per step")
    d.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS, help="tokens per step"
    )
    d.add_argument("--overhead-gib", type=float, default=None, help="replace the overhead model per GPU")
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--traffic", type=Path, default=None, help="Azure-format trace CSV (a sample: bench/traces/)"
    )
    t.add_argument("--traffic-limit", type=int, default=None, help="use the first N requests")
    t.add_argument("--traffic-window", type=float, default=None, help="use the first S seconds")
    t.add_argument(
        "--traffic-speedup", type=float, default=1.0, help="compress arrivals (2 = twice the rate)"
    )
    t.add_argument("--prompt-tokens-mean", type=float, default=None, help="instead of a trace")
    t.add_argument("--output-tokens-mean", type=float, default=None, help="instead of a trace")
    t.add_argument("--request-rate", type=float, default=None, help="requests per second")
    t.add_argument("--synthetic-requests", type=int, default=1000, help="rehearsal size without a trace")
    s = p.add_argument_group("limits and output")
    s.add_argument("--target-utilization", type=float, default=0.9, help="KV budget target")
    s.add_argument("--max-tokens", type=int, default=1024, help="completion allowance per request")
    s.add_argument("--rehearse", action="store_true", help="replay the traffic through the planned limits")
    s.add_argument("--output", choices=["text", "yaml", "json"], default="text", help="report format")
    _add_gateway_options(p)


def _add_gateway_options(p: argparse.ArgumentParser) -> None:
    """What the snippet says about the gateway running the limits: its feed and its replicas' store."""
    g = p.add_argument_group("gateway (the snippet's feed and store)")
    g.add_argument(
        "--metrics-url",
        default=None,
        help="an engine's /metrics for the sidecar to scrape itself (feedback.direct_targets); "
        "default: the shipped exporter Service (feedback.service)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="gateway (sidecar) replicas enforcing the limits together: above 1 the snippet shares them "
        "through a store",
    )
    g.add_argument(
        "--store-url",
        default=None,
        help="with --replicas above 1, the store the replicas share (default: the shipped k8s/store Service)",
    )


def _model(args: argparse.Namespace) -> tuple[ModelSpec, str]:
    choice = args.model or args.model_config or DEFAULT_MODEL
    if choice in MODEL_PRESETS:
        return model_preset(choice), MODEL_PRESETS[choice][0]
    if args.model is not None:
        model_preset(choice)  # raises with the list of presets
    path = Path(choice)
    if not path.exists():
        raise ModelConfigError(
            f"--model-config: {choice!r} is neither a file nor a preset ({', '.join(sorted(MODEL_PRESETS))})"
        )
    return load_model_config(path), str(path)


def _gpu(args: argparse.Namespace) -> GpuSpec:
    gpu = GPU_PRESETS[args.gpu]
    if args.gpu_memory_gib is not None:
        name = f"{args.gpu_memory_gib:g}-GiB GPU ({gpu.name} rates)"
        gpu = replace(gpu, name=name, memory_gib=args.gpu_memory_gib)
    if args.hbm_tbps is not None:
        gpu = replace(gpu, hbm_tb_per_s=args.hbm_tbps)
    if args.bf16_tflops is not None:
        gpu = replace(gpu, bf16_dense_tflops=args.bf16_tflops)
    if gpu.hbm_tb_per_s <= 0 or gpu.bf16_dense_tflops <= 0:
        raise ValueError("--hbm-tbps and --bf16-tflops: must be positive")
    return gpu


def _traffic(args: argparse.Namespace) -> TrafficSample | None:
    if args.traffic is not None:
        return load_trace(args.traffic, args.traffic_limit, args.traffic_window, args.traffic_speedup)
    prompt, output, rate = args.prompt_tokens_mean, args.output_tokens_mean, args.request_rate
    if prompt is not None and output is not None and rate is not None:
        return synthetic_sample(prompt, output, rate, count=args.synthetic_requests)
    return None


def _profile(args: argparse.Namespace, sample: TrafficSample | None) -> TrafficProfile:
    from extproc.plan.planner import TrafficProfile

    if sample is not None and args.traffic is not None:
        return TrafficProfile.from_sample(sample)
    if args.prompt_tokens_mean is not None and args.output_tokens_mean is not None:
        return TrafficProfile(
            source="given means" + ("" if args.request_rate is None else " and rate"),
            mean_prompt=args.prompt_tokens_mean,
            mean_output=args.output_tokens_mean,
            rate_rps=args.request_rate,
        )
    if any(v is not None for v in (args.prompt_tokens_mean, args.output_tokens_mean)):
        raise TrafficError("--prompt-tokens-mean and --output-tokens-mean go together")
    return TrafficProfile.assumed()


def build_from_args(args: argparse.Namespace) -> tuple[Plan, TrafficSample | None]:
    from extproc.plan.planner import SHIPPED_STORE, PlanRequest, build_plan

    spec, source = _model(args)
    gpu = _gpu(args)
    deployment = DeploymentSpec(
        gpu_memory_gib=gpu.memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        overhead_gib=args.overhead_gib,
        weights_gib=args.weights_gib,
    )
    sample = _traffic(args)
    request = PlanRequest(
        capacity=plan_capacity(spec, deployment),
        gpu=gpu,
        traffic=_profile(args, sample),
        model_source=source,
        served_model_name=args.served_model_name or spec.name,
        target_utilization=args.target_utilization,
        max_tokens=args.max_tokens,
        metrics_url=args.metrics_url,
        replicas=args.replicas,
        store_url=args.store_url or SHIPPED_STORE,
    )
    return build_plan(request), sample


def run_rehearsal(plan: Plan, sample: TrafficSample) -> Rehearsal:
    """Replay the sample twice: through the planned limits, and with no sidecar at all."""
    from extproc.plan.rehearse import EngineSetup, RehearsalLimits, rehearse
    from extproc.plan.render import Rehearsal

    cap, s = plan.capacity, plan.suggestions
    engine = EngineSetup(
        num_gpu_blocks=cap.num_gpu_blocks,
        block_size=cap.block_size,
        max_model_len=cap.max_model_len,
        max_num_seqs=cap.deployment.max_num_seqs,
        max_num_batched_tokens=cap.deployment.max_num_batched_tokens,
        timing=s.timing,
    )
    limits = RehearsalLimits(
        model=plan.request.served_model_name,
        max_tokens=plan.request.max_tokens,
        max_concurrency=s.max_concurrency,
        tokens_per_minute=s.tokens_per_minute,
        kv_target_utilization=s.target_utilization,
        adaptive=plan.adaptive_config(),
    )
    return Rehearsal(
        traffic=sample.source,
        requests=len(sample.requests),
        with_limits=rehearse(sample.requests, engine, limits),
        without_limits=rehearse(sample.requests, engine, None),
    )


def _list_presets() -> str:
    lines = ["models:"]
    lines += [f"  {name:18} {source}" for name, (source, _) in MODEL_PRESETS.items()]
    lines.append("gpus:")
    lines += [
        f"  {g.name:18} {g.memory_gib:g} GiB, {g.hbm_tb_per_s:g} TB/s, {g.bf16_dense_tflops:g} TFLOPS"
        for g in GPU_PRESETS.values()
    ]
    return "\n".join(lines) + "\n"


def run_plan(args: argparse.Namespace) -> int:
    """The subcommand. The planner and the simulator's scheduler are imported here, not at start-up, so
    `extproc serve` does not pay for them."""
    from extproc.plan.render import plan_dict, render_json, render_text, render_yaml

    if args.list_presets:
        sys.stdout.write(_list_presets())
        return 0
    try:
        plan, sample = build_from_args(args)
        rehearsal = None
        if args.rehearse:
            if sample is None:
                raise TrafficError(
                    "--rehearse needs --traffic CSV, or --prompt-tokens-mean, --output-tokens-mean "
                    "and --request-rate"
                )
            rehearsal = run_rehearsal(plan, sample)
    except (ModelConfigError, TrafficError, ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"extproc plan: {message}", file=sys.stderr)
        return 2
    data = plan_dict(plan, rehearsal)
    if args.output == "json":
        sys.stdout.write(render_json(data))
    elif args.output == "yaml":
        sys.stdout.write(render_yaml(data))
    else:
        sys.stdout.write(render_text(plan, data))
    return 0
