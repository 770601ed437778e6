"""The limit planner: from a model, a GPU and a traffic sample to the sidecar's limits, with the arithmetic.

Capacity comes from `extproc.geometry.capacity` (the simulator's own arithmetic). The suggestions:

- `max_concurrency`: how many typical requests fit in the KV budget. A typical request holds
  mean prompt + mean output tokens at its end, rounded up to whole blocks; `target_utilization` of the
  capacity divided by that footprint, capped at the engine's `max_num_seqs` (more slots than the engine
  runs only queue inside it);
- `tokens_per_minute`: what the engine can process per minute at that concurrency, from the step-timing
  model (`extproc.plan.timing`), rounded down to a thousand; the traffic's offered rate is shown beside it;
- `kv_budget`: enabled at `target_utilization` (needs the KV feed: the snippet names the shipped installs'
  exporter Service, `feedback.service`, the one their ConfigMaps already name, so merging it changes no
  feed; an engine's `/metrics` as a direct target only when `--metrics-url` asks for it);
- `adaptive`: the watermarks above the budget's target (`watermarks_above`: 0.92 / 0.98 at a target of
  0.9), as the sidecar defaults them beside a budget, so the scale acts only on KV the budget cannot see
  and `check-config` accepts the snippet without a warning;
- `store` (with `--replicas N` gateway replicas, N > 1): the limits are the fleet's, counted once in the
  shared store the shipped installs run (k8s/store), each replica falling back to 1 / N of them while it
  is away, so `check-config --replicas N` accepts the snippet.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from extproc.core.engine.adaptive import AdaptiveConfig, watermarks_above
from extproc.geometry.capacity import Capacity, footprint_tokens
from extproc.geometry.presets import GpuSpec
from extproc.plan.timing import requests_per_second, timing_for
from extproc.plan.traffic import TrafficSample
from extproc.sim.scheduler import StepTiming

DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_OUTPUT_TOKENS = 256
SHIPPED_FEED = "extproc-kv-exporter.extproc.svc:50061"
"""The exporter Service every shipped install's sidecar subscribes to (`feedback.service` of k8s/)."""
SHIPPED_STORE = "redis://extproc-store.extproc.svc:6379/0"
"""The store the shipped installs' replicas share (`store.redis.url` of k8s/, the Service of k8s/store)."""


@dataclass(frozen=True)
class TrafficProfile:
    """The lengths and rate the suggestions use, and where they came from."""

    source: str
    mean_prompt: float
    mean_output: float
    rate_rps: float | None = None
    requests: int | None = None
    p90_prompt: int | None = None
    p90_output: int | None = None

    @classmethod
    def from_sample(cls, sample: TrafficSample) -> TrafficProfile:
        return cls(
            source=sample.source,
            mean_prompt=sample.mean_prompt,
            mean_output=sample.mean_output,
            rate_rps=sample.rate_rps,
            requests=len(sample.requests),
            p90_prompt=sample.percentile("prompt_tokens", 0.9),
            p90_output=sample.percentile("output_tokens", 0.9),
        )

    @classmethod
    def assumed(cls) -> TrafficProfile:
        return cls(
            source=f"assumed (no traffic given): {DEFAULT_PROMPT_TOKENS} prompt + "
            f"{DEFAULT_OUTPUT_TOKENS} output tokens",
            mean_prompt=DEFAULT_PROMPT_TOKENS,
            mean_output=DEFAULT_OUTPUT_TOKENS,
        )


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan depends on besides the capacity itself."""

    capacity: Capacity
    gpu: GpuSpec
    traffic: TrafficProfile
    model_source: str
    served_model_name: str
    target_utilization: float = 0.9
    max_tokens: int = 1024
    # An engine's /metrics for the sidecar to scrape itself; None: the shipped exporter Service feeds it.
    metrics_url: str | None = None
    replicas: int = 1  # gateway (sidecar) replicas enforcing these limits together
    store_url: str = SHIPPED_STORE

    def validate(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError("--target-utilization: must be in (0, 1]")
        if self.replicas < 1:
            raise ValueError("--replicas: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("--max-tokens: must be >= 1")
        if not self.served_model_name:
            raise ValueError("--served-model-name: must not be empty")


@dataclass(frozen=True)
class Suggestions:
    footprint_tokens: int
    budget_tokens: int
    kv_concurrency: int
    max_concurrency: int
    timing: StepTiming
    engine_rps: float
    engine_tokens_per_minute: float
    offered_tokens_per_minute: float | None
    tokens_per_minute: int
    target_utilization: float
    high_watermark: float
    low_watermark: float

    @property
    def capped_by_max_num_seqs(self) -> bool:
        return self.max_concurrency < self.kv_concurrency


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    suggestions: Suggestions
    arithmetic: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def capacity(self) -> Capacity:
        return self.request.capacity

    def adaptive_config(self) -> AdaptiveConfig:
        s = self.suggestions
        return AdaptiveConfig(low_watermark=s.low_watermark, high_watermark=s.high_watermark)

    def config_snippet(self) -> dict[str, object]:
        """The sidecar's YAML (docs/configuration.md) for this pool; `extproc check-config --replicas N`
        accepts it. Merged into a shipped ConfigMap it changes neither the feed (the same `feedback.service`
        unless `--metrics-url` names an engine) nor, with N replicas, the store the ConfigMap names."""
        r, s, cap = self.request, self.suggestions, self.capacity
        name = r.served_model_name
        snippet: dict[str, object] = {
            "models": {name: {"context_window": cap.max_model_len, "default_max_tokens": r.max_tokens}},
            "limits": {
                "models": {
                    name: {"max_concurrency": s.max_concurrency, "tokens_per_minute": s.tokens_per_minute}
                }
            },
            "feedback": self._feed(),
            "kv_budget": {"enabled": True, "target_utilization": s.target_utilization},
            "adaptive": {
                "pools": {name: {"low_watermark": s.low_watermark, "high_watermark": s.high_watermark}}
            },
        }
        if r.replicas > 1:
            snippet["store"] = {
                "backend": "redis",
                "redis": {"url": r.store_url},
                "on_unavailable": "local",
                "fallback_share": fallback_share(r.replicas),
            }
        return snippet

    def _feed(self) -> dict[str, object]:
        """The KV feed the budget needs: the engine's /metrics scraped by the sidecar where `--metrics-url`
        names it, else the shipped exporter Service. Never a direct target nobody asked for: the default
        one, the gateway pod's own 127.0.0.1, merged beside a ConfigMap's `feedback.service`, scraped
        nothing and passed `check-config` silently."""
        r = self.request
        if r.metrics_url is None:
            return {"service": SHIPPED_FEED}
        return {"direct_targets": [{"url": r.metrics_url, "kind": "vllm", "model": r.served_model_name}]}


def fallback_share(replicas: int) -> float:
    """1 / replicas rounded down to 4 places: the replicas falling back together never admit more than the
    limits (0.3333 x 3 < 1)."""
    return int(10_000 / replicas) / 10_000


def _floor_to(value: float, quantum: int) -> int:
    return max(quantum, int(value // quantum) * quantum)


def suggest(request: PlanRequest) -> Suggestions:
    """The limits for one replica, from its capacity and the traffic's typical request."""
    request.validate()
    cap, traffic = request.capacity, request.traffic
    u = request.target_utilization
    typical = round(traffic.mean_prompt + traffic.mean_output)
    footprint = max(cap.block_size, footprint_tokens(cap.model, typical, cap.block_size))
    budget = int(cap.kv_cache_tokens * u)
    kv_concurrency = budget // footprint
    max_concurrency = max(1, min(kv_concurrency, cap.deployment.max_num_seqs))
    timing = timing_for(cap, request.gpu)
    rps = requests_per_second(timing, max_concurrency, traffic.mean_prompt, traffic.mean_output)
    tokens = traffic.mean_prompt + traffic.mean_output
    engine_tpm = 60.0 * rps * tokens
    offered = 60.0 * traffic.rate_rps * tokens if traffic.rate_rps is not None else None
    low, high = watermarks_above(u)
    return Suggestions(
        footprint_tokens=footprint,
        budget_tokens=budget,
        kv_concurrency=kv_concurrency,
        max_concurrency=max_concurrency,
        timing=timing,
        engine_rps=rps,
        engine_tokens_per_minute=engine_tpm,
        offered_tokens_per_minute=offered,
        tokens_per_minute=_floor_to(engine_tpm, 1000),
        target_utilization=u,
        high_watermark=high,
        low_watermark=low,
    )


def build_plan(request: PlanRequest) -> Plan:
    suggestions = suggest(request)
    return Plan(
        request=request,
        suggestions=suggestions,
        arithmetic=tuple(arithmetic_lines(request, suggestions)),
        notes=tuple(plan_notes(request, suggestions)),
    )


def _gib(value: float) -> str:
    return f"{value:,.3f} GiB"


def _line(label: str, text: str) -> str:
    return f"{label:<26}= {text}"


def arithmetic_lines(request: PlanRequest, s: Suggestions) -> list[str]:
    """Every number of the plan with the formula that produced it, in the order they depend."""
    cap, traffic = request.capacity, request.traffic
    spec, dep = cap.model, cap.deployment
    tp, pp = dep.tensor_parallel, dep.pipeline_parallel
    params = spec.param_count()
    lines = [
        _line("parameters", f"{params:,} ({params / 1e9:.2f} B)"),
        _line("weights", f"{params:,} x {spec.dtype_bytes} B = {spec.weights_gib():.2f} GiB"),
    ]
    if dep.overhead_gib is None:
        width = spec.mlp_activation_width()
        lines.append(
            _line(
                "activation peak",
                f"{dep.max_num_batched_tokens} batched tokens x (2 x {spec.hidden_size} + 3 x {width}"
                f" / TP {tp}) x {spec.dtype_bytes} B = {_gib(cap.activation_gib)}",
            )
        )
        lines.append(
            _line(
                "overhead per GPU",
                f"{_gib(cap.activation_gib)} + {cap.fixed_gib:g} GiB fixed (non-torch, sampler)"
                f" + {cap.cudagraph_gib:g} GiB CUDA graphs = {_gib(cap.overhead_gib)}",
            )
        )
    else:
        lines.append(_line("overhead per GPU", f"{_gib(cap.overhead_gib)} (given)"))
    for st in cap.stages:
        pre = f"stage {st.stage} " if pp > 1 else ""
        layers = f"layers {st.first_layer}-{st.end_layer - 1}: " if pp > 1 else ""
        lines += [
            _line(
                f"{pre}weights per GPU",
                f"{layers}{st.weights_gib:.2f} GiB / TP {tp} = {_gib(st.weights_per_gpu_gib)}",
            ),
            _line(
                f"{pre}KV memory per GPU",
                f"{dep.gpu_memory_gib:g} GiB x {dep.gpu_memory_utilization:g} - "
                f"{_gib(st.weights_per_gpu_gib)} - {_gib(st.overhead_gib)} = {_gib(st.kv_cache_gib_per_gpu)}",
            ),
            _line(f"{pre}KV bytes/token per GPU", _kv_formula(request, st.num_layers)),
            _line(
                f"{pre}num_gpu_blocks",
                f"floor({_gib(st.kv_cache_gib_per_gpu)} / ({dep.block_size} x "
                f"{st.kv_bytes_per_token_per_gpu:,} B)) = {st.num_gpu_blocks:,}",
            ),
        ]
    if pp > 1:
        lines.append(
            _line(
                "num_gpu_blocks",
                f"min over stages = {cap.num_gpu_blocks:,} (stage {cap.limiting_stage.stage})",
            )
        )
    step_ms = (s.timing.base_s + s.timing.per_seq_s * s.max_concurrency) * 1e3
    tokens = traffic.mean_prompt + traffic.mean_output
    lines += [
        _line(
            "kv_cache_tokens", f"{cap.num_gpu_blocks:,} blocks x {dep.block_size} = {cap.kv_cache_tokens:,}"
        ),
        _line(
            "typical request",
            f"{traffic.mean_prompt:,.0f} prompt + {traffic.mean_output:,.0f} output"
            f" -> {s.footprint_tokens:,} tokens in whole blocks",
        ),
        _line(
            "KV budget",
            f"{cap.kv_cache_tokens:,} x {s.target_utilization:g} = {s.budget_tokens:,} tokens",
        ),
        _line(
            "max_concurrency",
            f"min({s.budget_tokens:,} // {s.footprint_tokens:,} = {s.kv_concurrency:,},"
            f" max_num_seqs {dep.max_num_seqs}) = {s.max_concurrency}",
        ),
        _line(
            f"step time at {s.max_concurrency} running",
            f"{s.timing.base_s * 1e3:g} ms + {s.max_concurrency} x {s.timing.per_seq_s * 1e3:g} ms"
            f" = {step_ms:.2f} ms",
        ),
        _line(
            "engine rate",
            f"1 / ({traffic.mean_output:,.0f} x {step_ms:.2f} ms / {s.max_concurrency} + "
            f"{traffic.mean_prompt:,.0f} x {s.timing.per_prefill_token_s * 1e3:g} ms)"
            f" = {s.engine_rps:,.2f} req/s",
        ),
        _line(
            "tokens_per_minute",
            f"60 x {s.engine_rps:,.2f} x {tokens:,.0f} = {s.engine_tokens_per_minute:,.0f}"
            f" -> {s.tokens_per_minute:,}",
        ),
    ]
    reserved = _in_flight_reservation(request, s)
    lines.append(
        _line(
            "reserved in flight",
            f"{s.max_concurrency} x ({traffic.mean_prompt:,.0f} + {request.max_tokens} max_tokens)"
            f" = {reserved:,.0f} tokens held in the TPM bucket until settlement",
        )
    )
    if s.offered_tokens_per_minute is not None and traffic.rate_rps is not None:
        share = s.offered_tokens_per_minute / s.engine_tokens_per_minute
        lines.append(
            _line(
                "offered by the traffic",
                f"60 x {traffic.rate_rps:,.2f} req/s x {tokens:,.0f} = "
                f"{s.offered_tokens_per_minute:,.0f} tokens/min ({share:.0%} of the engine)",
            )
        )
    lines.append(
        _line(
            "adaptive watermarks",
            f"low {s.low_watermark:g}, high {s.high_watermark:g}: above the KV budget's target "
            f"{s.target_utilization:g}, so the scale acts only on KV the budget cannot see",
        )
    )
    return lines


def _kv_formula(request: PlanRequest, layers: int) -> str:
    cap = request.capacity
    spec, tp = cap.model, cap.deployment.tensor_parallel
    if spec.mla is not None:
        value = layers * spec.mla.latent_dim * cap.kv_dtype_bytes
        return (
            f"{layers} layers x ({spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}) latent x "
            f"{cap.kv_dtype_bytes} B = {value:,} (MLA: not split by TP)"
        )
    heads = max(1, spec.num_kv_heads // tp)
    value = 2 * layers * heads * spec.head_dim * cap.kv_dtype_bytes
    return (
        f"2 x {layers} layers x ({spec.num_kv_heads} KV heads / TP {tp} = {heads}) x {spec.head_dim} x "
        f"{cap.kv_dtype_bytes} B = {value:,}"
    )


def _in_flight_reservation(request: PlanRequest, s: Suggestions) -> float:
    """Tokens the sidecar reserves for `max_concurrency` requests before they settle to real usage."""
    return s.max_concurrency * (request.traffic.mean_prompt + request.max_tokens)


def plan_notes(request: PlanRequest, s: Suggestions) -> list[str]:
    """What the reader must know to trust (or not) the numbers."""
    cap = request.capacity
    notes = []
    if not cap.fits_max_model_len:
        notes.append(
            f"KV capacity {cap.kv_cache_tokens:,} tokens is below max_model_len {cap.max_model_len:,}: "
            "vLLM refuses to start; lower --max-model-len or add GPUs"
        )
    if cap.model.quantized and cap.deployment.weights_gib is None:
        notes.append(
            "the config has quantization_config: weights are not dtype x parameters; pass --weights-gib"
        )
    if cap.model.num_sliding_layers:
        notes.append(
            f"{cap.model.num_sliding_layers} sliding-window layers (window {cap.model.sliding_window}): "
            "capacity counts them at every token, the typical footprint caps them at the window"
        )
    if s.capped_by_max_num_seqs:
        notes.append(
            f"KV would hold {s.kv_concurrency} typical requests; max_concurrency stops at max_num_seqs "
            f"{cap.deployment.max_num_seqs} (raise --max-num-seqs if the engine runs more)"
        )
    reserved = _in_flight_reservation(request, s)
    if reserved > s.tokens_per_minute:
        notes.append(
            f"{s.max_concurrency} requests reserve {reserved:,.0f} tokens before settling, more than the "
            f"{s.tokens_per_minute:,} bucket: the TPM limit will bind before max_concurrency"
        )
    if request.traffic.rate_rps is None:
        notes.append("no request rate: tokens_per_minute is the engine's estimated capacity only")
    notes += _fleet_notes(request)
    notes.append(
        "overhead and step timing are models (docs/planning.md gives their error against vLLM logs); "
        "check num_gpu_blocks against vllm:cache_config_info after the first start"
    )
    return notes


def _fleet_notes(request: PlanRequest) -> list[str]:
    """What the snippet assumes about the gateway replicas and the feed."""
    notes = []
    if request.replicas > 1:
        share = fallback_share(request.replicas)
        notes.append(
            f"the limits are fleet-wide: the {request.replicas} gateway replicas count every request once in "
            f"the shared store (store.backend: redis, {request.store_url}); while it cannot be reached each "
            f"replica admits on fallback_share {share:g} (1 / {request.replicas}) of every limit"
        )
    url = request.metrics_url
    if url is not None and _loopback(urlsplit(url).hostname or ""):
        notes.append(
            f"--metrics-url {url} is the sidecar's own host: in a gateway pod that is the pod itself, not "
            "the engine; give the engine's Service, or leave it out for the exporter (feedback.service)"
        )
    return notes


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
