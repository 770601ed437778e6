"""Scrape one inference server's metrics page into feed samples, never raising for a bad target.

Used by the exporter and, for simple setups without an exporter, directly by the sidecar's subscriber.
A target that refuses, times out, answers non-200, sends more than `max_bytes` (8 MiB), a page cut short,
garbage or a reading no server can have (`sample.checked`) yields samples with up=false and a short reason,
so subscribers stop trusting it at once.

The page is read to its end as it arrives (a page over the network comes in many reads, and a big one of
many models and adapters runs to megabytes), through `PageFilter`, which keeps only the lines the parser
reads. Past `max_bytes` the scrape fails (`too_large`) at once; a body shorter than its framing says
(`Content-Length`, chunked encoding) fails as `incomplete`, so no partial page is ever parsed.

For engines whose model list is known (`EngineProfile.served_names_path`: vLLM), the list is read every
`LIST_REFRESH_S` (10 s) per endpoint, after the page and under its own timeout, and every sample carries the
names its pool is served under (`listing.names_by_pool`: aliases, LoRA adapters). A list that cannot be
read keeps the last one read; an endpoint that fails is asked again when it returns.

Every sample of an endpoint that was scraped before carries its decode pace since then (`kvfeed.pace`: the
generation-token counter's growth per running sequence and second, on the scraper's monotonic clock); a
failed scrape drops the endpoint's baseline.

The served model name (the pool a sample belongs to) comes from the target's `model`, else from the
page's model label. When the page has none (TGI) or only a placeholder (trtllm-serve's
`model_name="undefined"`), the engine's OpenAI `/v1/models` on the same host:port is asked once and the
first model id is remembered for the endpoint until the endpoint fails or is forgotten. A pool is never
named after a placeholder.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from extproc.kvfeed.engines import PROFILES, EngineProfile, ServerKind
from extproc.kvfeed.listing import names_by_pool, parse_model_list
from extproc.kvfeed.pace import EnginePaceMeter
from extproc.kvfeed.parse import MetricsParseError, ModelNameMissing, ModelSignals, PageFilter, parse_metrics
from extproc.kvfeed.sample import MAX_MODEL_NAME, FeedSample, checked
from extproc.kvfeed.targets import Target

# The largest metrics page read: 8 MiB, about 140 times a real vLLM 0.32 page (~58 KB) and room for pages of
# many models, LoRA adapters and histograms (a 4 MB page is read whole).
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_MODELS_MAX_BYTES = 1024 * 1024
LIST_REFRESH_S = 10.0  # adapters are loaded and unloaded at run time (vLLM's /v1/load_lora_adapter)


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """Samples of one scrape; `reason` is None on success, else a short, bounded label value."""

    target: Target
    samples: list[FeedSample]
    duration: float
    reason: str | None = None
    error: str = ""
    page_bytes: int = 0  # bytes of the metrics page read (up to the bound)


class Scraper:
    """Fetch + parse with a per-target timeout. Remembers the models seen per endpoint so a later failure
    is reported against those models, and the model name learnt from `/v1/models` per endpoint."""

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
        self._api_models: dict[str, str] = {}
        self._listings: dict[str, tuple[float, dict[str, tuple[str, ...]]]] = {}  # endpoint: (read at, names)
        self._pace = EnginePaceMeter()

    def forget(self, target: Target) -> None:
        self._models.pop(target.endpoint, None)
        self._api_models.pop(target.endpoint, None)
        self._listings.pop(target.endpoint, None)
        self._pace.forget(target.endpoint)

    def known_models(self, target: Target) -> tuple[str, ...]:
        if target.model is not None:
            return (target.model,)
        return self._models.get(target.endpoint, ("",))

    async def scrape(self, target: Target) -> ScrapeResult:
        start = self._mono()
        page = _Page()
        try:
            async with asyncio.timeout(self._timeout):
                read_at = await self._fetch(target, page)
                signals = await self._parse(target, page.text())
        except TimeoutError:
            return self._down(target, start, "timeout", f"no answer within {self._timeout:g}s", page)
        except _HttpStatusError as exc:
            return self._down(target, start, "http_status", str(exc), page)
        except _TooLargeError as exc:
            return self._down(target, start, "too_large", str(exc), page)
        except _NoModelError as exc:
            return self._down(target, start, "no_model", str(exc)[:200], page)
        except MetricsParseError as exc:
            return self._down(target, start, "parse", str(exc)[:200], page)
        except aiohttp.ClientPayloadError as exc:
            return self._down(target, start, "incomplete", f"page cut short: {exc}"[:200], page)
        except (aiohttp.ClientError, OSError) as exc:
            return self._down(target, start, "connect", f"{type(exc).__name__}: {exc}"[:200], page)
        except UnicodeDecodeError:
            return self._down(target, start, "parse", "page is not UTF-8", page)
        served = await self._served_names(target, signals)
        return self._up(target, start, read_at, signals, page, served)

    def _up(
        self,
        target: Target,
        start: float,
        read_at: tuple[float, float],
        signals: dict[str, ModelSignals],
        page: _Page,
        served: dict[str, tuple[str, ...]],
    ) -> ScrapeResult:
        """Samples of a parsed page; one holding an impossible reading is sent down (reason `invalid`). Each
        is stamped when the page had been read, not after its parsing and the model list's read: its values
        are the engine's then (a sidecar's charge tally places the counter there: `readtime.py`): `read_at`,
        on the monotonic and the wall clock (`_fetch`)."""
        done, now = read_at
        duration = self._mono() - start
        samples = [
            checked(
                FeedSample.from_signals(
                    self._node,
                    target.endpoint,
                    s,
                    now,
                    duration,
                    served.get(s.model, ()),
                    self._pace.observe(
                        (target.endpoint, s.model), s.generation_tokens_total, s.requests_running, done
                    ),
                )
            )
            for s in signals.values()
        ]
        self._models[target.endpoint] = tuple(sorted(signals))
        bad = [s.error for s in samples if not s.up]
        if bad:
            return ScrapeResult(target, samples, duration, "invalid", bad[0][:200], page.size)
        return ScrapeResult(target, samples, duration, page_bytes=page.size)

    async def _parse(self, target: Target, text: str) -> dict[str, ModelSignals]:
        """Signals per model; asks the engine's `/v1/models` when neither target nor page names one."""
        model = target.model or self._api_models.get(target.endpoint)
        try:
            return parse_metrics(text, target.kind, model=model)
        except ModelNameMissing as exc:
            if exc.profile.model_api_path is None:
                raise _NoModelError(str(exc)) from None
            name = await self._lookup_model(target, exc.profile, exc.profile.model_api_path)
            self._api_models[target.endpoint] = name
            return parse_metrics(text, exc.profile.kind, model=name)

    async def _served_names(
        self, target: Target, signals: dict[str, ModelSignals]
    ) -> dict[str, tuple[str, ...]]:
        """Names per pool from the engine's model list, read again every LIST_REFRESH_S; the last list
        read (or none) when it cannot be read now. Never raises."""
        kind = next(iter(signals.values())).kind if signals else target.kind
        path = PROFILES[kind].served_names_path if kind is not None else None
        if path is None:
            return {}
        read_at, names = self._listings.get(target.endpoint, (None, {}))
        now = self._mono()
        if read_at is not None and now - read_at < LIST_REFRESH_S and set(names) == set(signals):
            return names
        body = bytearray()
        try:
            async with asyncio.timeout(self._timeout):
                async with self._session.get(target.sibling_url(path), allow_redirects=False) as resp:
                    if resp.status != 200:
                        return names
                    await read_bounded(resp, _MODELS_MAX_BYTES, body.extend)
        except (TimeoutError, aiohttp.ClientError, OSError, _TooLargeError):
            return names
        cards = parse_model_list(bytes(body))
        if cards is None:
            return names
        names = names_by_pool(cards, list(signals))
        self._listings[target.endpoint] = (now, names)
        return names

    async def _lookup_model(self, target: Target, profile: EngineProfile, path: str) -> str:
        """The first model id of the engine's OpenAI model list (one model per server in practice)."""
        url = target.sibling_url(path)
        why = f"the {profile.title} page names no served model and {url}"
        body = bytearray()
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise _NoModelError(f"{why} answered HTTP {resp.status}: set model on the target")
                await read_bounded(resp, _MODELS_MAX_BYTES, body.extend)
        except (aiohttp.ClientError, OSError, _TooLargeError) as exc:
            raise _NoModelError(f"{why} failed ({type(exc).__name__}): set model on the target") from None
        name = _first_model_id(bytes(body))
        if name is None or name in profile.placeholder_models:
            raise _NoModelError(f"{why} lists no usable model id: set model on the target")
        return name

    async def _fetch(self, target: Target, page: _Page) -> tuple[float, float]:
        """The page into `page`; when it had been read whole, on the monotonic and the wall clock."""
        async with self._session.get(
            target.url, headers={"Accept": "text/plain;version=0.0.4"}, allow_redirects=False
        ) as resp:
            if resp.status != 200:
                raise _HttpStatusError(f"HTTP {resp.status}")
            await read_bounded(resp, self._max_bytes, page.feed)
        return self._mono(), self._wall()

    def _down(self, target: Target, start: float, reason: str, error: str, page: _Page) -> ScrapeResult:
        if reason in ("connect", "timeout", "http_status"):
            self._api_models.pop(target.endpoint, None)  # a restarted server may serve another model
            self._listings.pop(target.endpoint, None)
        self._pace.forget(target.endpoint)  # an engine that failed may come back with a fresh counter
        duration = self._mono() - start
        now = self._wall()
        kind: ServerKind | None = target.kind
        samples = [
            FeedSample.down(self._node, target.endpoint, model, kind, f"{reason}: {error}", now, duration)
            for model in self.known_models(target)
        ]
        return ScrapeResult(target, samples, duration, reason, error, page.size)


class _Page(PageFilter):
    """The page being read, and how many bytes of it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        super().feed(chunk)


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, sink: Callable[[bytes], None]) -> int:
    """Hand the whole body to `sink` chunk by chunk as it arrives; the byte count read.

    Raises `_TooLargeError` as soon as the body (or its announced `Content-Length`) passes `limit`, and
    aiohttp's `ClientPayloadError` when the body ends before its framing says it does.
    """
    if resp.content_length is not None and resp.content_length > limit:
        raise _TooLargeError(f"page of {resp.content_length} bytes is over the {limit}-byte bound")
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _TooLargeError(f"page larger than the {limit}-byte bound")
        sink(chunk)
    return size


def _first_model_id(body: bytes) -> str | None:
    """`data[0].id` of an OpenAI model list, if it is a plausible model name."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    name = first.get("id") if isinstance(first, dict) else None
    if isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME and name.isprintable():
        return name
    return None


class _HttpStatusError(Exception):
    pass


class _NoModelError(Exception):
    pass


class _TooLargeError(Exception):
    pass
