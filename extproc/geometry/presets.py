"""Built-in models and GPUs for `extproc plan`, so a plan needs no downloaded config.json.

Every model preset holds the fields of the published Hugging Face config.json that the planner reads,
copied from a public copy of that file; the comment above each names the repository, path and commit the
values were checked against. A model whose values could not be checked is not shipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.geometry.model import ModelSpec, parse_model_config

_MLC = "mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py @ 01ced331a9e155c5ba4e7625b027a51bee611450"
_PROF = "citsjtu2020/LLM-Prof sglang/Model_Config.md @ 8434c8d19c396b2f95d92a67845a7c0a0e0dd512"

MODEL_PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    # meta-llama/Meta-Llama-3-8B config.json (transformers 4.40.0.dev0), as copied in _MLC "llama3_8b".
    "llama-3-8b": (
        f"meta-llama/Meta-Llama-3-8B config.json, checked against {_MLC} (llama3_8b)",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 8192,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 128256,
        },
    ),
    # meta-llama/Meta-Llama-3-70B config.json, as copied in _MLC "llama3_70b".
    "llama-3-70b": (
        f"meta-llama/Meta-Llama-3-70B config.json, checked against {_MLC} (llama3_70b)",
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "max_position_embeddings": 8192,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 128256,
        },
    ),
    # meta-llama/Llama-3.1-8B config.json: _MLC "llama3_1_8b" and _PROF "Llama-3.1-8B" agree.
    "llama-3.1-8b": (
        f"meta-llama/Llama-3.1-8B config.json, checked against {_MLC} (llama3_1_8b) and {_PROF}",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 128256,
        },
    ),
    # meta-llama/Llama-3.1-70B config.json, as copied in _MLC "llama3_1_70b".
    "llama-3.1-70b": (
        f"meta-llama/Llama-3.1-70B config.json, checked against {_MLC} (llama3_1_70b)",
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "max_position_embeddings": 131072,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 128256,
        },
    ),
    # Qwen/Qwen2.5-7B config.json as copied in _PROF "Qwen2.5-7B"; the shapes equal Qwen2-7B in _MLC.
    "qwen2.5-7b": (
        f"Qwen/Qwen2.5-7B config.json, checked against {_PROF} (Qwen2.5-7B)",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "max_position_embeddings": 131072,
            "max_window_layers": 28,
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "vocab_size": 152064,
        },
    ),
    # Qwen/Qwen2.5-14B config.json as copied in _PROF "Qwen2.5-14B".
    "qwen2.5-14b": (
        f"Qwen/Qwen2.5-14B config.json, checked against {_PROF} (Qwen2.5-14B)",
        {
            "model_type": "qwen2",
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "max_position_embeddings": 131072,
            "max_window_layers": 48,
            "num_attention_heads": 40,
            "num_hidden_layers": 48,
            "num_key_value_heads": 8,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "vocab_size": 152064,
        },
    ),
    # Qwen/Qwen3-8B config.json as copied in _PROF "Qwen3-8B".
    "qwen3-8b": (
        f"Qwen/Qwen3-8B config.json, checked against {_PROF} (Qwen3-8B)",
        {
            "model_type": "qwen3",
            "head_dim": 128,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
    # Qwen/Qwen3-30B-A3B config.json as copied in _PROF "Qwen3-30B-A3B" (MoE, 128 experts, 8 per token).
    "qwen3-30b-a3b": (
        f"Qwen/Qwen3-30B-A3B config.json, checked against {_PROF} (Qwen3-30B-A3B)",
        {
            "model_type": "qwen3_moe",
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json as copied in _MLC "Mixtral-8x7B-v0.1".
    "mixtral-8x7b": (
        f"mistralai/Mixtral-8x7B-v0.1 config.json, checked against {_MLC} (Mixtral-8x7B-v0.1)",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
        },
    ),
    # deepseek-ai/DeepSeek-V2-Lite config.json as copied in _MLC "deepseek_v2_lite" (MLA + MoE).
    "deepseek-v2-lite": (
        f"deepseek-ai/DeepSeek-V2-Lite config.json, checked against {_MLC} (deepseek_v2_lite)",
        {
            "model_type": "deepseek_v2",
            "first_k_dense_replace": 1,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "moe_intermediate_size": 1408,
            "moe_layer_freq": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_attention_heads": 16,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 27,
            "num_key_value_heads": 16,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "torch_dtype": "bfloat16",
            "v_head_dim": 128,
            "vocab_size": 102400,
        },
    ),
}


def model_preset(name: str) -> ModelSpec:
    """The preset's spec; KeyError lists the known names."""
    try:
        _, data = MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r} (known: {', '.join(sorted(MODEL_PRESETS))})") from None
    return parse_model_config(data, name)


@dataclass(frozen=True)
class GpuSpec:
    """What the planner needs of a GPU: memory as vLLM sees it, and the two rates the step timing uses."""

    name: str
    memory_gib: float
    hbm_tb_per_s: float
    bf16_dense_tflops: float
    source: str


GPU_PRESETS: Mapping[str, GpuSpec] = {
    # Total memory as vLLM reports it for an H100 80 GB (the simulator's default; vLLM PR #10511 logs
    # 79.22 GiB on another H100 board); H100 SXM HBM3 bandwidth and dense bf16 throughput as used by the
    # simulator's step timing (docs/simulator.md).
    "h100-80gb": GpuSpec(
        name="h100-80gb",
        memory_gib=79.19,
        hbm_tb_per_s=3.35,
        bf16_dense_tflops=989.0,
        source="docs/simulator.md (vLLM's reported total for an H100 80GB; H100 SXM datasheet rates)",
    ),
}
