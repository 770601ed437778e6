"""The engine tier's flood of streams left after three chunks: clients that open a long streamed answer,
read three chunks and leave, one after another. The one-gateway charges test
(tests/engine/test_charges_engine.py) and the fleet of two (tests/engine/test_fleet_engine.py) send the same
one."""

from __future__ import annotations

import time
from dataclasses import dataclass

import openai

from extproc.admission.replies.refusals import REASON_HEADER
from tests.support.engine import MODEL

LONG_ANSWER = 1000
"""An answer long enough that every client here leaves before the engine would end it, short enough that
eight of them fit the KV budget (a warm-up answered in full teaches it to book the whole allowance)."""
FLOOD_S, FLOOD_CLIENTS = 12.0, 4
"""Four clients for 12 s."""


@dataclass
class Leaves:
    """One client's part of a flood."""

    answered: int
    passed: int
    """Chunks with text the client read (a token or more each)."""
    reset: int
    """Requests Envoy answered 503 without a sidecar's reason: the engine closed their connection before it
    answered (Envoy's `UC upstream_reset_before_response_started{connection_termination}`). Once in a
    clean-clone CI run vLLM closed one 4.4 s after the request was written, its API server on a host whose
    two cores its decoding held; Envoy retries only a reset before the request is written
    (envoy/envoy.yaml, Retries), so a prompt is never run twice. The host's, not the product's: a flood with
    one is run again."""


def leave_after_three(url: str, deadline: float) -> Leaves:
    """Streams left after three chunks, one after another until `deadline`."""
    answered = passed = reset = 0
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
            except openai.InternalServerError as err:
                if err.status_code != 503 or REASON_HEADER in err.response.headers:
                    raise
                reset += 1
                continue
            for i, chunk in enumerate(stream):
                passed += sum(1 for choice in chunk.choices if choice.delta.content)
                if i == 3:
                    break
            stream.close()
            answered += 1
    return Leaves(answered, passed, reset)
