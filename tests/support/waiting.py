"""Bounded polls for a condition another task or process brings about. Tests that inject a clock need none
of these; they are for real sockets and processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(check: Any, limit_s: float = 5.0) -> None:
    """Wait until `check()` holds; raise if it does not within `limit_s`."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        if check():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def poll(check: Callable[[], Awaitable[bool]], within: float = 15.0, interval: float = 0.02) -> None:
    """Wait until `check()` is true or fail after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(interval)


async def until(check: Callable[[], bool], limit_s: float) -> None:
    """Wait for `check` up to `limit_s`; the assertions after it say what was expected."""
    deadline = time.monotonic() + limit_s
    while True:
        if check() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


def wait_for(check: Any, limit_s: float, what: str) -> float:
    """Seconds until `check` held, measured to the start of the successful check (scrape time excluded)."""
    start = time.monotonic()
    while True:
        probe = time.monotonic()
        if check():
            return probe - start
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"{what}: not within {limit_s}s")
        time.sleep(0.02)
