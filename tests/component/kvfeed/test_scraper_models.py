"""Where the scraper gets the served model name when the page does not carry one (trtllm-serve's
`model_name="undefined"`, TGI's unlabelled page): the target's `model`, else the engine's `/v1/models`.
A pool is never named after a placeholder."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.scraper import Scraper
from extproc.kvfeed.targets import Target
from tests.support.metric_pages import DATA

from .fakes import FakeInferenceServer

UNDEFINED_PAGE = (DATA / "trtllm_serve_main_2026.txt").read_text().replace("Qwen3-8B", "undefined")
PATH = "/prometheus/metrics"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def served(page: str, path: str, models: list[str] | None) -> FakeInferenceServer:
    server = FakeInferenceServer(page, path, models)
    await server.start()
    return server


async def test_trtllm_placeholder_is_replaced_by_the_served_model(http: aiohttp.ClientSession) -> None:
    server = await served(UNDEFINED_PAGE, PATH, ["Qwen3-8B"])
    try:
        scraper = Scraper(http, "node-1", timeout=2.0)
        target = Target(server.url, ServerKind.TRTLLM)
        for _ in range(3):
            result = await scraper.scrape(target)
            assert result.reason is None, result.error
            [sample] = result.samples
            assert (sample.model, sample.up) == ("Qwen3-8B", True)
            assert sample.kv_capacity_tokens == 4096 * 32
        assert server.model_list_hits == 1  # asked once, then remembered for the endpoint
        assert scraper.known_models(target) == ("Qwen3-8B",)
    finally:
        await server.stop()


async def test_target_model_wins_without_asking(http: aiohttp.ClientSession) -> None:
    server = await served(UNDEFINED_PAGE, PATH, ["Qwen3-8B"])
    try:
        result = await Scraper(http, "n").scrape(Target(server.url, ServerKind.TRTLLM, model="qwen-pool"))
        assert [s.model for s in result.samples] == ["qwen-pool"]
        assert server.model_list_hits == 0
    finally:
        await server.stop()


@pytest.mark.parametrize("models", [None, [], ["undefined"]], ids=["404", "empty", "placeholder"])
async def test_no_usable_model_is_a_down_target_never_a_placeholder_pool(
    http: aiohttp.ClientSession, models: list[str] | None
) -> None:
    server = await served(UNDEFINED_PAGE, PATH, models)
    try:
        result = await Scraper(http, "n").scrape(Target(server.url))
        assert result.reason == "no_model"
        assert "set model on the target" in result.error
        assert all(not s.up and s.model != "undefined" for s in result.samples)
    finally:
        await server.stop()


async def test_tgi_page_gets_its_model_from_v1_models(http: aiohttp.ClientSession) -> None:
    server = await served((DATA / "tgi_3.3.7.txt").read_text(), "/metrics", ["mistralai/Mistral-7B-v0.3"])
    try:
        result = await Scraper(http, "n").scrape(Target(server.url))
        assert result.reason is None, result.error
        [sample] = result.samples
        assert sample.model == "mistralai/Mistral-7B-v0.3"
        assert sample.server_kind is ServerKind.TGI
        assert sample.kv_usage == pytest.approx(98_304 / 131_072)
    finally:
        await server.stop()


async def test_a_failing_endpoint_is_asked_again_after_it_returns(http: aiohttp.ClientSession) -> None:
    """A restarted server may serve another model: the remembered name is dropped when the page fails."""
    server = await served(UNDEFINED_PAGE, PATH, ["Qwen3-8B"])
    try:
        scraper = Scraper(http, "n", timeout=2.0)
        target = Target(server.url, ServerKind.TRTLLM)
        assert (await scraper.scrape(target)).reason is None
        server.mode = "500"
        assert (await scraper.scrape(target)).reason == "http_status"
        server.mode = "ok"
        server.models = ["Qwen3-14B"]
        result = await scraper.scrape(target)
        assert [s.model for s in result.samples] == ["Qwen3-14B"]
        assert server.model_list_hits == 2
    finally:
        await server.stop()


VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the page's model_name label: vLLM's first served name


class Mono:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_vllm_samples_carry_every_name_the_model_list_gives_refreshed_every_10s(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM 0.32.0 lists each --served-model-name (root: the model path), each LoRA adapter (parent: base)."""
    cards: list[dict[str, object]] = [
        {"id": VLLM_MODEL, "root": "/m/llama", "parent": None},
        {"id": "llama-8b", "root": "/m/llama", "parent": None},
        {"id": "sql-lora", "root": "/a/sql", "parent": VLLM_MODEL},
    ]
    server = FakeInferenceServer.from_file("vllm_0.33.0_dp2.txt", models=cards)
    await server.start()
    try:
        mono = Mono()
        scraper = Scraper(http, "n", timeout=2.0, monotonic=mono)
        target = Target(server.url, ServerKind.VLLM)

        async def names() -> tuple[str, ...]:
            result = await scraper.scrape(target)
            assert result.reason is None, result.error
            [sample] = result.samples
            return sample.served_names

        assert await names() == (VLLM_MODEL, "llama-8b", "sql-lora")
        cards.append({"id": "chat-lora", "root": "/a/chat", "parent": "llama-8b"})  # loaded at run time
        mono.now = 5.0
        assert await names() == (VLLM_MODEL, "llama-8b", "sql-lora")  # not asked again yet
        assert server.model_list_hits == 1
        mono.now = 10.5
        assert await names() == (VLLM_MODEL, "llama-8b", "sql-lora", "chat-lora")
        server.models = None  # the list fails (404): the last one read stays
        mono.now = 21.0
        assert await names() == (VLLM_MODEL, "llama-8b", "sql-lora", "chat-lora")
        assert server.model_list_hits == 3
    finally:
        await server.stop()


async def test_a_sample_is_stamped_when_its_page_was_read_not_after_the_model_list(
    http: aiohttp.ClientSession,
) -> None:
    """The page's values are the engine's when it was read; the model list read after it (up to the scrape
    timeout on a busy server) must not make the reading look later (a sidecar's charge tally places the
    counter at `sample_time`)."""
    server = FakeInferenceServer.from_file("vllm_0.33.0_dp2.txt", models=[{"id": VLLM_MODEL}])
    await server.start()
    try:
        scraper = Scraper(http, "n", timeout=2.0, wall_clock=lambda: 100.0 + 10 * server.model_list_hits)
        result = await scraper.scrape(Target(server.url, ServerKind.VLLM))
        assert result.reason is None, result.error
        assert server.model_list_hits == 1
        assert [s.sample_time for s in result.samples] == [100.0]
    finally:
        await server.stop()


async def test_engines_without_a_known_list_send_no_names(http: aiohttp.ClientSession) -> None:
    server = await served(UNDEFINED_PAGE, PATH, ["Qwen3-8B", "other"])
    try:
        result = await Scraper(http, "n").scrape(Target(server.url, ServerKind.TRTLLM, model="qwen"))
        assert [s.served_names for s in result.samples] == [()]
        assert server.model_list_hits == 0
    finally:
        await server.stop()
