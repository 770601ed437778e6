"""Big metrics pages arriving in many small writes are read whole; past the bound, or cut short, never read.

A fault run found that the scraper parsed whatever arrived in its first read: legal pages of 200 KB, 1 MB
and 4 MB (many models, LoRA adapters, histograms) failed mid-line, so a healthy pool went stale, and a
100 MB page was published as fresh from its first chunk. Here the served page puts the filler first and
the series the feed reads last, so only a page read to its end yields them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.exporter.app import Exporter, ExporterConfig
from extproc.kvfeed.scraper import DEFAULT_MAX_BYTES, Scraper, ScrapeResult
from extproc.kvfeed.targets import Target
from tests.support.metric_pages import DATA

from .fakes import TrickleServer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TAIL = (DATA / "vllm_0.33.0_dp2.txt").read_bytes()  # KV 0.81, waiting 4, capacity 2 x 237,792


def big_page(size: int) -> bytes:
    """A legal vLLM page of about `size` bytes: LoRA-adapter histogram buckets, then the real page."""
    lines = []
    total = len(TAIL)
    i = 0
    while total < size:
        line = (
            f'vllm:request_prompt_tokens_bucket{{engine="0",model_name="{MODEL}",'
            f'lora_name="adaptér-{i // 12}",le="{2 ** (i % 12)}.0"}} {i}.0\n'
        ).encode()
        lines.append(line)
        total += len(line)
        i += 1
    return b"".join(lines) + TAIL


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def scrape(server: TrickleServer, http: aiohttp.ClientSession) -> ScrapeResult:
    await server.start()
    try:
        return await Scraper(http, "n", timeout=30.0).scrape(Target(server.url, ServerKind.VLLM))
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("size", "chunk"), [(200_000, 101), (1_000_000, 997), (4_000_000, 4093)], ids=["200KB", "1MB", "4MB"]
)
@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_legal_big_pages_in_small_writes_are_read_whole(
    http: aiohttp.ClientSession, size: int, chunk: int, framing: str
) -> None:
    page = big_page(size)
    length = len(page) if framing == "content-length" else None
    result = await scrape(TrickleServer(page, chunk, length=length), http)
    assert result.reason is None, result.error
    [sample] = result.samples
    assert sample.up and sample.model == MODEL
    assert sample.kv_usage == pytest.approx(0.81) and sample.requests_waiting == 4
    assert sample.kv_capacity_tokens == 2 * 237_792
    assert result.page_bytes == len(page)


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_page_over_the_bound_fails_the_scrape(http: aiohttp.ClientSession, framing: str) -> None:
    page = big_page(DEFAULT_MAX_BYTES + 100_000)
    length = len(page) if framing == "content-length" else None
    result = await scrape(TrickleServer(page, 65_536, length=length), http)
    assert result.reason == "too_large"
    assert "8388608-byte bound" in result.error
    assert all(not s.up for s in result.samples)


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_page_cut_short_is_never_published(http: aiohttp.ClientSession, framing: str) -> None:
    page = big_page(300_000)
    cut = len(page) - len(TAIL) // 2  # after the KV line, before the rest: a fresh-looking partial page
    length = len(page) if framing == "content-length" else None
    result = await scrape(TrickleServer(page, 997, length=length, cut_after=cut), http)
    assert result.reason == "incomplete", result.error
    assert all(not s.up for s in result.samples)


async def test_the_exporter_counts_an_oversized_page_and_shows_page_sizes() -> None:
    small = TrickleServer(big_page(200_000), 4093)
    huge = TrickleServer(big_page(DEFAULT_MAX_BYTES + 100_000), 65_536)
    await small.start()
    await huge.start()
    cfg = ExporterConfig(
        node_name="n",
        targets=[Target(small.url, ServerKind.VLLM), Target(huge.url, ServerKind.VLLM)],
        grpc_host="127.0.0.1",
        grpc_port=0,
        metrics_port=None,
        scrape_interval=60.0,
        scrape_timeout=30.0,
    )
    exporter = Exporter(cfg)
    await exporter.start()
    try:
        await exporter.scrape_once()
        reg = exporter.registry
        small_t, huge_t = f"127.0.0.1:{small.port}", f"127.0.0.1:{huge.port}"
        errors = "extproc_exporter_scrape_errors_total"
        assert reg.get_sample_value(errors, {"target": huge_t, "reason": "too_large"}) >= 1  # type: ignore[operator]
        assert reg.get_sample_value(errors, {"target": small_t, "reason": "too_large"}) is None
        assert reg.get_sample_value("extproc_exporter_page_bytes", {"target": small_t}) == len(small.page)
        assert reg.get_sample_value("extproc_exporter_targets_up") == 1
    finally:
        await exporter.stop()
        await small.stop()
        await huge.stop()
