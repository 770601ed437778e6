"""`template.bos`: the BOS token a tokenizer adds to a text prompt no chat template wraps, or to a rendered
template the server tokenizes with special tokens.

vLLM's completions path tokenizes a text prompt with `add_special_tokens=True`, so a Llama tokenizer adds
`<|begin_of_text|>` (measured against vLLM 0.32.0 in tests/engine); token ids are passed as given, and a
chat template writes its own BOS (counted in `per_request`).
"""

from __future__ import annotations

from extproc.admission.vocabulary.policy import ModelPolicy, TemplateCosts
from extproc.admission.vocabulary.prompt import Prompt, known_tokens

LLAMA3 = ModelPolicy(context_window=8192, template=TemplateCosts(per_message=4, per_request=5, bos=1))


def test_a_text_prompt_gets_the_bos() -> None:
    assert known_tokens(Prompt(texts=("Once upon a time",)), LLAMA3) == 1


def test_an_empty_text_prompt_still_gets_it() -> None:
    assert known_tokens(Prompt(texts=("",)), LLAMA3) == 1


def test_token_ids_get_none() -> None:
    assert known_tokens(Prompt(fixed_tokens=7), LLAMA3) == 7


def test_a_templated_prompt_counts_the_template_not_the_bos() -> None:
    assert known_tokens(Prompt(texts=("user", "hi"), messages=1, templated=True), LLAMA3) == 4 + 5


def test_the_default_adds_nothing() -> None:
    assert TemplateCosts().bos == 0
    assert known_tokens(Prompt(texts=("x",)), ModelPolicy(context_window=8192)) == 0


def test_a_template_tokenized_with_special_tokens_gets_both() -> None:
    """vLLM's Responses path (and a chat request with `add_special_tokens`) tokenizes the rendered template
    with the tokenizer's special tokens: a second BOS on top of the template's."""
    prompt = Prompt(texts=("user", "hi"), messages=1, templated=True, special_tokens=True)
    assert known_tokens(prompt, LLAMA3) == 4 + 5 + 1


def test_responses_prompts_and_chat_with_add_special_tokens_are_tokenized_with_them() -> None:
    from extproc.admission.apis.openai import chat_prompt
    from extproc.admission.apis.responses import responses_prompt

    assert responses_prompt({"input": "hi"}).special_tokens
    messages = [{"role": "user", "content": "hi"}]
    assert not chat_prompt({"messages": messages}).special_tokens
    assert not chat_prompt({"messages": messages, "add_special_tokens": False}).special_tokens
    assert chat_prompt({"messages": messages, "add_special_tokens": True}).special_tokens
