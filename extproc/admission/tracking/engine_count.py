"""An admitted request's run in its pool's engine tally, and the engines' count of an answer nobody saw.

`InFlight` holds one `EngineRun` from admission: it tells the pool's `EngineTally` (core/engine_tally.py)
when the request began and when the engine was done with it, so that the others counted beside it are
split by the time each ran as this sidecar saw them; and, where nothing of its answer came back, `count`
waits for the feed to read the engines past its end and gives its share of what they generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Hashable

from extproc.core.engine_tally import EngineTally

ENGINE_STOP_S = 0.5
"""How long after a request ended on the proxy its engine's counter may still grow for it: the abort reaches
vLLM's engine core between two steps (`decode_rate.STEPS_PAST_ABORT`), and its API server counts a step's
tokens as it hands the step's outputs on (vllm 0.32.0 vllm/v1/engine/async_llm.py, `output_handler`, which
records each batch of outputs into `vllm:generation_tokens_total`): tens of milliseconds on a GPU, a few
hundred on a busy CPU host. A count waits for a reading this long after the end."""

ENGINE_COUNT_WAIT_S = 5.0
"""The longest a lease whose answer nobody saw waits for that reading before it is charged the pace estimate
instead: past the exporter's shipped 1 s interval, its scrape and `ENGINE_STOP_S`, several times over."""


class EngineRun:
    """One request's `sequences` in its pool's tally from `start` (None: the pool has no tally)."""

    def __init__(self, tally: EngineTally | None, key: Hashable, start: float, sequences: int) -> None:
        self.tally = tally
        self.key = key
        self.start = start
        self.sequences = sequences
        if tally is not None:
            tally.begin(key, start, sequences)

    def end(self, at: float) -> None:
        """The engine is done with the request (it ended on the proxy, settled, or the feed found it done);
        the first call only counts."""
        if self.tally is not None:
            self.tally.end(self.key, at)

    def countable(self) -> bool:
        """Whether the tally reaches back to the request's start: its count can then be had."""
        return self.tally is not None and self.tally.reaches_back(self.start)

    def count(self, stop: float) -> Awaitable[float | None]:
        """The tokens the engines generated for the request, which ended on the proxy at `stop`: once the
        feed has read them `ENGINE_STOP_S` past it, at most `ENGINE_COUNT_WAIT_S` later; None where no such
        reading came (the feed stopped, or is slower than that). The wait is registered now."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.tally is not None:
            self.tally.after(stop + ENGINE_STOP_S, functools.partial(_resolve, ready))
        return self._counted(stop, ready)

    async def _counted(self, stop: float, ready: asyncio.Future[None]) -> float | None:
        tally = self.tally
        if tally is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ready, ENGINE_COUNT_WAIT_S)
        if not tally.covers(stop + ENGINE_STOP_S):
            return None
        return tally.count(self.start, stop, self.sequences, ENGINE_STOP_S, self.key)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
