"""The error envelope must match OpenAI's byte for byte in shape, since SDKs index its keys directly."""

from __future__ import annotations

import json

from extproc.admission.vocabulary.errors import AdmissionError, error_body


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
