"""Deployment arithmetic: how many KV-cache blocks a model on a GPU gets.

The simulator's KV capacity has to match what a real vLLM deployment would report in
`vllm:cache_config_info{num_gpu_blocks=...}`, otherwise the sidecar is tuned against a fiction, and the
planner (`extproc plan`) has to size limits against the same number. Both call this module. vLLM profiles
the GPU at start-up and pre-allocates everything left after weights and activations as KV cache
(`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py; `get_num_blocks`,
vllm/v1/core/kv_cache_utils.py; docs/internals/planner-memory-model.md has the citations and the error
against real logs):

    kv_bytes_per_gpu = gpu_memory * gpu_memory_utilization - weights / tp - overhead
    bytes_per_token_per_gpu = 2 (K and V) * layers * (kv_heads / tp) * head_dim * dtype_bytes
    num_gpu_blocks = floor(kv_bytes_per_gpu / (block_size * bytes_per_token_per_gpu))

The defaults describe Llama-3-8B in bf16 on one 80 GB H100; docs/simulator.md shows the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3

# vLLM's CacheConfig.DEFAULT_BLOCK_SIZE.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of the attention KV cache of one model; defaults are Llama-3-8B (HF config.json).

    `kv_latent_dim` is set for multi-head latent attention (DeepSeek MLA): each layer then stores one
    latent vector of that width per token instead of K and V per head, and every tensor-parallel rank
    holds the whole latent (vLLM's MLAAttentionSpec, vllm/v1/kv_cache_interface.py).
    """

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    weights_gib: float = 14.96  # 8.03e9 params * 2 bytes, as vLLM logs it for Llama-3-8B
    kv_latent_dim: int | None = None

    def kv_bytes_per_token(self, tensor_parallel: int = 1) -> int:
        """KV bytes one token occupies on one GPU; with TP each GPU holds kv_heads / tp heads.

        When there are fewer KV heads than ranks, vLLM replicates heads so every rank keeps one.
        """
        if self.kv_latent_dim is not None:
            return self.num_layers * self.kv_latent_dim * self.dtype_bytes
        heads = max(1, self.num_kv_heads // max(1, tensor_parallel))
        return 2 * self.num_layers * heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GpuDeployment:
    """One replica's memory budget; defaults are one H100 80 GB as vLLM sees it (79.19 GiB total)."""

    gpu_memory_gib: float = 79.19
    gpu_memory_utilization: float = 0.9
    tensor_parallel: int = 1
    # Peak activations of a profiling pass with max_num_batched_tokens, CUDA graphs and non-torch
    # allocations; an assumption (see docs/simulator.md and docs/planning.md), exposed as a flag.
    overhead_gib: float = 2.5


def kv_cache_bytes_per_gpu(model: ModelGeometry, gpu: GpuDeployment) -> float:
    """Bytes left for the KV cache on each GPU after weights and overhead (never negative)."""
    budget = gpu.gpu_memory_gib * gpu.gpu_memory_utilization
    left = budget - model.weights_gib / max(1, gpu.tensor_parallel) - gpu.overhead_gib
    return max(0.0, left) * GIB


def derive_num_gpu_blocks(
    model: ModelGeometry, gpu: GpuDeployment, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Number of KV blocks vLLM would allocate for this model on this deployment."""
    per_block = block_size * model.kv_bytes_per_token(gpu.tensor_parallel)
    return math.floor(kv_cache_bytes_per_gpu(model, gpu) / per_block)
