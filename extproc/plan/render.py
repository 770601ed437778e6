"""Plan output: one dictionary (for `--output json|yaml`) and a text report with the arithmetic."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from extproc.plan.planner import Plan
from extproc.plan.rehearse import RehearsalResult


@dataclass(frozen=True)
class Rehearsal:
    """Both runs of a rehearsal over the same sample."""

    traffic: str
    requests: int
    with_limits: RehearsalResult
    without_limits: RehearsalResult

    def to_dict(self) -> dict[str, Any]:
        return {
            "traffic": self.traffic,
            "requests": self.requests,
            "with_limits": self.with_limits.to_dict(),
            "without_limits": self.without_limits.to_dict(),
        }


def _model(plan: Plan) -> dict[str, Any]:
    spec = plan.capacity.model
    out: dict[str, Any] = {
        "name": spec.name,
        "source": plan.request.model_source,
        "model_type": spec.model_type,
        "parameters": spec.param_count(),
        "dtype": spec.dtype,
        "weights_gib": spec.weights_gib(),
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
    }
    if spec.moe is not None:
        out["moe"] = {
            "experts": spec.moe.num_experts,
            "experts_per_token": spec.moe.experts_per_token,
            "expert_intermediate_size": spec.moe.expert_intermediate_size,
            "moe_layers": sum(spec.moe_layers),
            "active_parameters": spec.active_param_count(),
        }
    if spec.mla is not None:
        out["mla"] = {"kv_lora_rank": spec.mla.kv_lora_rank, "qk_rope_head_dim": spec.mla.qk_rope_head_dim}
    if spec.num_sliding_layers:
        out["sliding_window"] = {"window": spec.sliding_window, "layers": spec.num_sliding_layers}
    return out


def plan_dict(plan: Plan, rehearsal: Rehearsal | None = None) -> dict[str, Any]:
    """Everything the plan computed; the issue's output keys sit at the top level."""
    cap, s, r = plan.capacity, plan.suggestions, plan.request
    dep = cap.deployment
    limiting = cap.limiting_stage
    out: dict[str, Any] = {
        "weights_per_gpu_gib": round(max(st.weights_per_gpu_gib for st in cap.stages), 3),
        "kv_bytes_per_token": limiting.kv_bytes_per_token_per_gpu,
        "kv_bytes_per_token_all_gpus": cap.kv_bytes_per_token,
        "num_gpu_blocks": cap.num_gpu_blocks,
        "kv_cache_tokens": cap.kv_cache_tokens,
        "max_concurrency": s.max_concurrency,
        "tokens_per_minute": s.tokens_per_minute,
        "kv_budget": {"enabled": True, "target_utilization": s.target_utilization},
        "adaptive": {"low_watermark": s.low_watermark, "high_watermark": s.high_watermark},
        "model": _model(plan),
        "deployment": {
            "gpu": r.gpu.name,
            "gpu_memory_gib": dep.gpu_memory_gib,
            "gpu_memory_utilization": dep.gpu_memory_utilization,
            "tensor_parallel": dep.tensor_parallel,
            "pipeline_parallel": dep.pipeline_parallel,
            "gpus": cap.num_gpus,
            "block_size": dep.block_size,
            "kv_cache_dtype": dep.kv_cache_dtype,
            "max_model_len": cap.max_model_len,
            "max_num_batched_tokens": dep.max_num_batched_tokens,
            "max_num_seqs": dep.max_num_seqs,
        },
        "memory": {
            "overhead_gib": {
                "activation": round(cap.activation_gib, 3),
                "fixed": round(cap.fixed_gib, 3),
                "cuda_graphs": round(cap.cudagraph_gib, 3),
                "total": round(cap.overhead_gib, 3),
            },
            "stages": [
                {
                    "stage": st.stage,
                    "layers": [st.first_layer, st.end_layer],
                    "weights_gib": st.weights_gib,
                    "weights_per_gpu_gib": round(st.weights_per_gpu_gib, 3),
                    "kv_cache_gib_per_gpu": round(st.kv_cache_gib_per_gpu, 3),
                    "kv_bytes_per_token_per_gpu": st.kv_bytes_per_token_per_gpu,
                    "num_gpu_blocks": st.num_gpu_blocks,
                }
                for st in cap.stages
            ],
            "max_model_len_concurrency": round(cap.max_model_len_concurrency, 2),
        },
        "traffic": {
            "source": r.traffic.source,
            "requests": r.traffic.requests,
            "mean_prompt_tokens": round(r.traffic.mean_prompt, 1),
            "mean_output_tokens": round(r.traffic.mean_output, 1),
            "p90_prompt_tokens": r.traffic.p90_prompt,
            "p90_output_tokens": r.traffic.p90_output,
            "rate_rps": None if r.traffic.rate_rps is None else round(r.traffic.rate_rps, 3),
        },
        "estimates": {
            "footprint_tokens": s.footprint_tokens,
            "kv_concurrency": s.kv_concurrency,
            "engine_requests_per_s": round(s.engine_rps, 3),
            "engine_tokens_per_minute": round(s.engine_tokens_per_minute),
            "offered_tokens_per_minute": None
            if s.offered_tokens_per_minute is None
            else round(s.offered_tokens_per_minute),
            "step_timing_ms": {
                "base": round(s.timing.base_s * 1e3, 4),
                "per_seq": round(s.timing.per_seq_s * 1e3, 4),
                "per_prefill_token": round(s.timing.per_prefill_token_s * 1e3, 5),
            },
        },
        "arithmetic": list(plan.arithmetic),
        "notes": list(plan.notes),
        "config": plan.config_snippet(),
    }
    if rehearsal is not None:
        out["rehearsal"] = rehearsal.to_dict()
    return out


def render_json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def render_yaml(data: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(data), sort_keys=False, width=120)


def render_text(plan: Plan, data: Mapping[str, Any]) -> str:
    """A report for people: headline numbers, the suggestions, every step of arithmetic, the snippet."""
    cap, s, r = plan.capacity, plan.suggestions, plan.request
    dep = cap.deployment
    lines = [
        f"extproc plan: {cap.model.name} on {cap.num_gpus} x {r.gpu.name} "
        f"({dep.gpu_memory_gib:g} GiB, utilization {dep.gpu_memory_utilization:g}, "
        f"TP {dep.tensor_parallel}, PP {dep.pipeline_parallel})",
        "",
        "Capacity",
        f"  weights per GPU        {data['weights_per_gpu_gib']:.3f} GiB",
        f"  KV bytes per token     {data['kv_bytes_per_token']:,} per GPU "
        f"({data['kv_bytes_per_token_all_gpus']:,} across the replica)",
        f"  num_gpu_blocks         {cap.num_gpu_blocks:,} (block_size {dep.block_size})",
        f"  kv_cache_tokens        {cap.kv_cache_tokens:,}",
        f"  at max_model_len {cap.max_model_len:,}: {cap.max_model_len_concurrency:.2f}x concurrency",
        "",
        f"Suggested limits (traffic: {r.traffic.source})",
        *_fleet_line(plan),
        f"  max_concurrency        {s.max_concurrency}",
        f"  tokens_per_minute      {s.tokens_per_minute:,}",
        f"  kv_budget              enabled, target_utilization {s.target_utilization:g}",
        f"  adaptive               low_watermark {s.low_watermark:g}, high_watermark {s.high_watermark:g}",
        "",
        "Arithmetic",
        *(f"  {line}" for line in plan.arithmetic),
    ]
    rehearsal = data.get("rehearsal")
    if isinstance(rehearsal, Mapping):
        lines += ["", f"Rehearsal ({rehearsal['requests']} requests from {rehearsal['traffic']})"]
        lines += _rehearsal_table(rehearsal["with_limits"], rehearsal["without_limits"])
    lines += ["", "Notes", *(f"  - {note}" for note in plan.notes)]
    lines += ["", "Sidecar config (ConfigMap config.yaml)", ""]
    lines += ["  " + line for line in render_yaml(plan.config_snippet()).splitlines()]
    return "\n".join(lines) + "\n"


def _fleet_line(plan: Plan) -> list[str]:
    """Whose limits these are, where several gateway replicas enforce them."""
    replicas = plan.request.replicas
    if replicas == 1:
        return []
    return [f"  fleet-wide: one set for all {replicas} gateway replicas, shared through the snippet's store"]


_REHEARSAL_ROWS = (
    ("admitted", "admitted"),
    ("completed", "completed"),
    ("rejections", "rejections"),
    ("preemptions", "preemptions"),
    ("goodput (output tok/s)", "goodput_output_tokens_per_s"),
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("TTFT p99 (s)", "ttft_p99_s"),
    ("e2e p99 (s)", "e2e_p99_s"),
    ("peak KV usage", "peak_kv_usage"),
    ("duration (s)", "duration_s"),
)


def _rehearsal_table(with_limits: Mapping[str, Any], without: Mapping[str, Any]) -> list[str]:
    rows = [f"  {'':24}{'planned limits':>16}{'no limits':>14}"]
    for label, key in _REHEARSAL_ROWS:
        rows.append(f"  {label:24}{_cell(with_limits.get(key)):>16}{_cell(without.get(key)):>14}")
    reasons = with_limits.get("rejected_by_reason") or {}
    if reasons:
        rows.append("  rejected by reason: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if value < 100 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
