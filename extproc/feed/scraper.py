"""Scrape one inference server's metrics page into feed samples, never raising for a bad target.

Used by the exporter and, for simple setups without an exporter, directly by the sidecar's subscriber.
A target that refuses, times out, answers non-200, sends more than `max_bytes` or garbage yields samples
with up=false and a short reason, so subscribers stop trusting it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from extproc.feed.parse import MetricsParseError, ServerKind, parse_metrics
from extproc.feed.sample import FeedSample
from extproc.feed.targets import Target

DEFAULT_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """Samples of one scrape; `reason` is None on success, else a short, bounded label value."""

    target: Target
    samples: list[FeedSample]
    duration: float
    reason: str | None = None
    error: str = ""


class Scraper:
    """Fetch + parse with a per-target timeout. Remembers the models seen per endpoint so a later failure
    is reported against those models (TGI/Triton pages name none, so targets there carry `model`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        node: str,
        *,
        timeout: float = 0.8,
        max_bytes: int = DEFAULT_MAX_BYTES,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._node = node
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._wall = wall_clock
        self._mono = monotonic
        self._models: dict[str, tuple[str, ...]] = {}

    def forget(self, target: Target) -> None:
        self._models.pop(target.endpoint, None)

    def known_models(self, target: Target) -> tuple[str, ...]:
        if target.model is not None:
            return (target.model,)
        return self._models.get(target.endpoint, ("",))

    async def scrape(self, target: Target) -> ScrapeResult:
        start = self._mono()
        try:
            async with asyncio.timeout(self._timeout):
                text = await self._fetch(target)
            signals = parse_metrics(text, target.kind, model=target.model)
        except TimeoutError:
            return self._down(target, start, "timeout", f"no answer within {self._timeout:g}s")
        except _HttpStatusError as exc:
            return self._down(target, start, "http_status", str(exc))
        except _TooLargeError as exc:
            return self._down(target, start, "too_large", str(exc))
        except MetricsParseError as exc:
            return self._down(target, start, "parse", str(exc)[:200])
        except (aiohttp.ClientError, OSError) as exc:
            return self._down(target, start, "connect", f"{type(exc).__name__}: {exc}"[:200])
        except UnicodeDecodeError:
            return self._down(target, start, "parse", "page is not UTF-8")
        duration = self._mono() - start
        now = self._wall()
        samples = [
            FeedSample.from_signals(self._node, target.endpoint, s, now, duration) for s in signals.values()
        ]
        self._models[target.endpoint] = tuple(sorted(signals))
        return ScrapeResult(target, samples, duration)

    async def _fetch(self, target: Target) -> str:
        async with self._session.get(
            target.url, headers={"Accept": "text/plain;version=0.0.4"}, allow_redirects=False
        ) as resp:
            if resp.status != 200:
                raise _HttpStatusError(f"HTTP {resp.status}")
            body = await resp.content.read(self._max_bytes + 1)
            if len(body) > self._max_bytes:
                raise _TooLargeError(f"page larger than {self._max_bytes} bytes")
            return body.decode("utf-8")

    def _down(self, target: Target, start: float, reason: str, error: str) -> ScrapeResult:
        duration = self._mono() - start
        now = self._wall()
        kind: ServerKind | None = target.kind
        samples = [
            FeedSample.down(self._node, target.endpoint, model, kind, f"{reason}: {error}", now, duration)
            for model in self.known_models(target)
        ]
        return ScrapeResult(target, samples, duration, reason, error)


class _HttpStatusError(Exception):
    pass


class _TooLargeError(Exception):
    pass
