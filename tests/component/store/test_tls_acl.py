"""A managed-Redis setup: TLS only (a generated CA and server certificate) and an ACL user limited to the
store's keys and channel, the password read from a file as a Kubernetes Secret would be mounted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.config import parse_config
from extproc.core.clock import monotonic
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.core.ports import StoreUnavailable
from extproc.store.factory import build_store
from extproc.store.redis import RedisStore
from extproc.store.redis.connection import Credentials, TlsOptions
from tests.component.store.certs import make_certificates
from tests.component.store.redis_server import RedisServer

PASSWORD = "s3cret-only-in-a-file"
USER = "extproc-user"
LIMITS = {"global": LimitSpec(max_concurrency=2, tokens_per_minute=6000)}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path, Path]]:
    """TLS only; the default user off; one user allowed the store's keys and channel only."""
    directory = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_certificates(directory)
    password_file = directory / "password"
    password_file.write_text(PASSWORD + "\n")
    acl = (
        "--user",
        "default",
        "off",
        "--user",
        USER,
        "on",
        f">{PASSWORD}",
        "~extproc:*",
        "&extproc:*",
        "+@all",
    )
    server = RedisServer(extra=acl, tls=(ca, cert, key))
    server.start()
    yield server, ca, password_file
    server.stop()


@pytest.fixture
async def store(secured: tuple[RedisServer, Path, Path]) -> AsyncIterator[RedisStore]:
    server, ca, password_file = secured
    store = RedisStore.from_url(
        server.url,
        tls=TlsOptions(ca_file=str(ca), verify="full"),
        credentials=Credentials(username=USER, password_file=str(password_file)),
        timeout_s=1.0,
    )
    await store.start()
    await store.apply_limits(LIMITS)
    yield store
    await store.close()


async def test_store_works_over_tls_as_an_acl_user(store: RedisStore) -> None:
    lease = await store.acquire(["global"], 100)
    assert isinstance(lease, Lease)
    assert (await store.status(["global"])).remaining_requests == 1
    assert await store.release(lease, 50) is True
    await store.set_scale("global", 0.5)  # the scale hash and the wake-up channel are allowed too
    assert store.effective_scale("global") == 0.5


async def test_wake_ups_reach_subscribers_over_tls(store: RedisStore) -> None:
    woken: list[int] = []
    store.on_wake(lambda: woken.append(1))
    await wait_for(lambda: bool(woken))  # the subscription's first look after connecting
    woken.clear()
    await store.wake.announce()
    lease = await store.acquire(["global"], 0)
    assert isinstance(lease, Lease)
    await store.release(lease, 0)
    await wait_for(lambda: store.wakeups > 0)


async def test_wrong_password_is_unavailable_and_never_logged(
    secured: tuple[RedisServer, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, ca, _ = secured
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password-xyz")
    caplog.set_level(logging.DEBUG)
    store = RedisStore.from_url(
        server.url,
        tls=TlsOptions(ca_file=str(ca)),
        credentials=Credentials(username=USER, password_file=str(wrong)),
        timeout_s=1.0,
    )
    await store.start()
    try:
        with pytest.raises(StoreUnavailable):
            await store.acquire(["global"], 0)
    finally:
        await store.close()
    assert "not-the-password-xyz" not in caplog.text and PASSWORD not in caplog.text


async def test_untrusted_server_certificate_is_refused(secured: tuple[RedisServer, Path, Path]) -> None:
    server, _, password_file = secured
    store = RedisStore.from_url(
        server.url,
        tls=TlsOptions(verify="full"),  # the system CAs do not know the test CA
        credentials=Credentials(username=USER, password_file=str(password_file)),
        timeout_s=1.0,
    )
    await store.start()
    try:
        with pytest.raises(StoreUnavailable):
            await store.acquire(["global"], 0)
    finally:
        await store.close()


async def test_config_builds_the_same_store(
    secured: tuple[RedisServer, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From `store.redis.*` (password from the environment this time) through the factory."""
    server, ca, _ = secured
    monkeypatch.setenv("EXTPROC_TEST_REDIS_PASSWORD", PASSWORD)
    redis_section: dict[str, Any] = {
        "url": server.url,
        "username": USER,
        "password_env": "EXTPROC_TEST_REDIS_PASSWORD",
        "tls": {"ca_file": str(ca), "verify": "full"},
        "timeout_ms": 1000,
    }
    config = parse_config({"store": {"backend": "redis", "on_unavailable": "reject", "redis": redis_section}})
    store = build_store(config.store, monotonic)
    assert isinstance(store, RedisStore)
    await store.start()
    try:
        await store.apply_limits(LIMITS)
        assert isinstance(await store.acquire(["global"], 0), Lease)
    finally:
        await store.close()


async def wait_for(check: Any, limit_s: float = 5.0) -> None:
    deadline = monotonic() + limit_s
    while True:
        if check():
            return
        assert monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
