"""config.json parsing and parameter counts against the published sizes of the preset models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from extproc.geometry.model import ModelConfigError, load_model_config, parse_model_config
from extproc.geometry.presets import MODEL_PRESETS, model_preset

LLAMA = dict(MODEL_PRESETS["llama-3-8b"][1])


@pytest.mark.parametrize(
    ("preset", "published_b", "tolerance"),
    [
        # Meta's model cards: 8.03B and 70.6B parameters (the sizes the issue cites).
        ("llama-3-8b", 8.03, 0.001),
        ("llama-3-70b", 70.6, 0.001),
        ("llama-3.1-8b", 8.03, 0.001),
        # Mistral AI: "46.7 billion total parameters" (https://golden.com/wiki/Mixtral_8x7B-K3K664J).
        ("mixtral-8x7b", 46.7, 0.001),
        # Qwen2.5-7B model card: 7.61B parameters, 6.53B non-embedding (http://www.mynw.cn/news/702433.html).
        ("qwen2.5-7b", 7.61, 0.001),
        # Qwen3-8B model card "Number of Parameters: 8.2B" (https://apxml.com/models/qwen3-8b);
        # Qwen3-30B-A3B "30.5 billion parameters in total" (https://apxml.com/models/qwen3-30b-a3b).
        ("qwen3-8b", 8.2, 0.002),
        ("qwen3-30b-a3b", 30.5, 0.002),
        # DeepSeek-V2-Lite model card: 15.7B total (https://promptlayer.com/models/deepseek-v2-lite-fa0e).
        ("deepseek-v2-lite", 15.7, 0.001),
    ],
)
def test_parameter_counts_match_published_sizes(preset: str, published_b: float, tolerance: float) -> None:
    count = model_preset(preset).param_count()
    assert count / 1e9 == pytest.approx(published_b, rel=tolerance)


def test_llama_3_8b_count_is_exact() -> None:
    # 128256 x 4096 embedding and lm_head + 32 x (attention 41,943,040 + MLP 176,160,768 + 8,192 norms)
    # + 4,096 final norm.
    assert model_preset("llama-3-8b").param_count() == 8_030_261_248
    assert model_preset("llama-3-70b").param_count() == 70_553_706_496


def test_qwen2_has_qkv_bias_and_published_non_embedding_size() -> None:
    spec = model_preset("qwen2.5-7b")
    assert spec.qkv_bias and not spec.o_bias
    non_embedding = spec.param_count() - spec.embedding_params - spec.lm_head_params
    assert non_embedding / 1e9 == pytest.approx(6.53, rel=0.001)


def test_qwen3_non_embedding_size() -> None:
    # Qwen3-8B model card: "Number of Paramaters (Non-Embedding): 6.95B"; qk-norm weights included.
    spec = model_preset("qwen3-8b")
    assert spec.qk_norm
    non_embedding = spec.param_count() - spec.embedding_params - spec.lm_head_params
    assert non_embedding / 1e9 == pytest.approx(6.95, rel=0.001)


def test_moe_active_parameters() -> None:
    # Mixtral: 12.9B active per token (2 of 8 experts); Qwen3-30B-A3B: 3.3B active.
    assert model_preset("mixtral-8x7b").active_param_count() / 1e9 == pytest.approx(12.9, rel=0.01)
    assert model_preset("qwen3-30b-a3b").active_param_count() / 1e9 == pytest.approx(3.3, rel=0.02)
    lite = model_preset("deepseek-v2-lite")
    assert lite.moe is not None and lite.moe.shared_intermediate_size == 2 * 1408
    assert lite.moe_layers == (False,) + (True,) * 26  # first_k_dense_replace = 1


def test_mla_geometry_caches_the_latent_only() -> None:
    spec = model_preset("deepseek-v2-lite")
    assert spec.mla is not None and spec.mla.latent_dim == 512 + 64
    geometry = spec.geometry(kv_dtype_bytes=2)
    assert geometry.kv_bytes_per_token() == 27 * 576 * 2
    assert geometry.kv_bytes_per_token(tensor_parallel=4) == 27 * 576 * 2  # replicated on every rank


def test_defaults_for_absent_keys() -> None:
    data = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "tie_word_embeddings")}
    data.pop("torch_dtype")
    spec = parse_model_config(data, "m")
    assert spec.num_kv_heads == spec.num_heads == 32  # no GQA key: multi-head attention
    assert spec.head_dim == 4096 // 32
    assert spec.dtype == "bfloat16" and not spec.tie_word_embeddings


def test_tied_embeddings_drop_the_lm_head() -> None:
    untied = parse_model_config(LLAMA, "m")
    tied = parse_model_config({**LLAMA, "tie_word_embeddings": True}, "m")
    assert untied.param_count() - tied.param_count() == 128256 * 4096


def test_explicit_head_dim_and_dtype_field() -> None:
    spec = parse_model_config({**LLAMA, "head_dim": 64, "torch_dtype": None, "dtype": "float16"}, "m")
    assert spec.head_dim == 64 and spec.dtype == "float16"


def test_multimodal_text_config_is_used() -> None:
    data: dict[str, Any] = {"text_config": dict(LLAMA), "torch_dtype": "float16", "vision_config": {}}
    del data["text_config"]["torch_dtype"]
    spec = parse_model_config(data, "vl")
    assert spec.num_layers == 32 and spec.dtype == "float16"


def test_sliding_window_layers() -> None:
    mistral = parse_model_config({**LLAMA, "sliding_window": 4096}, "mistral")
    assert mistral.sliding_window == 4096 and mistral.num_sliding_layers == 32
    qwen_off = model_preset("qwen2.5-7b")  # use_sliding_window: false
    assert qwen_off.sliding_window is None and qwen_off.num_sliding_layers == 0
    qwen_on = parse_model_config(
        {**LLAMA, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28}, "q"
    )
    assert qwen_on.num_sliding_layers == 4  # layers 28..31
    types = ["sliding_attention", "full_attention"] * 16
    gemma_like = parse_model_config({**LLAMA, "sliding_window": 1024, "layer_types": types}, "g")
    assert gemma_like.num_sliding_layers == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers: required"),
        ({"hidden_size": "4096"}, "hidden_size: must be a positive integer"),
        ({"num_key_value_heads": 5}, "num_key_value_heads: 5 does not divide"),
        ({"torch_dtype": "int4"}, "torch_dtype: unsupported"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings: must be true or false"),
        ({"layer_types": ["full_attention"]}, "layer_types: has 1 entries for 32 layers"),
    ],
)
def test_bad_configs_name_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        parse_model_config({**LLAMA, **change}, "m")


def test_not_an_object() -> None:
    with pytest.raises(ModelConfigError, match="must be a JSON object"):
        parse_model_config([1, 2], "m")


def test_load_from_file_names_the_model_after_its_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": {"bits": 4}}))
    spec = load_model_config(model_dir / "config.json")
    assert spec.name == "My-Model" and spec.quantized
    assert spec == parse_model_config({**LLAMA, "quantization_config": {}}, "My-Model")


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_model_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="invalid JSON"):
        load_model_config(bad)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama-3-8b"):
        model_preset("gpt-5")
