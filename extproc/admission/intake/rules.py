"""The operator's rules as admission reads them: one frozen `AdmissionRules` per loaded config.

Admission never reads the config package's classes. The config package (extproc/config/runtime.py) builds
an `AdmissionRules` once per load or reload, sharing its tables (models, tenants' classes) rather than
copying them, so 10^5 tenants cost nothing more here; the sidecar swaps the whole policy in one assignment
and each request reads the policy current when it arrives. Nothing in this module converts anything per
request: every lookup is a dict or set membership on what the load built.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from extproc.admission.intake.paths import PathTable
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy, StepBounds

DEFAULT_MODEL = "*"
"""Key of the `models` / `limits.models` entry that applies to every model not named explicitly."""


@dataclass(frozen=True, slots=True)
class TenantSource:
    """Where the tenant id comes from (`admission.tenant`): a trusted header, or dynamic metadata set by an
    earlier filter; `default` for a request that names none (or an invalid one)."""

    header: str | None
    metadata_namespace: str | None
    metadata_key: str
    default: str


@dataclass(frozen=True, slots=True)
class PoolHeaders:
    """What admission takes from the inference-pool stack's request headers (`admission.inference_pool`):
    the fairness id as the tenant and the objective as the class, each only where the operator trusts the
    header (an earlier filter sets it, or the edge strips it from clients), as the tenant header is trusted.
    `objectives` maps an objective's name to a class; an objective it does not name is the class of the same
    name, if there is one. `trust_destination_endpoint`: the picker runs before the sidecar and names the
    engine (`x-gateway-destination-endpoint`, extproc/admission/intake/endpoint.py), whose KV budget books the
    request."""

    trust_fairness_id: bool = False
    trust_objective: bool = False
    objectives: Mapping[str, str] = field(default_factory=dict)
    trust_destination_endpoint: bool = False


@dataclass(frozen=True, slots=True)
class Tokenizing:
    """How prompts are counted (`admission.tokenizer_*`, `inline_count_bytes`): on the loop when small,
    else on the tokenizer threads through each client's lane (extproc/admission/capacity/lanes.py)."""

    threads: int
    per_client: int
    backlog_per_client: int
    max_wait_seconds: float
    inline_count_bytes: int
    backlog_bytes_per_client: int
    """The bodies one client's waiting prompts may hold, in bytes: `BACKLOG_BODIES` at `max_body_bytes`."""


BACKLOG_BODIES = 4
"""Bodies at `admission.max_body_bytes` one client's lane may hold waiting: what its backlog of four prompts
held at most before the backlog counted its prompts' wait instead."""


class LimitKeys(Protocol):
    """Names the derived limiter keys of a request's keys (core/limiter/split.py `SplitIndex`, given by the
    config: intake does not import the limiter)."""

    def keys_for(self, keys: list[str]) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class _NoSplit:
    """No key has split input/output limits: a request's keys are its own."""

    def keys_for(self, keys: list[str]) -> list[str]:
        return keys


NO_SPLIT = _NoSplit()


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """Everything a request's admission reads from the config, resolved at load.

    `models` holds every configured model's policy with inheritance from `models."*"` resolved, and
    `default_model` the policy an unnamed model falls back to; `limited_models` the names `limits.models`
    gives limits (a name limited but not described is its own pool). `tenant_classes` maps a tenant to its
    class name; a tenant it does not name is in `default_class`.
    """

    models: Mapping[str, ModelPolicy]
    default_model: ModelPolicy
    limited_models: Collection[str]
    reject_unknown_models: bool
    classes: tuple[ClassPolicy, ...]
    default_class: str
    tenant_classes: Mapping[str, str]
    tenant: TenantSource
    tenant_metrics: frozenset[str]
    paths: PathTable
    tokenizing: Tokenizing
    per_step: StepBounds
    max_body_bytes: int
    inject_include_usage: bool
    allow_request_chat_template: bool
    allow_stored_context: bool
    bound_admission: bool
    shadow: bool
    end_report_wait_seconds: float
    refuse_unserved: bool  # `feedback.unserved_models: refuse`: a name no listing engine serves gets a 404
    cached_prompt_token_weight: float = 1.0  # a prefix-cache hit's share of a prompt token's charge
    # `admission.proxy_buffer_bytes`: below it a stream left was not held back by its reader (inflight.py).
    proxy_buffer_bytes: int = 2 << 20
    # Adds the keys of split input/output limits to a request's (extproc/core/limiter/split.py).
    split_keys: LimitKeys = field(default_factory=lambda: NO_SPLIT)
    # `admission.max_queue_wait_seconds`: the longest any request waits in a queue, whatever its class says.
    max_queue_wait_seconds: float | None = None
    pool_headers: PoolHeaders = PoolHeaders()

    def queue_wait(self, klass: ClassPolicy, deadline_s: float | None) -> float:
        """How long a request of `klass` may wait for capacity: the smallest of the global bound, its
        class's and the time left to its own deadline (None: it has none)."""
        bounds = [klass.max_wait_seconds, self.max_queue_wait_seconds, deadline_s]
        return max(0.0, min(b for b in bounds if b is not None))

    def class_for(self, tenant: str, objective: str | None) -> ClassPolicy:
        """A request's class: its trusted objective's where that names a class, else its tenant's."""
        pool = self.pool_headers
        if objective is not None and pool.trust_objective:
            name = pool.objectives.get(objective, objective)
            for klass in self.classes:
                if klass.name == name:
                    return klass
        return self.class_of(tenant)

    def class_of(self, tenant: str) -> ClassPolicy:
        """The class of a tenant; unknown tenants fall into the default class."""
        return self.class_config(self.tenant_classes.get(tenant, self.default_class))

    def class_config(self, name: str) -> ClassPolicy:
        """A class by name; an unknown name is the least important class."""
        for klass in self.classes:
            if klass.name == name:
                return klass
        return self.classes[-1]

    def rank_of(self, klass: ClassPolicy) -> int:
        """A class's place in the config's order (0: the most important); an unknown one is the last."""
        for index, known in enumerate(self.classes):
            if known.name == klass.name:
                return index
        return len(self.classes) - 1

    def tenant_label(self, tenant: str) -> str:
        """Tenant as a metric label: only allow-listed tenants get their own series."""
        return tenant if tenant in self.tenant_metrics else "other"

    def model_policy(self, model: str) -> ModelPolicy | None:
        """Policy for a served model name; None when unknown and unknown models are refused."""
        policy = self.models.get(model)
        if policy is not None:
            return policy
        if self.reject_unknown_models:
            return None
        return self.default_model

    def names_model(self, model: str) -> bool:
        """Whether `models` or `limits.models` names `model` itself (not through `models."*"`): the feed's
        `served_as` keeps such a name as it is."""
        return model != DEFAULT_MODEL and (model in self.models or model in self.limited_models)

    def pool_of(self, model: str) -> str:
        """The pool a model name's requests count against (its `model:<pool>` key and KV budget).

        A configured model is its own pool unless `pool` names another (an alias, a LoRA adapter of the same
        base model). Every name the config does not know shares the single pool of `models."*"` (its `pool`,
        else `*`): a client cannot mint fresh limits or escape the KV budget by inventing model names.
        """
        policy = self.models.get(model)
        if model != DEFAULT_MODEL and policy is not None:
            return policy.pool or model
        if model != DEFAULT_MODEL and model in self.limited_models:
            return model
        default = self.models.get(DEFAULT_MODEL)
        return default.pool if default is not None and default.pool else DEFAULT_MODEL

    @staticmethod
    def model_label(pool: str) -> str:
        """A pool as the `model` metric label: configured pools by name, the unknown-name pool as `other`."""
        return pool if pool != DEFAULT_MODEL else "other"

    def model_labels(self) -> list[str]:
        """Every `model` label value requests can be counted under (bounded by the config)."""
        pools = {self.pool_of(name) for name in [*self.models, *self.limited_models]}
        return sorted({self.model_label(pool) for pool in pools} | {"other"})
