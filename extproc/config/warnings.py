"""Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them at
every load. Each names the keys to change. `replica_problems` and `replica_warnings` judge a config for a
number of sidecar replicas, which the file does not hold: `check-config --replicas N` asks for them."""

from __future__ import annotations

import difflib
import logging
import os

from extproc.admission.intake.rules import DEFAULT_MODEL
from extproc.config.runtime import DEFAULT_POLICY, Config
from extproc.kvfeed.subscriber.settings import FeedbackConfig
from extproc.store.backends import backend

log = logging.getLogger("extproc.config")


def config_warnings(config: Config) -> list[str]:
    """Settings that are valid but work against each other: `check-config` prints them, the sidecar logs them
    at every load. Each names the keys to change."""
    return (
        _limits_matching_nothing(config)
        + _watermarks_under_budget(config.feedback)
        + _picked_engine_without_budget(config)
    )


def _picked_engine_without_budget(config: Config) -> list[str]:
    """`admission.inference_pool.trust_destination_endpoint` reads the engine a picker named only to book the
    request on that engine's KV budget: without the budget (and its feed) the header changes nothing."""
    if not config.admission.inference_pool.trust_destination_endpoint:
        return []
    if config.feedback.enabled and config.feedback.kv_budget.enabled:
        return []
    return [
        "admission.inference_pool.trust_destination_endpoint: the picked engine is read only to book the "
        "request on its KV budget, and kv_budget is off (or no KV feed): it changes nothing; set "
        "kv_budget.enabled with a feed, or drop the flag"
    ]


def _limits_matching_nothing(config: Config) -> list[str]:
    """`limits.models.<name>` entries no request can count against. Limits are keyed by pool (a model's own
    name unless `models.<name>.pool` names another, rules.py `pool_of`), so limits under an alias that pools
    elsewhere never apply; with `admission.reject_unknown_models` a name `models` does not declare is
    refused before any limit; and where `models` declares served names, limits under a name that is neither
    one of them nor a pool of one apply only to a client asking for exactly that name (a typo, or the
    engine's name for the model written differently, passes as `config ok` and limits nothing). Where
    `models` declares nothing at all (no name, and no `"*"` of its own: the built config then holds the
    built-in defaults as `"*"`), the same holds and nothing in the file says which names are served."""
    declared = sorted(name for name in config.models if name != DEFAULT_MODEL)
    pools = {config.models[name].pool or name for name in declared}
    star_pool = config.models[DEFAULT_MODEL].pool if DEFAULT_MODEL in config.models else None
    # Compared by value: a reloaded config comes back from a child process as a copy.
    no_star = config.models.get(DEFAULT_MODEL, DEFAULT_POLICY) == DEFAULT_POLICY
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
        elif no_star:
            warnings.append(
                f'limits.models.{name}: models declares no model and no "*" of its own, so nothing says '
                f"{name!r} is served: these limits apply only to requests for exactly {name!r}, and a "
                f'misspelt name limits nothing; declare models.{name} (or a models."*" entry, where '
                "limits.models names the served models on purpose)"
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


def replica_problems(config: Config, replicas: int) -> list[str]:
    """Why this config cannot run as `replicas` sidecar replicas: a store whose state replicas do not share
    (`store.backend: local`, extproc/store/backends.py) keeps every limit in each replica, so N replicas
    admit N times each limit in front of the same engines and nothing at run time can tell (a replica does
    not know how many others there are)."""
    name = config.store.backend
    if replicas <= 1 or backend(name).shared:
        return []
    return [
        f"store.backend: {name!r} keeps the limits in each replica, so with {replicas} replicas every limit "
        f"would be multiplied by {replicas} (each replica admits up to all of it); share them with "
        "store.backend: redis (docs/store.md)"
    ]


def replica_warnings(config: Config, replicas: int) -> list[str]:
    """Settings that let `replicas` replicas sharing a store admit more than the limits while it is away:
    with `on_unavailable: local` each admits on `fallback_share` of every limit, so the fleet admits
    replicas x fallback_share of each (docs/store.md, Failures)."""
    store = config.store
    shared = backend(store.backend).shared
    if replicas <= 1 or not shared or store.on_unavailable != "local":
        return []
    fleet = store.fallback_share * replicas
    if fleet <= 1 + 1e-9:
        return []
    return [
        f"store.fallback_share: {store.fallback_share:g} with {replicas} replicas: while the store cannot "
        f"be reached the replicas admit {fleet:.3g} x every limit between them; set it to 1 / {replicas} "
        f"({int(10_000 / replicas) / 10_000:g}) or less"
    ]


def log_warnings(config: Config, path: str | os.PathLike[str]) -> None:
    for warning in config_warnings(config):
        log.warning("config: %s", warning, extra={"path": str(path)})
