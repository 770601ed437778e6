"""A request's decision reads one config: the served-name lookup is asked with the very rules the decision
took, even when a reload swaps them while the decision runs (here every read of the rules is a reload)."""

from __future__ import annotations

import json

from extproc.admission.compose import build_admission
from extproc.admission.exchange import RequestHead
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.replies.verdicts import Forward
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.metrics import Metrics
from extproc.store.local import LocalStore

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
CONFIG = {"models": {"m": {"context_window": 4096}}}


async def test_the_served_name_is_resolved_with_the_rules_the_decision_took() -> None:
    handed: list[AdmissionRules] = []
    asked: list[AdmissionRules] = []

    def reloaded() -> AdmissionRules:
        rules = parse_config(CONFIG).admission_rules  # a new object each time, as after a reload
        handed.append(rules)
        return rules

    def served_as(model: str, rules: AdmissionRules) -> str:
        asked.append(rules)
        return model

    clock = FakeClock()
    admission = build_admission(reloaded, LocalStore(clock), clock, Metrics(), served_as=served_as)
    exchange = admission.exchange()
    exchange.request_headers(RequestHead("POST", "/v1/chat/completions", {}))
    taken = len(handed)
    verdicts = [verdict async for verdict in exchange.request_body(BODY)]
    exchange.close()
    await admission.service.drain()
    assert isinstance(verdicts[-1], Forward)
    assert len(asked) == 1
    assert asked[0] is handed[taken]  # the decision's own snapshot, the first read once the body came
