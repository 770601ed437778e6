"""The token ledger of one call through a stack: the sidecar's and the simulator's counters read before and
after it, so a refund lost or counted twice moves a number."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.support.stack import Stack


@dataclass
class Ledger:
    """The sidecar's and the simulator's token counters, to diff around one call."""

    reserved: float
    refunded: float
    prompt: float
    completion: float
    sim_prompt: float
    sim_generated: float

    @classmethod
    def read(cls, stack: Stack) -> Ledger:
        settled_done = wait_settled(stack)
        assert settled_done
        return cls(
            reserved=stack.sidecar("extproc_tokens_reserved_total"),
            refunded=stack.sidecar("extproc_tokens_refunded_total"),
            prompt=stack.sidecar("extproc_tokens_settled_total", kind="prompt"),
            completion=stack.sidecar("extproc_tokens_settled_total", kind="completion"),
            sim_prompt=stack.upstream("vllm:prompt_tokens_total"),
            sim_generated=stack.upstream("vllm:generation_tokens_total"),
        )

    def __sub__(self, other: Ledger) -> Ledger:
        return Ledger(*(a - b for a, b in zip(vars(self).values(), vars(other).values(), strict=True)))


def wait_settled(stack: Stack, limit_s: float = 2.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if stack.sidecar("extproc_active_requests") == 0:
            return True
        time.sleep(0.01)
    return False


def assert_exact(delta: Ledger, prompt: int, completion: int) -> None:
    assert delta.prompt == prompt
    assert delta.completion == completion
    assert delta.refunded == delta.reserved - (prompt + completion)
    assert delta.sim_prompt == prompt
    assert delta.sim_generated == completion


def prompt_byte_bound(messages: Sequence[Mapping[str, Any]], per_message: int, per_request: int) -> int:
    """The prompt bound a chat request is admitted on: the UTF-8 bytes of its roles and contents plus the
    template's costs (docs/admission.md, "Admission on a bound")."""
    text = sum(len(m[k].encode()) for m in messages for k in ("role", "content"))
    return text + per_message * len(messages) + per_request
