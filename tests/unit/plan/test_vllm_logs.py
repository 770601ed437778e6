"""The memory model against published vLLM start-up logs (the table in
docs/internals/planner-memory-model.md).

Each case gives the deployment as the log states it and the block count vLLM reported (or that its
logged KV memory implies). The test pins the planner's prediction and bounds its error, so the table
in the docs cannot drift from the code. Errors are large where they are: see the docs for why.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from extproc.geometry.capacity import DeploymentSpec, plan_capacity
from extproc.geometry.deployment import GIB, GpuDeployment, ModelGeometry, derive_num_gpu_blocks
from extproc.geometry.model import ModelSpec, parse_model_config
from extproc.geometry.presets import model_preset

# Llama-2 shapes as in mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py
# @ 01ced331a9e155c5ba4e7625b027a51bee611450 (llama2_7b, llama2_70b).
LLAMA_2_7B = parse_model_config(
    {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    },
    "llama-2-7b",
)
LLAMA_2_70B = parse_model_config(
    {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    },
    "llama-2-70b",
)


@dataclass(frozen=True)
class LogCase:
    name: str
    spec: ModelSpec
    deployment: DeploymentSpec
    logged_blocks: int
    predicted_blocks: int
    max_error: float


def _blocks_from_gib(gib: float, bytes_per_token: int) -> int:
    return int(gib * GIB // (16 * bytes_per_token))


CASES = [
    # vllm-project/vllm PR #10511 (Dec 2024): Meta-Llama-3-8B, H100 79.22 GiB, 0.9, TP 1;
    # "available_kv_cache_memory 53.29GiB".
    LogCase(
        "A",
        model_preset("llama-3-8b"),
        DeploymentSpec(gpu_memory_gib=79.22, max_num_batched_tokens=8192),
        _blocks_from_gib(53.29, 131_072),
        27_565,
        0.02,
    ),
    # Same PR, TP 2: weights 7.48, non_torch 3.58, activation 1.26 of 71.29 GiB -> 58.97 GiB.
    LogCase(
        "B",
        model_preset("llama-3-8b"),
        DeploymentSpec(gpu_memory_gib=79.22, tensor_parallel=2, max_num_batched_tokens=8192),
        _blocks_from_gib(71.29 - 7.48 - 3.58 - 1.26, 65_536),
        63_125,
        0.05,
    ),
    # vllm-project/vllm issue #10517 (Dec 2024): Llama-3.1-8B-Instruct, RTX 3090 23.58 GiB, 0.9,
    # max_model_len 20000 and 29000 (batched tokens = max_model_len): "# GPU blocks: 1952" / 1478.
    LogCase(
        "C1",
        model_preset("llama-3.1-8b"),
        DeploymentSpec(gpu_memory_gib=23.58, max_model_len=20000, max_num_batched_tokens=20000),
        1952,
        1349,
        0.35,
    ),
    LogCase(
        "C2",
        model_preset("llama-3.1-8b"),
        DeploymentSpec(gpu_memory_gib=23.58, max_model_len=29000, max_num_batched_tokens=29000),
        1478,
        910,
        0.40,
    ),
    # vllm-project/vllm issue #13061 (Feb 2025): DeepSeek-R1-Distill-Qwen-14B (Qwen2.5-14B shape),
    # 2 x RTX 4090, 0.98 of 23.55 GiB, TP 2, chunked prefill (2048 tokens); KV "81536" tokens.
    LogCase(
        "D",
        model_preset("qwen2.5-14b"),
        DeploymentSpec(
            gpu_memory_gib=23.55, gpu_memory_utilization=0.98, tensor_parallel=2, max_num_batched_tokens=2048
        ),
        81_536 // 16,
        5111,
        0.01,
    ),
    # vllm-project/vllm PR #2031 (Dec 2023): Llama-2-7B on one A100-80GB (81920 MiB as nvidia-smi shows
    # it in issue #2069), max_model_len 4096: "# GPU blocks: 7351"; Llama-2-70B TP 4: 20865.
    LogCase(
        "E",
        LLAMA_2_7B,
        DeploymentSpec(gpu_memory_gib=80.0, max_model_len=4096, max_num_batched_tokens=4096),
        7351,
        7349,
        0.01,
    ),
    LogCase(
        "F",
        LLAMA_2_70B,
        DeploymentSpec(
            gpu_memory_gib=80.0, tensor_parallel=4, max_model_len=4096, max_num_batched_tokens=4096
        ),
        20_865,
        31_024,
        0.50,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_prediction_against_the_log(case: LogCase) -> None:
    predicted = plan_capacity(case.spec, case.deployment).num_gpu_blocks
    assert predicted == case.predicted_blocks
    error = (predicted - case.logged_blocks) / case.logged_blocks
    assert abs(error) <= case.max_error


def test_block_arithmetic_is_exact_given_the_logged_overhead() -> None:
    # Issue #10517, 20k: weights 14.99 ("14.9888 GB"), peak torch 17.06 GiB, non-torch 0.35 GiB.
    geometry = ModelGeometry(weights_gib=14.99)
    gpu = GpuDeployment(gpu_memory_gib=23.58, overhead_gib=17.06 - 14.99 + 0.35)
    assert derive_num_gpu_blocks(geometry, gpu) == pytest.approx(1952, abs=3)  # logged GiB are rounded
    # PR #10511 TP 1: 71.29 - 14.96 - 1.79 - 1.26 = 53.28 GiB.
    gpu = GpuDeployment(gpu_memory_gib=79.22, overhead_gib=1.79 + 1.26)
    assert derive_num_gpu_blocks(ModelGeometry(), gpu) == pytest.approx(
        _blocks_from_gib(53.29, 131_072), abs=8
    )
