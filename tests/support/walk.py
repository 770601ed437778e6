"""Follow one lean request body through the code: how many times the walk enters each admission module.

The walk is the sequence of project functions called, a coroutine resumed counting as a call; a module is
entered each time the walk moves into it from another file (`Entries.entries`), and, a narrower count, each
time a function of it is called from another file (`Entries.calls`). The body is driven as the component
tests drive the lean profile (`LeanTranslator._on_body` over one message carrying the body and its
attributes), over admission built as the sidecar builds it (tests/support/admission.py). Run as a script to
print the counts: `python -m tests.support.walk`.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

import extproc.admission
from extproc.protocol.lean import LeanRuntime, LeanTranslator
from tests.support.admission import AdmissionRig
from tests.support.servicer import BASE_CONFIG, chat

ADMISSION = Path(extproc.admission.__file__).resolve().parent
_MODE = processing_mode_pb2.ProcessingMode


def lean_message(body: bytes) -> pb.ProcessingRequest:
    """The one message of a lean stream: the body, its attributes and the mode Envoy announces."""
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    request.protocol_config.request_body_mode = _MODE.BUFFERED
    request.protocol_config.response_body_mode = _MODE.NONE
    attributes = request.attributes["envoy.filters.http.ext_proc"].fields
    attributes["request.method"].string_value = "POST"
    attributes["request.path"].string_value = "/v1/chat/completions"
    attributes["source.address"].string_value = "10.0.0.7:5555"
    return request


EXTPROC = ADMISSION.parent


def _room(frame: FrameType | None) -> str | None:
    """The project file of `frame`, or of its nearest caller within extproc/ (the standard library and
    dependencies are passed through)."""
    while frame is not None:
        if Path(frame.f_code.co_filename).is_relative_to(EXTPROC):
            return frame.f_code.co_filename
        frame = frame.f_back
    return None


class Entries:
    """A profile hook counting, per admission module (its path under extproc/admission/), the walk's
    `entries` into it: each call of one of its functions (or resumption of one of its coroutines) after
    the walk's last call went to another project file; and the `calls` into it: each call of one of its
    functions from another project file (a coroutine resumed not counted)."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._last: str | None = None

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if not path.is_relative_to(EXTPROC):
            return
        module = str(path.relative_to(ADMISSION)) if path.is_relative_to(ADMISSION) else None
        if module is not None and frame.f_code.co_filename != self._last:
            self.entries[module] += 1
        self._last = frame.f_code.co_filename
        fresh = frame.f_lasti <= 0  # not a generator or coroutine resumed
        if module is not None and fresh and _room(frame.f_back) != frame.f_code.co_filename:
            self.calls[module] += 1


async def walk(body: bytes, config: dict[str, Any] | None = None) -> Entries:
    """The entries into each admission module while one lean `body` is decided (its replies drained)."""
    rig = await AdmissionRig(config or BASE_CONFIG).start()
    admission = rig.admission
    translator = LeanTranslator(admission.exchange(reported=True), LeanRuntime(admission.unseen))
    message = lean_message(body)
    entries = Entries()
    sys.setprofile(entries)
    try:
        async for _reply in translator._on_body(message):
            pass
    finally:
        sys.setprofile(None)
    return entries


COUNTED_FIRST: dict[str, Any] = {
    **BASE_CONFIG,
    "admission": {**BASE_CONFIG["admission"], "bound_admission": False},
}
"""The config under which the body is counted before it is decided (no admission on the prompt's bound)."""


def main() -> None:
    for name, config in (("admitted on the prompt's bound", BASE_CONFIG), ("counted first", COUNTED_FIRST)):
        entries = asyncio.run(walk(chat(), config))
        print(f"{name}: {entries.entries.total()} entries, {entries.calls.total()} calls in")
        for module, n in entries.entries.most_common():
            print(f"  {n:3d} {entries.calls[module]:3d}  {module}")


if __name__ == "__main__":
    main()
