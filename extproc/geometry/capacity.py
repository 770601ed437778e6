"""KV capacity of a whole deployment (tensor and pipeline parallel) from a model spec and a GPU.

vLLM sizes the KV cache per worker (`Worker.determine_available_memory`,
vllm/v1/worker/gpu_worker.py @ 35d5cda123ec28581759b6d34cde8052314fb1e6):

    available = total_memory * gpu_memory_utilization
                - (weights + torch activation peak of the profile run + non-torch increase)

where the profile run is a forward pass over `max_num_batched_tokens` dummy tokens
(`memory_profiling`, vllm/utils/mem_utils.py @ a6d5c39009eb73797b276cc557ca9659c396ca14). Blocks are
`available // page_size // num_layers` (`get_num_blocks`, vllm/v1/core/kv_cache_utils.py
@ bbf906a88ba1a39104884c88c9811a4f968e4659) and every worker then uses the smallest block count among
all workers (`unify_kv_cache_configs`, same file), so with pipeline parallelism the stage with the least
room per layer decides. Layers are split across stages by `get_pp_indices` (vllm/distributed/utils.py
@ 5a6541db9bfa77756459722f69e8c89a0b47a14d): an even split, the remainder given one each to the stages
before the last.

The overhead term (activation peak + non-torch memory + CUDA graphs if reserved) is measured by vLLM at
start-up; here it is a model with stated constants (`OverheadModel`), and
docs/internals/planner-memory-model.md gives its error against published start-up logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.geometry.deployment import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    GpuDeployment,
    ModelGeometry,
    derive_num_gpu_blocks,
    kv_cache_bytes_per_gpu,
)
from extproc.geometry.model import KV_CACHE_DTYPE_BYTES, ModelSpec

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's default token budget per step for the OpenAI server on GPUs with >= 70 GiB other than A100."""

DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class OverheadModel:
    """Per-GPU memory vLLM reserves beyond weights and KV cache, as a model with explicit constants.

    activation peak = max_num_batched_tokens x (2 x hidden + 3 x MLP width / TP) x activation bytes:
    the profile run's forward pass over `max_num_batched_tokens` dummy tokens peaks inside the MLP,
    where the hidden states and the residual (2 x hidden per token) live beside the gate/up output
    (2 x width / TP) and the activated product (width / TP). For MoE layers the width is the routed
    experts a token visits plus the shared experts. `fixed_gib` covers what does not scale with the
    batch: non-torch allocations (cuBLAS and attention workspaces), the sampler's logits buffers for
    `max_num_seqs` rows. `cudagraph_gib` is 0 because vLLM captures CUDA graphs after the KV cache is
    sized unless its CUDA-graph estimate is enabled (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`); set it
    when your version reserves it.

    `fixed_gib` is calibrated so that Llama-3-8B at 8,192 batched tokens gets 0.78125 + 1.71875 =
    2.5 GiB, the simulator's default overhead; published logs put that term between 0.5 and 2.3 GiB
    (docs/internals/planner-memory-model.md has the table).
    """

    fixed_gib: float = 1.71875
    cudagraph_gib: float = 0.0

    def activation_gib(self, spec: ModelSpec, max_num_batched_tokens: int, tensor_parallel: int = 1) -> float:
        width = 2 * spec.hidden_size + 3 * spec.mlp_activation_width() / max(1, tensor_parallel)
        return max_num_batched_tokens * width * spec.dtype_bytes / GIB

    def total_gib(self, spec: ModelSpec, max_num_batched_tokens: int, tensor_parallel: int = 1) -> float:
        activation = self.activation_gib(spec, max_num_batched_tokens, tensor_parallel)
        return activation + self.fixed_gib + self.cudagraph_gib


@dataclass(frozen=True)
class DeploymentSpec:
    """One replica as it would be started: `vllm serve` flags that change the KV cache."""

    gpu_memory_gib: float = 79.19
    gpu_memory_utilization: float = 0.9
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings, as vLLM defaults
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    overhead_gib: float | None = None  # None: OverheadModel
    weights_gib: float | None = None  # None: parameters x dtype bytes
    overhead_model: OverheadModel = field(default_factory=OverheadModel)

    def validate(self) -> None:
        """Refuse values vLLM would refuse, naming the flag."""
        if self.gpu_memory_gib <= 0:
            raise ValueError("--gpu-memory-gib: must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization: must be in (0, 1]")
        for flag, value in (
            ("--tensor-parallel", self.tensor_parallel),
            ("--pipeline-parallel", self.pipeline_parallel),
            ("--block-size", self.block_size),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
        ):
            if value < 1:
                raise ValueError(f"{flag}: must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len: must be >= 1, got {self.max_model_len}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            allowed = ", ".join(["auto", *KV_CACHE_DTYPE_BYTES])
            raise ValueError(f"--kv-cache-dtype: {self.kv_cache_dtype!r} is not one of {allowed}")
        if self.overhead_gib is not None and self.overhead_gib < 0:
            raise ValueError("--overhead-gib: must be >= 0")
        if self.weights_gib is not None and self.weights_gib <= 0:
            raise ValueError("--weights-gib: must be positive")


@dataclass(frozen=True)
class StageCapacity:
    """One pipeline stage (all its tensor-parallel ranks are alike)."""

    stage: int
    first_layer: int
    end_layer: int
    weights_gib: float  # the stage's weights before the tensor-parallel split
    weights_per_gpu_gib: float
    overhead_gib: float
    kv_cache_gib_per_gpu: float
    kv_bytes_per_token_per_gpu: int
    num_gpu_blocks: int

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


@dataclass(frozen=True)
class Capacity:
    """The deployment's KV cache as vLLM would allocate it."""

    model: ModelSpec
    deployment: DeploymentSpec
    kv_dtype_bytes: int
    max_model_len: int
    activation_gib: float
    fixed_gib: float
    cudagraph_gib: float
    stages: tuple[StageCapacity, ...]

    @property
    def num_gpu_blocks(self) -> int:
        return min(s.num_gpu_blocks for s in self.stages)

    @property
    def limiting_stage(self) -> StageCapacity:
        return min(self.stages, key=lambda s: s.num_gpu_blocks)

    @property
    def block_size(self) -> int:
        return self.deployment.block_size

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's `GPU KV cache size: N tokens` for a model with one KV layout."""
        return self.num_gpu_blocks * self.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV occupies across every GPU of the replica."""
        tp = self.deployment.tensor_parallel
        return sum(s.kv_bytes_per_token_per_gpu for s in self.stages) * tp

    @property
    def overhead_gib(self) -> float:
        return self.activation_gib + self.fixed_gib + self.cudagraph_gib

    @property
    def num_gpus(self) -> int:
        return self.deployment.tensor_parallel * self.deployment.pipeline_parallel

    @property
    def max_model_len_concurrency(self) -> float:
        """vLLM's `Maximum concurrency for <max_model_len> tokens per request: Nx`."""
        per_request = -(-self.max_model_len // self.block_size)
        return self.num_gpu_blocks / per_request

    @property
    def fits_max_model_len(self) -> bool:
        """vLLM refuses to start when one full-length request does not fit."""
        return self.kv_cache_tokens >= self.max_model_len


def pp_layer_split(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[start, end) layers of each stage, as vLLM's `get_pp_indices` splits them."""
    if pp_size > num_layers:
        raise ValueError(f"--pipeline-parallel: {pp_size} stages for {num_layers} layers")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    bounds = []
    start = 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def kv_dtype_bytes(spec: ModelSpec, kv_cache_dtype: str) -> int:
    return spec.dtype_bytes if kv_cache_dtype == "auto" else KV_CACHE_DTYPE_BYTES[kv_cache_dtype]


def plan_capacity(spec: ModelSpec, deployment: DeploymentSpec) -> Capacity:
    """Per-stage memory budget and block count, and the replica's capacity (the smallest stage)."""
    deployment.validate()
    kv_bytes = kv_dtype_bytes(spec, deployment.kv_cache_dtype)
    pp = deployment.pipeline_parallel
    model = deployment.overhead_model
    if deployment.overhead_gib is None:
        activation = model.activation_gib(spec, deployment.max_num_batched_tokens, deployment.tensor_parallel)
        non_torch, cudagraph = model.fixed_gib, model.cudagraph_gib
    else:
        activation, non_torch, cudagraph = deployment.overhead_gib, 0.0, 0.0
    overhead = activation + non_torch + cudagraph
    total_params = spec.param_count()
    stages = []
    for stage, (first, end) in enumerate(pp_layer_split(spec.num_layers, pp)):
        params = spec.stage_params(first, end, pp, stage)
        if deployment.weights_gib is None:
            weights = spec.weights_gib(params)
        else:
            weights = round(deployment.weights_gib * params / total_params, 2)
        geometry = spec.geometry(kv_bytes, num_layers=end - first, weights_gib=weights)
        stages.append(_stage(stage, first, end, geometry, deployment, overhead))
    max_model_len = deployment.max_model_len or spec.max_position_embeddings or 8192
    return Capacity(
        model=spec,
        deployment=deployment,
        kv_dtype_bytes=kv_bytes,
        max_model_len=max_model_len,
        activation_gib=activation,
        fixed_gib=non_torch,
        cudagraph_gib=cudagraph,
        stages=tuple(stages),
    )


def _stage(
    stage: int, first: int, end: int, geometry: ModelGeometry, deployment: DeploymentSpec, overhead: float
) -> StageCapacity:
    gpu = GpuDeployment(
        gpu_memory_gib=deployment.gpu_memory_gib,
        gpu_memory_utilization=deployment.gpu_memory_utilization,
        tensor_parallel=deployment.tensor_parallel,
        overhead_gib=overhead,
    )
    return StageCapacity(
        stage=stage,
        first_layer=first,
        end_layer=end,
        weights_gib=geometry.weights_gib,
        weights_per_gpu_gib=geometry.weights_gib / deployment.tensor_parallel,
        overhead_gib=overhead,
        kv_cache_gib_per_gpu=kv_cache_bytes_per_gpu(geometry, gpu) / GIB,
        kv_bytes_per_token_per_gpu=geometry.kv_bytes_per_token(deployment.tensor_parallel),
        num_gpu_blocks=derive_num_gpu_blocks(geometry, gpu, deployment.block_size),
    )


def footprint_tokens(spec: ModelSpec, sequence_tokens: int, block_size: int) -> int:
    """KV a sequence of this length holds, in whole blocks, as token slots of the all-layer pool.

    A sliding-window layer keeps at most its window, so for such models a long sequence costs less than
    its length; capacity itself counts every layer at every token (vLLM's layout with the hybrid
    allocator disabled, and a lower bound with it).
    """
    n = max(0, sequence_tokens)
    sliding = spec.num_sliding_layers
    if sliding and spec.sliding_window is not None:
        full = spec.num_layers - sliding
        n = -(-(full * n + sliding * min(n, spec.sliding_window)) // spec.num_layers)
    return -(-n // block_size) * block_size
