"""The engine tier's flood of streams left after three chunks: clients that open a long streamed answer,
read three chunks and leave, one after another. The one-gateway charges test
(tests/engine/test_charges_engine.py) and the fleet of two (tests/engine/test_fleet_engine.py) send the same
one."""

from __future__ import annotations

import time

import openai

from tests.support.engine import MODEL

LONG_ANSWER = 1000
"""An answer long enough that every client here leaves before the engine would end it, short enough that
eight of them fit the KV budget (a warm-up answered in full teaches it to book the whole allowance)."""
FLOOD_S, FLOOD_CLIENTS = 12.0, 4
"""Four clients for 12 s."""


def leave_after_three(url: str, deadline: float) -> tuple[int, int]:
    """Streams left after three chunks, one after another until `deadline`: how many were answered, and how
    many chunks with text the client read (a token or more each)."""
    answered = passed = 0
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        while time.monotonic() < deadline:
            try:
                stream = c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Complete line {answered}."}],
                    max_tokens=LONG_ANSWER,
                    stream=True,
                )
            except openai.RateLimitError:
                time.sleep(0.5)
                continue
            for i, chunk in enumerate(stream):
                passed += sum(1 for choice in chunk.choices if choice.delta.content)
                if i == 3:
                    break
            stream.close()
            answered += 1
    return answered, passed
