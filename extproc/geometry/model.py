"""A model's shape, read from a Hugging Face `config.json`: what weights and KV cache it needs.

The planner sizes a deployment from the same fields the serving engine reads: layers, hidden size,
attention and KV heads, head dim, MLP width, vocabulary, tied embeddings, dtype, and where present the
mixture-of-experts, multi-head-latent-attention (DeepSeek) and sliding-window fields. Parameters are
counted matrix by matrix (embeddings, attention, gated MLP or experts, norms, lm_head unless tied), so
weight bytes follow from the config without downloading a checkpoint.

Assumptions, stated because a config does not say them: the MLP is gated (gate, up and down
projections: Llama, Mistral, Mixtral, Qwen2/2.5/3, DeepSeek-V2/V3 families); norms are RMSNorm with one
weight vector; rotary embeddings have no parameters. Quantized checkpoints (`quantization_config`) are
flagged: their weight bytes are not the dtype times the parameters, so the planner asks for
`--weights-gib` instead of guessing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.geometry.deployment import GIB, ModelGeometry

DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
}
"""Bytes per weight element for the `torch_dtype` / `dtype` values a config can name."""

KV_CACHE_DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""vLLM's `--kv-cache-dtype` choices (besides `auto`, which follows the model dtype)."""

_QWEN2_FAMILY = frozenset({"qwen2", "qwen2_moe"})
_QK_NORM_FAMILY = frozenset({"qwen3", "qwen3_moe"})


class ModelConfigError(ValueError):
    """A config.json the planner cannot size; the message names the key."""


@dataclass(frozen=True)
class MoeSpec:
    """Mixture of experts: `num_experts` routed experts per MoE layer plus optional shared experts."""

    num_experts: int
    expert_intermediate_size: int
    experts_per_token: int
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def latent_dim(self) -> int:
        """Width of the cached vector: the compressed KV plus the decoupled rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that weights and KV cache depend on."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    moe: MoeSpec | None = None
    moe_layers: tuple[bool, ...] = ()
    mla: MlaSpec | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    max_position_embeddings: int | None = None
    quantized: bool = False

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    # -- parameters ---------------------------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size

    def attention_params(self) -> int:
        """Projection weights (and biases) of one attention block."""
        h = self.hidden_size
        if self.mla is not None:
            return _mla_params(h, self.num_heads, self.mla)
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        params = h * q_out + 2 * h * kv_out + q_out * h
        if self.qkv_bias:
            params += q_out + 2 * kv_out
        if self.o_bias:
            params += h
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def mlp_params(self, layer: int) -> int:
        """Gated MLP of one layer: three matrices, or the routed experts, router and shared experts."""
        h = self.hidden_size
        if self.moe is None or not self.moe_layers[layer]:
            return 3 * h * self.intermediate_size
        moe = self.moe
        params = moe.num_experts * 3 * h * moe.expert_intermediate_size + h * moe.num_experts
        params += 3 * h * moe.shared_intermediate_size
        if moe.shared_expert_gate:
            params += h
        return params

    def mlp_activation_width(self) -> int:
        """Widest MLP intermediate a token passes through: the dense width, or for MoE layers the
        routed experts it visits plus the shared experts (what the profile run's peak scales with)."""
        widths = [self.intermediate_size] if not all(self.moe_layers) or self.moe is None else []
        if self.moe is not None and any(self.moe_layers):
            moe = self.moe
            widths.append(moe.experts_per_token * moe.expert_intermediate_size + moe.shared_intermediate_size)
        return max(widths)

    def layer_params(self, layer: int) -> int:
        """One decoder layer: attention, MLP and its two norms."""
        return self.attention_params() + self.mlp_params(layer) + 2 * self.hidden_size

    def param_count(self) -> int:
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return self.embedding_params + layers + self.final_norm_params + self.lm_head_params

    def active_param_count(self) -> int:
        """Parameters one token passes through: only `experts_per_token` of each MoE layer's experts.

        Prefill compute scales with this, not with the total (which sets weight memory).
        """
        total = self.param_count()
        if self.moe is None:
            return total
        unused = self.moe.num_experts - self.moe.experts_per_token
        per_expert = 3 * self.hidden_size * self.moe.expert_intermediate_size
        return total - sum(self.moe_layers) * unused * per_expert

    def stage_params(self, first_layer: int, end_layer: int, num_stages: int, stage: int) -> int:
        """Parameters a pipeline stage holds: its layers, plus the embedding on the first stage and
        the final norm and lm_head on the last (a tied lm_head reuses the embedding, which the last
        stage then also needs)."""
        params = sum(self.layer_params(i) for i in range(first_layer, end_layer))
        if stage == 0:
            params += self.embedding_params
        if stage == num_stages - 1:
            params += self.final_norm_params
            params += self.lm_head_params if not self.tie_word_embeddings else 0
            if self.tie_word_embeddings and num_stages > 1:
                params += self.embedding_params
        return params

    def weights_gib(self, params: int | None = None) -> float:
        """Weight memory in GiB, rounded to 0.01 GiB as vLLM logs it (`Model loading took X GiB`)."""
        count = self.param_count() if params is None else params
        return round(count * self.dtype_bytes / GIB, 2)

    # -- KV cache -----------------------------------------------------------------------------------

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.sliding_layers)

    def geometry(
        self, kv_dtype_bytes: int, num_layers: int | None = None, weights_gib: float | None = None
    ) -> ModelGeometry:
        """The KV shape the block arithmetic needs (`extproc.geometry.deployment`)."""
        return ModelGeometry(
            num_layers=self.num_layers if num_layers is None else num_layers,
            num_kv_heads=1 if self.mla is not None else self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=kv_dtype_bytes,
            weights_gib=self.weights_gib() if weights_gib is None else weights_gib,
            kv_latent_dim=self.mla.latent_dim if self.mla is not None else None,
        )


def _mla_params(h: int, heads: int, mla: MlaSpec) -> int:
    """DeepSeek-V2 attention: low-rank query (optional), compressed KV with a decoupled rotary key."""
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * qk_head
    else:
        q = h * heads * qk_head
    kv_a = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    o = heads * mla.v_head_dim * h
    return q + kv_a + kv_b + o


# -- parsing ----------------------------------------------------------------------------------------


class _Reader:
    """Typed access to a config mapping; every error names the key."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(f"{self.where}: {key}: required")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{self.where}: {key}: must be a positive integer, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return self.positive_int(key) if self.has(key) else None

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(f"{self.where}: {key}: must be true or false, got {value!r}")
        return value


def parse_model_config(data: Any, name: str = "model") -> ModelSpec:
    """Build a `ModelSpec` from a parsed config.json (a mapping), or raise `ModelConfigError`."""
    if not isinstance(data, Mapping):
        raise ModelConfigError(f"{name}: config must be a JSON object")
    text = data.get("text_config")
    if data.get("num_hidden_layers") is None and isinstance(text, Mapping):
        # Multimodal configs keep the language model under text_config; dtype may sit at the top.
        merged = dict(text)
        for key in ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config"):
            if key not in merged and key in data:
                merged[key] = data[key]
        data = merged
    r = _Reader(data, name)
    layers = r.positive_int("num_hidden_layers")
    hidden = r.positive_int("hidden_size")
    heads = r.positive_int("num_attention_heads")
    kv_heads = r.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{name}: num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
        )
    model_type = str(data.get("model_type") or "unknown")
    return ModelSpec(
        name=name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=r.positive_int("head_dim", hidden // heads),
        intermediate_size=r.positive_int("intermediate_size"),
        vocab_size=r.positive_int("vocab_size"),
        tie_word_embeddings=r.boolean("tie_word_embeddings", False),
        dtype=_dtype(data, name),
        qkv_bias=model_type in _QWEN2_FAMILY or r.boolean("attention_bias", False),
        o_bias=r.boolean("attention_bias", False) and model_type not in _QWEN2_FAMILY,
        qk_norm=model_type in _QK_NORM_FAMILY,
        moe=_moe(r, name),
        moe_layers=_moe_layers(r, layers),
        mla=_mla(r),
        sliding_window=_sliding_window(r),
        sliding_layers=_sliding_layers(r, layers, name),
        max_position_embeddings=r.optional_int("max_position_embeddings"),
        quantized=data.get("quantization_config") is not None,
    )


def load_model_config(path: str | Path) -> ModelSpec:
    """Read a config.json file; the model is named after its directory (or the file stem)."""
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigError(f"{file}: cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{file}: invalid JSON: {exc.msg} (line {exc.lineno})") from exc
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return parse_model_config(data, name or "model")


def _dtype(data: Mapping[str, Any], name: str) -> str:
    value = data.get("torch_dtype") or data.get("dtype") or "bfloat16"
    text = str(value).removeprefix("torch.")
    if text not in DTYPE_BYTES:
        allowed = ", ".join(sorted(DTYPE_BYTES))
        raise ModelConfigError(f"{name}: torch_dtype: unsupported {value!r} (one of {allowed})")
    return text


def _moe(r: _Reader, name: str) -> MoeSpec | None:
    experts = r.optional_int("num_local_experts") or r.optional_int("num_experts")
    experts = experts or r.optional_int("n_routed_experts")
    if experts is None:
        return None
    expert_width = r.positive_int("moe_intermediate_size", r.positive_int("intermediate_size"))
    shared = r.optional_int("shared_expert_intermediate_size")
    n_shared = r.optional_int("n_shared_experts")
    if shared is None and n_shared is not None:
        shared = n_shared * expert_width
    return MoeSpec(
        num_experts=experts,
        expert_intermediate_size=expert_width,
        experts_per_token=min(experts, r.positive_int("num_experts_per_tok", experts)),
        shared_intermediate_size=shared or 0,
        # Qwen2-MoE gates its shared expert with a hidden -> 1 projection.
        shared_expert_gate=r.has("shared_expert_intermediate_size"),
    )


def _moe_layers(r: _Reader, layers: int) -> tuple[bool, ...]:
    """Which layers carry experts: DeepSeek keeps the first k dense, Qwen-MoE names dense layers."""
    if _moe(r, "") is None:
        return (False,) * layers
    first_dense = r.data.get("first_k_dense_replace") or 0
    freq = r.data.get("moe_layer_freq") or 1
    step = r.data.get("decoder_sparse_step") or 1
    dense_only = set(r.data.get("mlp_only_layers") or [])
    flags = []
    for i in range(layers):
        moe = i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only
        flags.append(moe)
    return tuple(flags)


def _mla(r: _Reader) -> MlaSpec | None:
    if not r.has("kv_lora_rank"):
        return None
    return MlaSpec(
        kv_lora_rank=r.positive_int("kv_lora_rank"),
        qk_rope_head_dim=r.positive_int("qk_rope_head_dim"),
        qk_nope_head_dim=r.positive_int("qk_nope_head_dim"),
        v_head_dim=r.positive_int("v_head_dim"),
        q_lora_rank=r.optional_int("q_lora_rank"),
    )


def _sliding_window(r: _Reader) -> int | None:
    if not r.has("sliding_window") or not r.boolean("use_sliding_window", True):
        return None
    return r.positive_int("sliding_window")


def _sliding_layers(r: _Reader, layers: int, name: str) -> tuple[bool, ...]:
    """Per-layer sliding-window flags: `layer_types` when given, else Qwen2's `max_window_layers`
    (layers from that index on slide), else every layer when a window is configured."""
    types = r.data.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise ModelConfigError(f"{name}: layer_types: has {len(types)} entries for {layers} layers")
        return tuple(t == "sliding_attention" for t in types)
    if _sliding_window(r) is None:
        return (False,) * layers
    start = r.data.get("max_window_layers") if r.has("use_sliding_window") else None
    first = start if isinstance(start, int) and not isinstance(start, bool) else 0
    return tuple(i >= first for i in range(layers))
