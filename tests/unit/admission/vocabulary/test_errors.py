"""The error envelope must match OpenAI's byte for byte in shape, since SDKs index its keys directly."""

from __future__ import annotations

import json

from extproc.admission.replies import refusals
from extproc.admission.vocabulary.errors import AdmissionError, error_body
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection


def test_error_body_has_all_four_keys_with_nulls() -> None:
    body = json.loads(error_body("bad", type="invalid_request_error"))
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}


def test_error_body_carries_code_and_param() -> None:
    raw = error_body(
        "too long", type="invalid_request_error", code="context_length_exceeded", param="messages"
    )
    assert raw == (
        b'{"error":{"message":"too long","type":"invalid_request_error",'
        b'"param":"messages","code":"context_length_exceeded"}}'
    )


def test_error_body_is_valid_utf8_even_with_lone_surrogate() -> None:
    raw = error_body("bad field '\ud800'", type="invalid_request_error")
    assert json.loads(raw.decode("utf-8"))["error"]["message"] == "bad field '\ud800'"


def test_admission_error_fields_and_body() -> None:
    err = AdmissionError(413, "too big", code="request_too_large", param=None)
    assert (err.status, err.message, err.type, err.code, err.param) == (
        413,
        "too big",
        "invalid_request_error",
        "request_too_large",
        None,
    )
    assert str(err) == "too big"
    assert json.loads(err.body())["error"]["code"] == "request_too_large"


def test_a_split_limit_refusal_names_its_bucket() -> None:
    """`x-extproc-reject-reason: input_tokens` / `output_tokens`, the retry-after of that bucket, and the
    scope
    of the key it splits; a request larger than a split limit says which."""
    status = RateLimitStatus(limit_tokens=300, remaining_tokens=100)
    refusal = refusals.rate_limited(
        Rejection(Reason.OUTPUT_TOKENS, "output:tenant:a", 30.0, status), "m", 500
    )
    headers = dict(refusal.headers)
    assert refusal.status == 429 and refusal.reason == "output_tokens"
    assert headers["x-extproc-reject-reason"] == "output_tokens" and headers["retry-after"] == "30"
    message = json.loads(refusal.body)["error"]["message"]
    assert "output tokens per min for your organization" in message
    large = refusals.rate_limited(Rejection(Reason.TOO_LARGE, "input:model:m", None, status), "m", 900)
    assert large.reason == "request_exceeds_token_limit"
    assert "input tokens per min for this model" in json.loads(large.body)["error"]["message"]
