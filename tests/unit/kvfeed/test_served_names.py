"""Served names from the engine: vLLM's model list mapped to pools, carried by the feed, used by the sidecar.

The cards are shaped as vLLM 0.32.0 writes them (`vllm/entrypoints/openai/models/serving.py`
`show_available_models`, `vllm/entrypoints/serve/engine/protocol.py` `ModelCard`): one per
`--served-model-name` with `root` = the model path and `parent` null, one per LoRA adapter with `root` = its
path and `parent` = its base model's served name.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, parse_config
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.listing import ModelCard, names_by_pool, parse_model_list
from extproc.kvfeed.sample import MAX_SERVED_NAMES, FeedSample, checked, from_proto, to_proto
from extproc.kvfeed.subscriber.runtime import FeedbackRuntime
from extproc.kvfeed.subscriber.served import ServedNames

BASE = "llama-3-8b"
ALIAS = "meta-llama/Meta-Llama-3-8B-Instruct"
PATH = "/models/Meta-Llama-3-8B-Instruct"


def vllm_list(*extra: dict[str, object]) -> bytes:
    def card(id_: str, root: str, parent: str | None) -> dict[str, object]:
        return {
            "id": id_,
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
        }

    data = [
        {**card(BASE, PATH, None), "max_model_len": 8192, "permission": [{"object": "model_permission"}]},
        card(ALIAS, PATH, None),
        card("sql-lora", "/adapters/sql", BASE),
        card("chat-lora", "/adapters/chat", ALIAS),  # a base name given as --lora-modules base_model_name
        *extra,
    ]
    return json.dumps({"object": "list", "data": data}).encode()


def test_vllm_aliases_and_adapters_map_to_the_pool_of_the_page() -> None:
    cards = parse_model_list(vllm_list())
    assert cards is not None and cards[2] == ModelCard("sql-lora", "/adapters/sql", BASE)
    assert names_by_pool(cards, [BASE]) == {BASE: (BASE, ALIAS, "sql-lora", "chat-lora")}
    # A target `model` override names the pool differently from every card: the one pool takes them all.
    assert names_by_pool(cards, ["pool-a"]) == {"pool-a": ("pool-a", BASE, ALIAS, "sql-lora", "chat-lora")}


def test_with_several_pools_names_go_by_identity_root_and_parent() -> None:
    other: list[dict[str, object]] = [
        {"id": "qwen", "root": "/models/qwen", "parent": None},
        {"id": "qwen-alias", "root": "/models/qwen", "parent": None},
        {"id": "qwen-lora", "root": "/adapters/q", "parent": "qwen-alias"},
        {"id": "orphan", "root": "/nowhere", "parent": None},
        {"id": "orphan-lora", "root": "/adapters/o", "parent": "not-listed"},
    ]
    cards = parse_model_list(vllm_list(*other))
    assert cards is not None
    assert names_by_pool(cards, [BASE, "qwen"]) == {
        BASE: (BASE, ALIAS, "sql-lora", "chat-lora"),
        "qwen": ("qwen", "qwen-alias", "qwen-lora"),
    }


@pytest.mark.parametrize(
    "body", [b"not json", b"[]", b'{"data": 3}', b'{"object": "list"}', b"\xff\xfe", b"[" * 100_000]
)
def test_a_body_that_is_not_a_model_list_is_none(body: bytes) -> None:
    assert parse_model_list(body) is None


def test_odd_entries_are_skipped_not_fatal() -> None:
    body = json.dumps({"data": [3, {"id": 7}, {"id": "ok", "root": 5, "parent": ""}, {"no": "id"}]}).encode()
    assert parse_model_list(body) == [ModelCard("ok")]


def sample(endpoint: str, model: str, names: tuple[str, ...], *, up: bool = True) -> FeedSample:
    return FeedSample(
        "node", endpoint, model, ServerKind.VLLM, 0.1, 0.0, 1.0, 0.0, 1000, 1.0, up, served_names=names
    )


def test_served_names_travel_on_the_wire_and_are_bounded() -> None:
    s = sample("a:1", BASE, (BASE, ALIAS, "sql-lora"))
    assert from_proto(to_proto(s)) == s
    hostile = sample("a:1", BASE, ("", "x" * 257, "bad\nname", BASE, BASE, *(f"n{i}" for i in range(5000))))
    names = checked(hostile).served_names
    assert names[0] == BASE and len(names) == MAX_SERVED_NAMES
    assert "" not in names and "bad\nname" not in names and "x" * 257 not in names


def test_served_names_remember_until_forgotten_and_prefer_a_pools_own_name() -> None:
    served = ServedNames(forget_after=300.0)
    assert not served.listing and served.pool_of(ALIAS) is None
    served.observe(sample("a:1", BASE, (BASE, ALIAS, "sql-lora")), now=0.0)
    served.observe(sample("b:1", "qwen", ()), now=0.0)  # an engine that does not list
    served.observe(sample("c:1", "zz", ("zz", BASE, "sql-lora")), now=0.0)  # claims another pool's name
    assert served.listing
    assert served.pool_of(ALIAS) == BASE and served.pool_of("qwen") == "qwen"
    assert served.pool_of(BASE) == BASE and served.pool_of("sql-lora") == BASE  # first pool in order
    served.observe(sample("a:1", BASE, (), up=False), now=100.0)  # a failed scrape keeps the names
    assert served.pool_of(ALIAS) == BASE
    served.prune(now=301.0)
    assert served.pool_of(ALIAS) is None and served.pool_of("qwen") is None


FEED = {"exporters": ["127.0.0.1:1"]}


def resolve(config_doc: dict[str, object], samples: list[FeedSample], names: list[str]) -> list[str | None]:
    async def scenario() -> list[str | None]:
        config = parse_config(config_doc)
        runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: None)
        await runtime.apply(config.feedback, [BASE])
        try:
            assert runtime.loop is not None
            for s in samples:
                runtime.loop.subscriber.ingest(s)
            return [runtime.served_as(name, config.admission_rules) for name in names]
        finally:
            await runtime.stop()

    return asyncio.run(scenario())


LISTED = [sample("a:1", BASE, (BASE, ALIAS, "sql-lora"))]
NAMES = [BASE, ALIAS, "sql-lora", "gpt-4", "static-alias", "*"]
STATIC = {"models": {"*": {"context_window": 2048}, "static-alias": {"context_window": 2048, "pool": BASE}}}


def test_aliases_and_adapters_use_the_base_pool_and_unserved_names_are_refused() -> None:
    doc = {**STATIC, "feedback": FEED, "limits": {"models": {BASE: {"max_concurrency": 8}}}}
    assert resolve(doc, LISTED, NAMES) == [BASE, BASE, BASE, None, "static-alias", None]


def test_unserved_names_can_be_admitted_and_nothing_is_refused_before_an_engine_lists() -> None:
    doc = {**STATIC, "feedback": {**FEED, "unserved_models": "admit"}}
    assert resolve(doc, LISTED, NAMES) == [BASE, BASE, BASE, "gpt-4", "static-alias", "*"]
    unlisted = [sample("a:1", BASE, ())]  # an engine that does not list: the config decides, as before
    assert resolve({**STATIC, "feedback": FEED}, unlisted, NAMES) == [
        BASE,
        ALIAS,
        "sql-lora",
        "gpt-4",
        "static-alias",
        "*",
    ]


def test_unserved_models_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"feedback\.unserved_models"):
        parse_config({"feedback": {**FEED, "unserved_models": "maybe"}})
