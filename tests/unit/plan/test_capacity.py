"""The planner's capacity arithmetic: the simulator's default, the 70B TP4 worked example, PP, dtypes."""

from __future__ import annotations

import pytest

from extproc.geometry.capacity import (
    DeploymentSpec,
    OverheadModel,
    footprint_tokens,
    plan_capacity,
    pp_layer_split,
)
from extproc.geometry.deployment import GIB, GpuDeployment, ModelGeometry, derive_num_gpu_blocks
from extproc.geometry.model import parse_model_config
from extproc.geometry.presets import GPU_PRESETS, MODEL_PRESETS, model_preset
from extproc.plan.timing import timing_for
from extproc.sim.config import SimConfig
from extproc.sim.scheduler import StepTiming


def test_llama_3_8b_on_one_h100_is_the_simulators_default_deployment() -> None:
    spec = model_preset("llama-3-8b")
    assert spec.geometry(kv_dtype_bytes=2) == ModelGeometry()
    capacity = plan_capacity(spec, DeploymentSpec(gpu_memory_utilization=0.9))
    assert capacity.overhead_gib == GpuDeployment().overhead_gib == 2.5
    assert capacity.num_gpu_blocks == SimConfig().resolved_num_gpu_blocks() == 27_551
    assert capacity.kv_cache_tokens == 440_816
    assert capacity.max_model_len == SimConfig().max_model_len == 8192
    assert timing_for(capacity, GPU_PRESETS["h100-80gb"]) == StepTiming()


def test_llama_3_70b_tp4_hand_arithmetic() -> None:
    """docs/planning.md, "Worked example": every step checked on its own."""
    capacity = plan_capacity(model_preset("llama-3-70b"), DeploymentSpec(tensor_parallel=4))
    (stage,) = capacity.stages
    # 1. 70,553,706,496 parameters x 2 bytes = 131.42 GiB; each of 4 GPUs holds a quarter.
    assert model_preset("llama-3-70b").weights_gib() == 131.42
    assert stage.weights_per_gpu_gib == pytest.approx(32.855)
    # 2. Activation peak 8192 x (2 x 8192 + 3 x 28672 / 4) x 2 B = 620,756,992 B = 0.578125 GiB,
    #    plus the fixed 1.71875 GiB = 2.296875 GiB.
    assert capacity.activation_gib == 8192 * (2 * 8192 + 3 * 28672 // 4) * 2 / GIB == 0.578125
    assert capacity.overhead_gib == 2.296875
    # 3. 79.19 x 0.9 - 32.855 - 2.296875 = 36.119125 GiB for KV on each GPU.
    assert stage.kv_cache_gib_per_gpu == pytest.approx(36.119125)
    # 4. 2 x 80 layers x (8 KV heads / 4 = 2) x 128 x 2 B = 81,920 B per token per GPU.
    assert stage.kv_bytes_per_token_per_gpu == 81_920
    # 5. floor(36.119125 GiB / (16 x 81,920 B)) = floor(29,588.8) = 29,588 blocks = 473,408 tokens.
    assert capacity.num_gpu_blocks == int(36.119125 * GIB // (16 * 81_920)) == 29_588
    assert capacity.kv_cache_tokens == 473_408
    assert capacity.kv_bytes_per_token == 4 * 81_920


def test_pipeline_split_follows_vllm() -> None:
    assert pp_layer_split(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    # 80 = 26 x 3 + 2: the two extra layers go to the stages before the last.
    assert pp_layer_split(80, 3) == [(0, 27), (27, 54), (54, 80)]
    with pytest.raises(ValueError, match="5 stages for 4 layers"):
        pp_layer_split(4, 5)


def test_pipeline_capacity_is_the_smallest_stage() -> None:
    spec = model_preset("llama-3-70b")
    capacity = plan_capacity(spec, DeploymentSpec(tensor_parallel=4, pipeline_parallel=3))
    blocks = [s.num_gpu_blocks for s in capacity.stages]
    assert capacity.num_gpu_blocks == min(blocks)
    assert [s.num_layers for s in capacity.stages] == [27, 27, 26]
    # The first stage holds the embedding, the last the lm_head; the parts add up to the model.
    assert sum(spec.stage_params(s.first_layer, s.end_layer, 3, s.stage) for s in capacity.stages) == (
        spec.param_count()
    )
    # Fewer layers per stage: each GPU holds fewer weights and fewer KV layers, so more blocks.
    assert capacity.num_gpu_blocks > plan_capacity(spec, DeploymentSpec(tensor_parallel=4)).num_gpu_blocks


def test_tied_embeddings_are_needed_by_the_first_and_last_stage() -> None:
    spec = parse_model_config({**MODEL_PRESETS["llama-3-8b"][1], "tie_word_embeddings": True}, "t")
    two = [spec.stage_params(a, b, 2, i) for i, (a, b) in enumerate(pp_layer_split(32, 2))]
    assert sum(two) == spec.param_count() + spec.embedding_params


def test_fp8_kv_cache_doubles_the_blocks() -> None:
    spec = model_preset("llama-3-8b")
    bf16 = plan_capacity(spec, DeploymentSpec()).num_gpu_blocks
    fp8 = plan_capacity(spec, DeploymentSpec(kv_cache_dtype="fp8")).num_gpu_blocks
    assert fp8 in (2 * bf16, 2 * bf16 + 1)


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    capacity = plan_capacity(model_preset("llama-3-70b"), DeploymentSpec(tensor_parallel=16))
    assert capacity.stages[0].kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2


def test_mla_capacity_per_gpu_does_not_shrink_with_tp() -> None:
    spec = model_preset("deepseek-v2-lite")
    one = plan_capacity(spec, DeploymentSpec())
    two = plan_capacity(spec, DeploymentSpec(tensor_parallel=2))
    assert one.stages[0].kv_bytes_per_token_per_gpu == two.stages[0].kv_bytes_per_token_per_gpu
    assert two.num_gpu_blocks > one.num_gpu_blocks  # only the weights are split


def test_given_overhead_and_weights_replace_the_models() -> None:
    spec = model_preset("llama-3-8b")
    given = plan_capacity(spec, DeploymentSpec(overhead_gib=3.05, weights_gib=14.96))
    assert given.overhead_gib == 3.05 and given.activation_gib == 3.05
    expected = derive_num_gpu_blocks(ModelGeometry(), GpuDeployment(overhead_gib=3.05))
    assert given.num_gpu_blocks == expected


def test_overhead_model_scales_with_batched_tokens_and_mlp_width() -> None:
    model = OverheadModel()
    spec = model_preset("llama-3-8b")
    # 8192 x (2 x 4096 + 3 x 14336) x 2 B = 0.78125 GiB; with the fixed term, the simulator's 2.5 GiB.
    assert model.activation_gib(spec, 8192) == 0.78125
    assert model.total_gib(spec, 8192) == 2.5
    assert model.activation_gib(spec, 2048) == 0.78125 / 4
    assert model.activation_gib(spec, 8192, tensor_parallel=2) == 8192 * (8192 + 21504) * 2 / GIB
    assert plan_capacity(spec, DeploymentSpec(max_num_batched_tokens=2048)).num_gpu_blocks > 27_551
    # MoE: the routed experts a token visits (2 x 14336 for Mixtral) set the width.
    assert model_preset("mixtral-8x7b").mlp_activation_width() == 2 * 14336
    # DeepSeek-V2-Lite: 6 x 1408 routed + 2 x 1408 shared beats the dense first layer's 10944.
    assert model_preset("deepseek-v2-lite").mlp_activation_width() == 8 * 1408


def test_max_model_len_defaults_to_the_config_and_is_checked() -> None:
    spec = model_preset("llama-3.1-8b")
    capacity = plan_capacity(spec, DeploymentSpec())
    assert capacity.max_model_len == 131_072
    assert capacity.max_model_len_concurrency == pytest.approx(27_551 / 8192)
    small = plan_capacity(spec, DeploymentSpec(gpu_memory_gib=23.58))
    assert not small.fits_max_model_len


def test_sliding_window_footprint_caps_sliding_layers() -> None:
    data = {**MODEL_PRESETS["llama-3-8b"][1], "sliding_window": 1024}
    all_sliding = parse_model_config(data, "m")
    assert footprint_tokens(all_sliding, 5000, 16) == 1024
    assert footprint_tokens(all_sliding, 500, 16) == 512
    types = ["sliding_attention", "full_attention"] * 16
    half = parse_model_config({**data, "layer_types": types}, "h")
    assert footprint_tokens(half, 5000, 16) == 3024  # (16 x 5000 + 16 x 1024) / 32 = 3012 -> 3024
    assert footprint_tokens(model_preset("llama-3-8b"), 1366, 16) == 1376


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"tensor_parallel": 0}, "--tensor-parallel"),
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype"),
        ({"max_model_len": 0}, "--max-model-len"),
        ({"overhead_gib": -1.0}, "--overhead-gib"),
        ({"gpu_memory_gib": 0.0}, "--gpu-memory-gib"),
    ],
)
def test_bad_deployments_name_the_flag(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_capacity(model_preset("llama-3-8b"), DeploymentSpec(**change))  # type: ignore[arg-type]
