"""Each refusal for capacity or service is what docs/admission.md's refusal table says: its status, its
OpenAI `type` and `code`, and the headers clients back off by. A KV-budget 429 is typed `kv_cache` (not the
`tokens` of a TPM limit that did not refuse it), and every 429 carries the `x-ratelimit-*` headers a slot
refusal does, since OpenAI sends them on every 429."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from extproc.admission.replies import refusals
from extproc.admission.replies.headers import ratelimit_headers
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary.names import RATELIMIT_REQUEST_HEADERS, RATELIMIT_TOKEN_HEADERS
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection

DOC = Path(__file__).resolve().parents[4] / "docs" / "admission.md"
STATUS = RateLimitStatus(
    limit_requests=8,
    remaining_requests=0,
    reset_requests_s=2.0,
    limit_tokens=6000,
    remaining_tokens=120,
    reset_tokens_s=30.0,
)
"""The limiter's view of a request's keys: a slot and a TPM limit, so every `x-ratelimit-*` pair shows."""
RATELIMIT = {*RATELIMIT_REQUEST_HEADERS, *RATELIMIT_TOKEN_HEADERS}
NOT_LISTED = {"content-type", refusals.REASON_HEADER}
"""Headers every refusal has, which the table's last column leaves out."""


def limited(reason: Reason, key: str, retry_after_s: float | None) -> Refusal:
    return refusals.rate_limited(Rejection(reason, key, retry_after_s, STATUS), "m", 500)


BUILDERS: dict[str, Callable[[], Refusal]] = {
    "concurrency": lambda: limited(Reason.CONCURRENCY, "model:m", 2.0),
    "tokens": lambda: limited(Reason.TOKENS, "global", 30.0),
    "input_tokens": lambda: limited(Reason.INPUT_TOKENS, "input:tenant:a", 30.0),
    "output_tokens": lambda: limited(Reason.OUTPUT_TOKENS, "output:tenant:a", 30.0),
    "request_exceeds_token_limit": lambda: limited(Reason.TOO_LARGE, "global", None),
    "kv_budget": lambda: refusals.kv_budget("m", 4000, 100, 3.0, STATUS),
    "queue_full": lambda: refusals.queue_refused("queue_full", "batch", 10.0, status=STATUS),
    "queue_timeout": lambda: refusals.queue_refused("queue_timeout", "batch", 10.0, status=STATUS),
    "deadline_unmet": lambda: refusals.deadline_unmet("interactive", 500, 2.0, STATUS),
    "tokenizer_busy": lambda: refusals.tokenizer_busy(0.25, STATUS),
    "store_unavailable": refusals.store_unavailable,
    "engine_busy": lambda: refusals.engine_busy(2.0, ratelimit_headers(STATUS)),
    "engine_down": lambda: refusals.engine_down("m", refusals.engine_down_retry_after(12.0)),
}
"""Each reason's refusal as its caller builds it: the limiter's status wherever the caller has one."""


def documented_rows() -> dict[str, tuple[int, str, str, set[str]]]:
    """docs/admission.md's refusal table: reason → (status, type, code, header names besides the reason)."""
    text = DOC.read_text()
    section = text[text.index("## Refusals (`refusals.py`)") :]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, tuple[int, str, str, set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].isdigit():
            continue
        names: set[str] = set()
        for span in re.findall(r"`([^`]+)`", cells[4]):
            name = span.split(":")[0]
            names |= RATELIMIT if name == "x-ratelimit-*" else {name}
        (kind,) = re.findall(r"`([^`]+)`", cells[2])
        (code,) = re.findall(r"`([^`]+)`", cells[3])
        for reason in re.findall(r"`([^`]+)`", cells[0]):
            rows[reason] = (int(cells[1]), kind, code, names)
    return rows


ROWS = documented_rows()


def test_the_table_names_every_refusal_built_here() -> None:
    assert sorted(ROWS) == sorted(BUILDERS)


@pytest.mark.parametrize("reason", sorted(BUILDERS))
def test_each_refusal_is_as_the_table_says(reason: str) -> None:
    refusal = BUILDERS[reason]()
    status, kind, code, names = ROWS[reason]
    error = json.loads(refusal.body)["error"]
    assert (refusal.status, refusal.reason, error["type"], error["code"]) == (status, reason, kind, code)
    assert error["param"] is None
    headers = dict(refusal.all_headers)
    assert headers[refusals.REASON_HEADER] == reason
    assert set(headers) - NOT_LISTED == names


def test_a_kv_budget_refusal_is_typed_apart_from_a_tpm_refusal() -> None:
    """Same status, code and reason label as before; only the type tells it from a TPM limit's."""
    kv = refusals.kv_budget("m", 4000, 100, 3.0)
    tpm = limited(Reason.TOKENS, "global", 30.0)
    kv_error, tpm_error = json.loads(kv.body)["error"], json.loads(tpm.body)["error"]
    assert (kv.status, kv.reason, kv_error["code"]) == (429, "kv_budget", "rate_limit_exceeded")
    assert kv.details == "extproc_rate_limited_kv_budget"
    assert kv_error["type"] == "kv_cache" != tpm_error["type"] == "tokens"


def test_a_kv_budget_refusal_carries_the_rate_limit_headers_a_slot_refusal_does() -> None:
    kv = dict(refusals.kv_budget("m", 4000, 100, 3.0, STATUS).headers)
    slot = dict(limited(Reason.CONCURRENCY, "model:m", 2.0).headers)
    shown = {name: kv[name] for name in RATELIMIT}
    assert shown == {name: slot[name] for name in RATELIMIT}
    assert shown["x-ratelimit-remaining-requests"] == "0" and shown["x-ratelimit-limit-tokens"] == "6000"
    assert (kv["retry-after"], kv["retry-after-ms"]) == ("3", "3000")  # the budget's forecast, not the slot's


def test_a_kv_budget_refusal_without_a_status_sends_its_retry_headers_alone() -> None:
    headers = dict(refusals.kv_budget("m", 4000, 100, 3.0).headers)
    assert set(headers) == {"retry-after", "retry-after-ms", refusals.REASON_HEADER}


@pytest.mark.parametrize(
    ("down_for_s", "hint_s"),
    [(None, 1.0), (0.0, 1.0), (2.0, 1.0), (4.0, 1.0), (12.0, 3.0), (40.0, 10.0), (3600.0, 10.0)],
)
def test_an_engine_down_hint_is_a_quarter_of_the_outage_between_1_and_10_s(
    down_for_s: float | None, hint_s: float
) -> None:
    assert refusals.engine_down_retry_after(down_for_s) == pytest.approx(hint_s)


def test_an_engine_down_refusal_is_told_apart_from_the_gateways_own_503s() -> None:
    """The sidecar away (Envoy's mapper) and its store away say `service_unavailable`; an engine outage says
    `engine_unavailable`, with its own reason, so neither a client nor an operator reads it as theirs."""
    down = refusals.engine_down("llama", 3.0)
    error = json.loads(down.body)["error"]
    assert (down.status, error["code"], down.reason) == (503, "engine_unavailable", "engine_down")
    assert "llama" in error["message"] and "3s" in error["message"]
    store = json.loads(refusals.store_unavailable().body)["error"]
    assert store["code"] != error["code"]
    assert dict(down.headers)["retry-after"] == "3"
