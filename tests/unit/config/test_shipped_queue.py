"""Every shipped sidecar config queues interactive traffic, for as long as the Envoy it ships beside lets a
request hold its ext_proc stream, and keeps a class that does not queue (docs/tenants.md, the shipped
classes): a burst the engine alone would finish is answered later, not refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_config
from extproc.envoyconf.bootstrap import http_connection_managers

REPO = Path(__file__).resolve().parents[3]


def envoy_ext_proc_timeouts(path: Path) -> list[tuple[float, float]]:
    """(message_timeout, max_message_timeout) in seconds of every ext_proc filter of a static Envoy config."""
    found = []
    for hcm in http_connection_managers(yaml.safe_load(path.read_text())):
        for http_filter in hcm["http_filters"]:
            typed: dict[str, Any] = http_filter.get("typed_config", {})
            if "message_timeout" in typed:
                found.append(
                    (seconds(typed["message_timeout"]), seconds(typed.get("max_message_timeout", "0s")))
                )
    return found


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def envoy_gateway_timeout(profile: Path) -> tuple[float, float]:
    """Envoy Gateway's messageTimeout for the sidecar; it has no maxMessageTimeout (Envoy keeps 0)."""
    policy = yaml.safe_load((profile / "envoyextensionpolicy.yaml").read_text())
    return seconds(policy["spec"]["extProc"][0]["messageTimeout"]), 0.0


SHIPPED = {
    "config/local.yaml": [REPO / "envoy" / "envoy.yaml", REPO / "envoy" / "envoy-lean.yaml"],
    "k8s/gateway/config.yaml": [
        REPO / "k8s" / "gateway" / "envoy.yaml",
        REPO / "k8s" / "gateway" / "lean" / "envoy.yaml",
    ],
    "k8s/envoy-gateway/lean/config.yaml": [REPO / "k8s" / "envoy-gateway" / "lean"],
    "k8s/envoy-gateway/inline/config.yaml": [REPO / "k8s" / "envoy-gateway" / "inline"],
}


def test_every_shipped_config_is_listed() -> None:
    configs = {"config/local.yaml", *(str(p.relative_to(REPO)) for p in (REPO / "k8s").rglob("config.yaml"))}
    assert configs == set(SHIPPED)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_the_default_class_queues_as_long_as_envoy_lets_it(name: str) -> None:
    config = load_config(REPO / name)
    rules = config.admission_rules
    default = rules.class_config(rules.default_class)
    assert default.max_wait_seconds > 0 and default.max_queued > 0, name
    assert any(not c.queues for c in rules.classes), f"{name}: no class sheds at once"
    timeouts = [
        t
        for where in SHIPPED[name]
        for t in ([envoy_gateway_timeout(where)] if where.is_dir() else envoy_ext_proc_timeouts(where))
    ]
    assert timeouts, name
    for message, maximum in timeouts:
        # The sidecar extends Envoy's timer to ceil(wait) + 1 s; Envoy takes that up to max_message_timeout,
        # and without one a wait must end within message_timeout itself.
        bound = maximum if maximum > 0 else message
        assert math.ceil(default.max_wait_seconds) + 1 <= bound, (name, message, maximum)
        assert config.admission.envoy_max_message_timeout_seconds == bound, name
