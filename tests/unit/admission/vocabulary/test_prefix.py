"""A request's prompt as chained chunk hashes (admission/vocabulary/prefix.py): equal leading text shares
chunks, and anything that may render ahead of it (tools, a system field, another model, `cache_salt`) shares
nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest

from extproc.admission.vocabulary.parsed import Api
from extproc.admission.vocabulary.policy import ModelPolicy
from extproc.admission.vocabulary.prefix import CHUNK_CHARS, prompt_chunks
from tests.unit.admission.apis_helpers import parse, plan

CHAT = Api("chat")
POLICY = ModelPolicy(context_window=100_000)
SYSTEM = "You are a careful assistant. " * 100  # ~2,900 characters: eleven full chunks


def chat(user: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, **fields}


def shared(a: dict[str, Any], b: dict[str, Any], api: Api = CHAT) -> int:
    first, second = prompt_chunks(parse(api, a)), prompt_chunks(parse(api, b))
    run = 0
    for x, y in zip(first.hashes, second.hashes, strict=False):
        if x != y:
            break
        run += 1
    return run


def test_a_shared_system_prompt_shares_its_whole_chunks() -> None:
    """Each text is cut on its own, so the shared system prompt ends a chunk: the run covers it whole, its
    role and the next role too, and stops at the first text that differs."""
    run = shared(chat("first question"), chat("another question entirely"))
    assert run == 1 + math.ceil(len(SYSTEM) / CHUNK_CHARS) + 1  # "system", its text, "user"
    chunks = prompt_chunks(parse(CHAT, chat("first question")))
    assert chunks.text_ends == (1, run - 1, run, run + 1) and len(chunks.hashes) == run + 1


def test_sampling_fields_do_not_split_a_prefix() -> None:
    assert shared(chat("q", max_tokens=10, temperature=0.1, stream=True), chat("q", max_tokens=99, n=2)) > 10


def test_what_renders_ahead_of_the_messages_splits_it() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert shared(chat("q"), chat("q", tools=tools)) == 0
    assert shared(chat("q"), chat("q", cache_salt="tenant-b")) == 0
    assert shared(chat("q"), {**chat("q"), "model": "other"}) == 0


def test_a_different_first_message_shares_nothing_but_its_role() -> None:
    body = chat("q")
    other = {**body, "messages": [{"role": "system", "content": "X" + SYSTEM}, body["messages"][1]]}
    assert shared(body, other) == 1  # the role text "system": its one token, no whole block: none


def test_media_and_batches_bring_no_chunks() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = chat("q")
    body["messages"][1]["content"] = [{"type": "text", "text": "look"}, image]
    assert prompt_chunks(parse(CHAT, body)).hashes == ()
    batch = {"model": "m", "prompt": [SYSTEM + "a", SYSTEM + "b"]}
    assert prompt_chunks(parse(Api("completions"), batch)).hashes == ()
    single = {"model": "m", "prompt": SYSTEM + "a", "max_tokens": 5}
    assert shared(single, {**single, "prompt": SYSTEM + "b", "max_tokens": 7}, Api("completions")) >= 11


def test_a_prompt_the_engine_may_cut_brings_no_chunks() -> None:
    """vLLM's `truncate_prompt_tokens` keeps the prompt's last tokens and Responses' `truncation: auto` drops
    a conversation's first items: the engine then holds none of the text's leading blocks."""
    assert prompt_chunks(parse(CHAT, chat("q", truncate_prompt_tokens=512))).hashes == ()
    assert prompt_chunks(parse(CHAT, chat("q", truncate_prompt_tokens=-1))).hashes == ()
    responses = {"model": "m", "instructions": SYSTEM, "input": "q"}
    assert prompt_chunks(parse(Api("responses"), responses)).hashes != ()
    assert prompt_chunks(parse(Api("responses"), {**responses, "truncation": "auto"})).hashes == ()
    assert prompt_chunks(parse(Api("responses"), {**responses, "truncation": "disabled"})).hashes != ()


def test_a_template_that_may_reorder_brings_no_chunks() -> None:
    """The sidecar hashes the texts in order; the engine shares what the template renders first. A client's
    own chat template (where the operator allows one) may put the shared system prompt last, and a model
    whose template moves a message (Mistral-7B-Instruct-v0.3 renders the system message in the last user
    turn: `template.in_order: false`) does it for every conversation: a credit there is a prefix the engine
    never shares, so none is given. An untemplated prompt (completions) keeps its chunks."""
    reorder = "{% for m in messages|reverse %}{{ m.content }}{% endfor %}"
    assert prompt_chunks(parse(CHAT, chat("q"))).hashes != ()
    assert prompt_chunks(parse(CHAT, chat("q", chat_template=reorder))).hashes == ()
    kwargs = {"chat_template": reorder}
    assert prompt_chunks(parse(CHAT, chat("q", chat_template_kwargs=kwargs))).hashes == ()
    assert prompt_chunks(parse(CHAT, chat("q")), in_order=False).hashes == ()
    single = {"model": "m", "prompt": SYSTEM + "a"}
    assert prompt_chunks(parse(Api("completions"), single), in_order=False).hashes != ()


def own_booked(api: Api, shared: dict[str, Any], own: dict[str, Any]) -> tuple[int, int]:
    """(tokens booked for `own`'s prompt beside `shared` in flight, its tokens past the shared text)."""
    plan_shared, plan_own = plan(api, shared, POLICY), plan(api, own, POLICY)
    first = prompt_chunks(parse(api, shared), plan_shared.text_tokens)
    second = prompt_chunks(parse(api, own), plan_own.text_tokens)
    run = 0
    for x, y in zip(first.hashes, second.hashes, strict=False):
        if x != y:
            break
        run += 1
    credit = second.credit(run, plan_own.prompt_tokens, block=16)
    return plan_own.prompt_tokens - credit, plan_own.prompt_tokens - plan_shared.prompt_tokens


@pytest.mark.parametrize(
    "tail",
    [
        "这是一个关于缓存的问题请详细回答。" * 80,  # ~1,500 Chinese characters: about a token each
        "0123456789 " * 400,  # digits: dense in tokens per character
    ],
)
def test_a_dense_tail_is_booked_at_least_its_own_tokens(tail: str) -> None:
    """By the characters' share, an English system prompt before a tail denser in tokens per character was
    credited part of the tail: its own part booked 665 of 1,507 tokens. In tokens, never below its own."""
    shared, own = chat("q"), chat(tail)
    booked, own_tokens = own_booked(CHAT, shared, own)
    assert booked >= own_tokens > 0


def test_a_padded_prefix_is_not_credited_past_its_tokens() -> None:
    """A system prompt padded with `=` lines (few tokens per character) and a tail of digits."""
    system = ("=" * 200 + "\n") * 20

    def body(user: str) -> dict[str, Any]:
        return {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }

    booked, own_tokens = own_booked(CHAT, body("q"), body("7" * 4_000))
    assert booked >= own_tokens > 0


def test_the_shared_system_prompt_is_credited_its_tokens_less_a_block() -> None:
    """The shared-prefix overload's shape (a long system prompt, a short question of each request's own):
    the run covers the system prompt whatever its length, so nearly all of its tokens are credited. Cut
    across the joined texts, the run stopped inside it and nothing was credited (KV peak 0.28 where sharing
    reached 0.76 on the simulator's overload)."""
    for system in (SYSTEM, SYSTEM + "padding " * 7, SYSTEM[:-9]):
        first = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}],
        }
        second = {**first, "messages": [first["messages"][0], {"role": "user", "content": "question two"}]}
        booked, own = own_booked(CHAT, first, second)
        system_tokens = plan(CHAT, second, POLICY).text_tokens[1]
        assert own <= booked <= plan(CHAT, second, POLICY).prompt_tokens - system_tokens + 16, system
