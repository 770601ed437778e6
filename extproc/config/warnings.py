"""Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them at
every load. Each names the keys to change."""

from __future__ import annotations

import logging
import os

from extproc.config.runtime import Config
from extproc.kvfeed.subscriber.settings import FeedbackConfig

log = logging.getLogger("extproc.config")


def config_warnings(config: Config) -> list[str]:
    """Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them
    at every load. Each names the keys to change."""
    return _watermarks_under_budget(config.feedback)


def _watermarks_under_budget(feedback: FeedbackConfig) -> list[str]:
    """Adaptive watermarks below the KV budget's target: the budget admits up to the target while the scale
    already cuts the limits on the same KV, so both act and stack (docs/feedback.md: the scale fell to 0.64
    on top of the budget against a real engine). A pool that only inherits the defaults is warned once."""
    budget = feedback.kv_budget
    if not (feedback.enabled and budget.enabled):
        return []
    entries = [("adaptive", feedback.adaptive_default)]
    entries += [
        (f"adaptive.pools.{pool}", adaptive)
        for pool, adaptive in feedback.adaptive_pools.items()
        if adaptive != feedback.adaptive_default
    ]
    warnings = []
    for path, adaptive in entries:
        marks = {"low_watermark": adaptive.low_watermark, "high_watermark": adaptive.high_watermark}
        below = [
            f"{path}.{key} ({value:g})" for key, value in marks.items() if value < budget.target_utilization
        ]
        if below:
            warnings.append(
                f"{' and '.join(below)} {'sit' if len(below) > 1 else 'sits'} below "
                f"kv_budget.target_utilization ({budget.target_utilization:g}): the adaptive scale cuts the "
                "limits on KV the budget still admits into, so both act and stack; set the watermarks above "
                "the target (e.g. 0.92 / 0.98, docs/feedback.md)"
            )
    return warnings


def log_warnings(config: Config, path: str | os.PathLike[str]) -> None:
    for warning in config_warnings(config):
        log.warning("config: %s", warning, extra={"path": str(path)})
