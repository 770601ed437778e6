"""An API owns its body: admission hands the raw bytes and the request's `content-type` to the API's body
format (`ApiSpec.body`), never decoding JSON itself. Every shipped API keeps the shared JSON format; a
test-only multipart API, one `ApiSpec` registered here, shows that an API with another encoding needs nothing
outside its own module. The content type reaches the format from the inline profile's headers and from the
lean profile's attributes alike."""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.admission import apis
from extproc.admission.apis.openai import OPENAI_DIALECT, OPENAI_SPEC
from extproc.admission.apis.spec import ApiSpec, path, shared
from extproc.admission.exchange import RequestHead
from extproc.admission.intake.request import edit_body, parse_request
from extproc.admission.replies.verdicts import Forward
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.body import JSON_BODY, BodyFormat
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.names import CONTENT_TYPE_HEADER, header_attribute
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt
from extproc.protocol.lean import LeanRuntime, LeanTranslator
from extproc.protocol.messages import EXT_PROC_ATTRIBUTES
from tests.unit.admission.exchange_rig import Rig, chat

FORM = "multipart/form-data; boundary=XyZ"


# ----------------------------------------------------------------------------------------------------
# A multipart API as its one module would be: a format, an adapter, a spec.


class MultipartForm:
    """multipart/form-data: each part's `name` to its text (an upload's bytes would stay bytes)."""

    def decode(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        if (
            content_type is None
            or not content_type.startswith("multipart/form-data")
            or "boundary=" not in content_type
        ):
            f.bad(
                f"Request body must be multipart/form-data with a boundary, got {content_type!r}.",
                code="invalid_value",
                param=None,
            )
        head = f"Content-Type: {content_type}\r\n\r\n".encode()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
        found: dict[str, Any] = {}
        for part in message.iter_parts():
            payload = part.get_payload(decode=True)
            assert isinstance(payload, bytes)
            found[str(part.get_param("name", header="content-disposition"))] = payload.decode()
        return found

    def encode(self, body: dict[str, Any]) -> bytes:
        return form(**body)


class TranscriptionAdapter:
    api = Api("test_transcription")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        prompt = Prompt(texts=(f.required_str(body, "prompt", "prompt"),))
        return ParsedRequest(api=self.api, model=f.model_name(body), prompts=(prompt,), body=body)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        if edits.max_tokens is None:
            return False
        body["max_completion_tokens"] = str(edits.max_tokens)
        return True


SPEC = ApiSpec(
    adapter=TranscriptionAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/v1/test/transcriptions", "generates"),),
    body=MultipartForm(),
)


def form(**fields: str) -> bytes:
    parts = [
        f'--XyZ\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in fields.items()
    ]
    return ("".join(parts) + "--XyZ--\r\n").encode()


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Api:
    """The test API in the registry, as the registry's discovery would put it there."""
    monkeypatch.setitem(apis._BY_API, SPEC.api, SPEC)
    return SPEC.api


def test_every_shipped_api_decodes_its_body_as_json() -> None:
    assert [spec.api for spec in apis.REGISTRY if spec.body is not JSON_BODY] == []


def test_a_multipart_api_is_parsed_by_its_own_format(registered: Api) -> None:
    req = parse_request(registered, form(model="whisper", prompt="hello there"), content_type=FORM)
    assert req.api == registered and req.model == "whisper"
    assert req.prompts[0].texts == ("hello there",)
    edited = edit_body(req, BodyEdits(max_tokens=7))
    assert edited is not None and b'name="max_completion_tokens"\r\n\r\n7\r\n' in edited
    assert parse_request(registered, edited, content_type=FORM).body["max_completion_tokens"] == "7"


def test_a_multipart_api_refuses_a_body_of_another_type(registered: Api) -> None:
    with pytest.raises(AdmissionError) as refused:
        parse_request(registered, b'{"model": "whisper"}', content_type="application/json")
    assert refused.value.status == 400 and "multipart/form-data" in refused.value.message
    with pytest.raises(AdmissionError, match="'model'"):  # the adapter's own checks name the field
        parse_request(registered, form(prompt="x"), content_type=FORM)


def test_json_ignores_the_content_type_as_before() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    for content_type in (None, "text/plain", FORM):
        assert parse_request(Api("chat"), body, content_type=content_type).model == "m"
    with pytest.raises(AdmissionError) as refused:
        parse_request(Api("chat"), b"[1]", content_type="application/json")
    assert refused.value.code == "invalid_type"


# ----------------------------------------------------------------------------------------------------
# The content type reaches the format from either profile.


@dataclass
class Recording:
    """The JSON format, noting what each decode was handed."""

    inner: BodyFormat = JSON_BODY
    seen: list[tuple[bytes, str | None]] = field(default_factory=list)

    def decode(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        self.seen.append((raw, content_type))
        return self.inner.decode(raw, content_type)

    def encode(self, body: dict[str, Any]) -> bytes:
        return self.inner.encode(body)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Recording:
    """The chat API with a recording format."""
    recorder = Recording()
    chat_api = Api("chat")
    monkeypatch.setitem(apis._BY_API, chat_api, replace(apis.spec_of(chat_api), body=recorder))
    return recorder


async def test_the_inline_profile_hands_the_header_to_the_format(recording: Recording) -> None:
    rig = await Rig().start()
    body = chat()
    head = RequestHead("POST", "/v1/chat/completions", {CONTENT_TYPE_HEADER: "application/json"})
    assert isinstance(await rig.decide(rig.admission.exchange(), body, head), Forward)
    await rig.decide(rig.admission.exchange(), body)
    assert recording.seen == [(body, "application/json"), (body, None)]


async def test_the_lean_profile_hands_the_attribute_to_the_format(recording: Recording) -> None:
    rig = await Rig().start()
    body = chat()
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    request.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE
    attributes = request.attributes[EXT_PROC_ATTRIBUTES].fields
    attributes["request.method"].string_value = "POST"
    attributes["request.path"].string_value = "/v1/chat/completions"
    attributes[header_attribute(CONTENT_TYPE_HEADER)].string_value = "application/json; charset=utf-8"
    translator = LeanTranslator(rig.admission.exchange(), LeanRuntime(rig.admission.unseen))
    replies = [reply async for reply in translator.handle(request)]
    assert replies[-1].HasField("request_body")
    assert recording.seen == [(body, "application/json; charset=utf-8")]
