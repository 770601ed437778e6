"""A reloaded tenant table is rebuilt a chunk at a time, the event loop turning between the chunks and
Python's cyclic collector left as it was found (extproc/config/load.py's `_with_tenants`)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from extproc.config import load as loading
from extproc.config import parse_config


@pytest.fixture
def collector_restored() -> Iterator[None]:
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def tenants(count: int) -> dict[str, dict[str, int]]:
    return {f"t{i}": {"max_concurrency": 1 + i} for i in range(count)}


@pytest.mark.parametrize("enabled", [True, False])
async def test_each_chunk_has_its_turn_and_the_collector_is_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch, collector_restored: None, enabled: bool
) -> None:
    monkeypatch.setattr(loading, "TENANT_CHUNK", 2)
    config = parse_config({"limits": {"tenants": tenants(7)}})
    bare, chunks = loading._split_tenants(config)
    assert len(chunks) == 4 and bare.limits.tenants == {}
    if enabled:
        gc.enable()
    else:
        gc.disable()
    seen_paused: list[bool] = []

    async def ticker() -> None:
        while True:
            seen_paused.append(not gc.isenabled())
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    seen_paused.clear()
    try:
        whole = await loading._with_tenants(bare, chunks)
    finally:
        task.cancel()
    assert whole.limits.tenants == config.limits.tenants
    assert whole.admission_rules.split_keys == config.admission_rules.split_keys
    assert len(seen_paused) >= len(chunks)  # the loop turned between the chunks
    assert all(seen_paused[: len(chunks)])  # with the collector off while the table grew
    assert gc.isenabled() is enabled


async def test_the_collector_comes_back_when_a_chunk_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch, collector_restored: None
) -> None:
    monkeypatch.setattr(loading, "TENANT_CHUNK", 2)
    bare, chunks = loading._split_tenants(parse_config({"limits": {"tenants": tenants(5)}}))
    gc.enable()
    with pytest.raises(Exception):  # noqa: B017 - whatever unpickling a cut chunk raises
        await loading._with_tenants(bare, [chunks[0], chunks[1][:5]])
    assert gc.isenabled()
