"""Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them at
every load. Each names the keys to change."""

from __future__ import annotations

import difflib
import logging
import os

from extproc.admission.intake.rules import DEFAULT_MODEL
from extproc.config.runtime import Config
from extproc.kvfeed.subscriber.settings import FeedbackConfig

log = logging.getLogger("extproc.config")


def config_warnings(config: Config) -> list[str]:
    """Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them
    at every load. Each names the keys to change."""
    return _limits_matching_nothing(config) + _watermarks_under_budget(config.feedback)


def _limits_matching_nothing(config: Config) -> list[str]:
    """`limits.models.<name>` entries no request can count against. Limits are keyed by pool (a model's own
    name unless `models.<name>.pool` names another, rules.py `pool_of`), so limits under an alias that pools
    elsewhere never apply; with `admission.reject_unknown_models` a name `models` does not declare is
    refused before any limit; and where `models` declares served names, limits under a name that is neither
    one of them nor a pool of one apply only to a client asking for exactly that name (a typo, or the
    engine's name for the model written differently, passes as `config ok` and limits nothing)."""
    declared = sorted(name for name in config.models if name != DEFAULT_MODEL)
    pools = {config.models[name].pool or name for name in declared}
    star_pool = config.models[DEFAULT_MODEL].pool if DEFAULT_MODEL in config.models else None
    if star_pool:
        pools.add(star_pool)
    warnings = []
    for name in config.limits.models:
        if name == DEFAULT_MODEL or name in pools:
            continue
        if name in config.models:
            pool = config.models[name].pool
            warnings.append(
                f"limits.models.{name}: models.{name}.pool is {pool!r}, so requests for {name!r} count "
                f"against limits.models.{pool} and these limits apply to no request; move them there"
            )
        elif config.admission.reject_unknown_models:
            warnings.append(
                f"limits.models.{name}: {name!r} is not declared in models and "
                "admission.reject_unknown_models refuses every name models does not declare, so these limits "
                f"apply to no request; declare models.{name}"
            )
        elif declared:
            close = difflib.get_close_matches(name, sorted(pools), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            shown = ", ".join(declared[:5]) + (", ..." if len(declared) > 5 else "")
            warnings.append(
                f"limits.models.{name}: models declares {shown} but not {name!r}, and no model counts "
                f"against it as its pool{hint}: these limits apply only to requests for exactly {name!r}; "
                "put them under the served model name, or declare the name under models"
            )
    return warnings


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
