"""Follow one lean request body through the code: how many times the walk enters each admission module.

The walk is the sequence of project files the running code is in; a module is entered each time the walk
moves into it from another file, by a call or back from one (`Entries`). The body is driven as the
component tests drive the lean profile (`LeanTranslator._on_body` over one message carrying the body and
its attributes), over admission built as the sidecar builds it (tests/support/admission.py). Run as a
script to print the counts: `python -m tests.support.walk`.
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
    """The project file the walk is in at `frame`: its own, or its nearest caller's within extproc/ (the
    standard library and dependencies are passed through, not rooms)."""
    while frame is not None:
        if Path(frame.f_code.co_filename).is_relative_to(EXTPROC):
            return frame.f_code.co_filename
        frame = frame.f_back
    return None


class Entries:
    """A profile hook that follows the walk from file to file and counts, per admission module (its path
    under extproc/admission/), how many times the walk enters it (`visits`): by a call from another file, or
    back from a call it made into another file, a coroutine resumed included; and how many of those entries
    are calls from another file (`calls`). One stay in a module is one visit, whatever it calls within its
    own file or outside the project."""

    def __init__(self) -> None:
        self.visits: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._room: str | None = None

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            room = _room(frame)
        elif event == "return":
            room = _room(frame.f_back)
        else:
            return
        if room is None or room == self._room:
            return
        self._room = room
        path = Path(room)
        if path.is_relative_to(ADMISSION):
            module = str(path.relative_to(ADMISSION))
            self.visits[module] += 1
            if event == "call" and room == frame.f_code.co_filename and _fresh(frame):
                self.calls[module] += 1


def _fresh(frame: FrameType) -> bool:
    """Whether `frame` starts its code (not a generator or coroutine resumed)."""
    return frame.f_lasti <= 0


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


def main() -> None:
    counted = {**BASE_CONFIG, "admission": {**BASE_CONFIG["admission"], "bound_admission": False}}
    for name, config in (("admitted on the prompt's bound", BASE_CONFIG), ("counted first", counted)):
        entries = asyncio.run(walk(chat(), config))
        print(f"{name}: {entries.visits.total()} visits, {entries.calls.total()} of them calls in")
        for module, n in entries.visits.most_common():
            print(f"  {n:3d} {entries.calls[module]:3d}  {module}")


if __name__ == "__main__":
    main()
