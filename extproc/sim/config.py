"""Every simulator knob in one dataclass, with defaults describing a real Llama-3-8B / H100 deployment.

The CLI maps flags one to one onto these fields and the programmatic entry takes the dataclass, so tests,
benchmarks and `python -m extproc.sim` all configure the simulator the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.admission.vocabulary.tokens import DEFAULT_ENCODING
from extproc.geometry.deployment import (
    DEFAULT_BLOCK_SIZE,
    GpuDeployment,
    ModelGeometry,
    derive_num_gpu_blocks,
)
from extproc.sim.metrics import LegacyKvMetric
from extproc.sim.scheduler import Overflow, SchedulerConfig, StepTiming


@dataclass(frozen=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "llama-3-8b"
    # More `--served-model-name` values (vLLM serves every name; its metrics carry the first, `model`) and
    # LoRA adapters (`--lora-modules name=path`) of the base model: all listed at /v1/models and accepted.
    aliases: tuple[str, ...] = ()
    lora_adapters: tuple[str, ...] = ()
    max_model_len: int = 8192
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int | None = None  # None: derive from geometry
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    gpu: GpuDeployment = field(default_factory=GpuDeployment)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    timing: StepTiming = field(default_factory=StepTiming)
    time_scale: float = 1.0
    overflow: Overflow = Overflow.PREEMPT
    oom_restart_seconds: float = 30.0
    seed: int = 0
    output_len_median: float = 128.0
    output_len_sigma: float = 1.0
    legacy_kv_metric: LegacyKvMetric = LegacyKvMetric.OFF
    encoding: str = DEFAULT_ENCODING
    # vLLM's automatic prefix caching, on by default (config/cache.py `enable_prefix_caching`).
    enable_prefix_caching: bool = True
    # vLLM's --max-num-queued-reqs (config/scheduler.py): past this many unfinished sequences a new request
    # is answered 503 before the scheduler sees it. None: unbounded, vLLM's default.
    max_num_queued_reqs: int | None = None
    # vLLM's --enable-prompt-tokens-details (entrypoints/launchers/cli_args.py): usage carries
    # `prompt_tokens_details.cached_tokens`, the prompt tokens its prefix cache hit. Off by default, as vLLM.
    enable_prompt_tokens_details: bool = False
    # vLLM issue #54947: an engine that misses a client's disconnect decodes the answer on to its end. Every
    # n-th disconnect is missed here (0: none, vLLM's intended behaviour), so the gateway's charges can be
    # tested against an engine that runs on after its client left.
    missed_abort_every: int = 0

    def served_name(self, body: object) -> str:
        """The request's `model` when this server serves it (base name, alias, adapter), else `model`, so
        that the parsers' check answers a name it does not serve with vLLM's 404."""
        requested = body.get("model") if isinstance(body, dict) else None
        if requested in (*self.aliases, *self.lora_adapters):
            return str(requested)
        return self.model

    def cache_namespace(self, served_name: str) -> str:
        """Whose cached blocks a request may hit: an adapter's own (vLLM hashes the LoRA adapter into every
        block), otherwise the base model's, whichever served alias the request named."""
        return served_name if served_name in self.lora_adapters else self.model

    def resolved_num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return derive_num_gpu_blocks(self.geometry, self.gpu, self.block_size)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            overflow=self.overflow,
        )

    def cache_info(self) -> dict[str, str]:
        """Labels of `vllm:cache_config_info`, a subset of vLLM 0.33's CacheConfig.metrics_info().

        `kv_cache_size_tokens` and `kv_cache_max_concurrency` follow vLLM 0.33's get_kv_cache_capacity for
        a full-attention model: a request at max_model_len takes ceil(max_model_len / block_size) blocks.
        """
        blocks = self.resolved_num_gpu_blocks()
        concurrency = blocks / -(-self.max_model_len // self.block_size)
        return {
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu.gpu_memory_utilization),
            "num_gpu_blocks": str(blocks),
            "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(int(concurrency * self.max_model_len)),
            "kv_cache_max_concurrency": str(concurrency),
        }

    def validate(self) -> None:
        """Refuse configurations vLLM would refuse, before any request meets them."""
        blocks = self.resolved_num_gpu_blocks()
        if blocks <= 0:
            raise ValueError("no memory left for the KV cache: lower weights/overhead or raise GPU memory")
        if blocks * self.block_size < self.max_model_len:
            # vLLM: "The model's max seq len is larger than the maximum number of tokens that can be
            # stored in KV cache". One full-length sequence must fit, or preemption could loop forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds KV capacity "
                f"{blocks * self.block_size} tokens ({blocks} blocks of {self.block_size})"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError("max_num_queued_reqs must be >= 0")  # vLLM: Field(ge=0)
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.missed_abort_every < 0:
            raise ValueError("missed_abort_every must be >= 0")
