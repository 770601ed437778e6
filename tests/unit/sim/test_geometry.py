"""Deployment arithmetic for the default Llama-3-8B / H100 and its variations."""

from __future__ import annotations

import pytest

from extproc.sim.config import SimConfig
from extproc.sim.geometry import GIB, GpuDeployment, ModelGeometry, derive_num_gpu_blocks


def test_llama3_8b_kv_bytes_per_token() -> None:
    assert ModelGeometry().kv_bytes_per_token() == 131_072  # 2 * 32 * 8 * 128 * 2 = 128 KiB


def test_default_deployment_block_count() -> None:
    # (79.19 * 0.9 - 14.96 - 2.5) GiB / (16 tokens * 128 KiB) = 27551.9 -> 27551 blocks
    assert derive_num_gpu_blocks(ModelGeometry(), GpuDeployment()) == 27_551
    assert SimConfig().resolved_num_gpu_blocks() == 27_551


def test_vllm_a100_40gb_log_is_reproduced() -> None:
    # vLLM issue 12330: 11.12 GiB of KV on an A100-40GB for Llama-3-8B -> "# GPU blocks: 5691".
    gpu = GpuDeployment(gpu_memory_gib=39.50, gpu_memory_utilization=0.9, overhead_gib=9.37 + 0.10)
    assert derive_num_gpu_blocks(ModelGeometry(), gpu) == pytest.approx(5691, abs=3)


def test_fp8_and_tensor_parallel_change_capacity() -> None:
    bf16 = derive_num_gpu_blocks(ModelGeometry(), GpuDeployment())
    fp8 = derive_num_gpu_blocks(ModelGeometry(dtype_bytes=1), GpuDeployment())
    assert fp8 in (2 * bf16, 2 * bf16 + 1)
    tp2 = GpuDeployment(tensor_parallel=2)
    assert ModelGeometry().kv_bytes_per_token(2) == 65_536
    expected = int((79.19 * 0.9 - 14.96 / 2 - 2.5) * GIB // (16 * 65_536))
    assert derive_num_gpu_blocks(ModelGeometry(), tp2) == expected


def test_config_rejects_a_cache_smaller_than_one_full_context() -> None:
    with pytest.raises(ValueError, match="exceeds KV capacity"):
        SimConfig(num_gpu_blocks=10, max_model_len=8192).validate()
    SimConfig(num_gpu_blocks=512, max_model_len=8192).validate()
