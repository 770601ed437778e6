"""Deny by default: every request path is metered, free, or refused at the gateway.

The backend behind the gateway serves far more than the OpenAI generation APIs: admin endpoints, its own
metrics, utilities. A path nobody listed must never reach it, so routing is a table: `METERED` paths
(every generation, pooling, scoring and tokenizer API of vLLM and SGLang the gateway can count) are admitted
against the limiter through their API's adapter, `FREE` paths pass untouched (listing models, health,
version), and anything else, including a known path with another method, is refused with an OpenAI-style
404 before it leaves the gateway. `KNOWN_REFUSED` documents, with reasons, the paths the engines serve that
stay refused; docs/admission.md lists the same table.

`BACKEND_CONTROL_HEADERS` are the request headers the engines read to override what the body says
(priority, data-parallel rank, model): they must be removed before a request goes upstream.

The path is normalized the way servers do before matching, so no spelling the backend's router would
still serve can slip past: query string and fragment dropped, percent-escapes decoded (repeatedly, so
`%252F` cannot hide a slash either), backslashes read as slashes, `.`/`..` segments resolved, repeated and
trailing slashes removed. Methods compare case-insensitively.
"""

from __future__ import annotations

import enum
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote

from extproc.admission.apis import REGISTRY
from extproc.admission.apis.spec import BOTH, SGLANG, VLLM, ApiSpec
from extproc.admission.vocabulary.names import PRIORITY_HEADER
from extproc.admission.vocabulary.parsed import Api


class RouteKind(enum.StrEnum):
    METERED = "metered"
    FREE = "free"
    DENIED = "denied"


@dataclass(frozen=True, slots=True)
class PathRule:
    """One row of the table: which path, which methods, and what happens to it (with the reason why).

    A path ending in `/*` is a prefix: it matches every path below it (after normalization).
    """

    path: str
    methods: frozenset[str]
    kind: RouteKind
    api: Api | None = None
    reason: str = ""
    engines: str = ""  # the servers that serve the path (documentation)

    @property
    def prefix(self) -> str | None:
        return self.path[:-1] if self.path.endswith("/*") else None


def _free(path: str, reason: str, methods: Iterable[str] = ("GET",), engines: str = BOTH) -> PathRule:
    return PathRule(path, frozenset(methods), RouteKind.FREE, None, reason, engines)


def _refused(path: str, methods: str, engines: str, reason: str) -> PathRule:
    return PathRule(path, frozenset(methods.split(",")), RouteKind.DENIED, None, reason, engines)


def _metered(spec: ApiSpec) -> tuple[PathRule, ...]:
    """The rows of one API's paths (its `ApiSpec.paths`)."""
    return tuple(
        PathRule(row.path, row.methods, RouteKind.METERED, spec.api, row.reason, row.engines)
        for row in spec.paths
    )


DEFAULT_RULES: tuple[PathRule, ...] = (
    *(rule for spec in REGISTRY for rule in _metered(spec)),
    _free("/v1/models", "lists served models; runs nothing"),
    _free("/v1/models/*", "one model's card; runs nothing", engines=SGLANG),
    _free("/health", "liveness; runs nothing on vLLM, a one-token generation on SGLang"),
    _free("/ping", "liveness (SageMaker); runs nothing", ("GET", "POST")),
    _free("/version", "server version; runs nothing", engines=VLLM),
)
"""The routing table: metered paths (each API's own, from its spec in `extproc/admission/apis/`) and free
paths. Anything else is refused."""

ADMIN = "administration: never for clients"
NOT_METERED = "generates through an API this gateway does not meter"

KNOWN_REFUSED: tuple[PathRule, ...] = (
    _refused("/v1/responses/{response_id}", "GET", BOTH, "reads the response store, shared by all tenants"),
    _refused(
        "/v1/responses/{response_id}/cancel",
        "POST",
        BOTH,
        "acts on the response store, shared by all tenants",
    ),
    _refused(
        "/v1/messages/count_tokens",
        "POST",
        BOTH,
        "renders the template and fetches and processes media, with no limit",
    ),
    _refused(
        "/v1/chat/completions/render", "POST", VLLM, "scale-out rendering: internal to disaggregated serving"
    ),
    _refused(
        "/v1/completions/render", "POST", VLLM, "scale-out rendering: internal to disaggregated serving"
    ),
    _refused("/v1/messages/render", "POST", VLLM, "scale-out rendering: internal to disaggregated serving"),
    _refused("/v1/responses/render", "POST", VLLM, "scale-out rendering: internal to disaggregated serving"),
    _refused("/v1/chat/completions/derender", "POST", VLLM, "scale-out: internal to disaggregated serving"),
    _refused("/v1/completions/derender", "POST", VLLM, "scale-out: internal to disaggregated serving"),
    _refused(
        "/cohere/v2/chat/render", "POST", VLLM, "scale-out rendering: internal to disaggregated serving"
    ),
    _refused("/generative_scoring", "POST", VLLM, NOT_METERED + " (one generation per item)"),
    _refused("/v1/decisions", "POST", BOTH, NOT_METERED + " (model-specific strategies)"),
    _refused("/v1/systemone", "POST", BOTH, NOT_METERED + " (model-specific strategies)"),
    _refused("/v1/audio/transcriptions", "POST", BOTH, NOT_METERED + " (multipart audio)"),
    _refused("/v1/audio/translations", "POST", VLLM, NOT_METERED + " (multipart audio)"),
    _refused("/v1/realtime", "GET", BOTH, NOT_METERED + " (WebSocket audio session)"),
    _refused("/inference/v1/abort_requests", "POST", VLLM, "aborts requests by id, other clients' included"),
    _refused("/abort_requests", "POST", VLLM, "aborts requests by id, other clients' included"),
    _refused("/abort_request", "POST", SGLANG, "aborts requests by id, other clients' included"),
    _refused("/tokenizer_info", "GET", VLLM, "exposes the chat template and tokenizer configuration"),
    _refused("/metrics", "GET", BOTH, "engine internals: scrape the engine directly"),
    _refused("/load", "GET", VLLM, "engine internals"),
    _refused("/v1/loads", "GET", SGLANG, "engine internals"),
    _refused("/kv_event_sources", "GET", VLLM, "engine internals"),
    _refused("/docs", "GET", VLLM, "the engine's API documentation: not for clients"),
    _refused("/docs/oauth2-redirect", "GET", VLLM, "the engine's API documentation: not for clients"),
    _refused("/redoc", "GET", VLLM, "the engine's API documentation: not for clients"),
    _refused("/openapi.json", "GET", VLLM, "the engine's API documentation: not for clients"),
    _refused("/adapters", "POST", VLLM, ADMIN + " (loads LoRA weights)"),
    _refused("/adapters/{adapter_name}", "DELETE", VLLM, ADMIN + " (unloads LoRA weights)"),
    _refused("/v1/load_lora_adapter", "POST", VLLM, ADMIN + " (loads LoRA weights)"),
    _refused("/v1/unload_lora_adapter", "POST", VLLM, ADMIN + " (unloads LoRA weights)"),
    _refused("/start_profile", "GET,POST", BOTH, ADMIN),
    _refused("/stop_profile", "GET,POST", BOTH, ADMIN),
    _refused("/scale_elastic_ep", "POST", BOTH, ADMIN + " (rescales data parallelism)"),
    _refused("/is_scaling_elastic_ep", "GET,POST", BOTH, ADMIN),
    _refused("/fault_tolerance/apply", "POST", VLLM, ADMIN),
    _refused("/fault_tolerance/status", "GET", VLLM, ADMIN),
    _refused("/reset_prefix_cache", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/reset_mm_cache", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/reset_encoder_cache", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/collective_rpc", "POST", VLLM, ADMIN + " (arbitrary worker calls; development mode)"),
    _refused("/server_info", "GET", BOTH, "dumps the server configuration"),
    _refused("/update_weight_version", "POST", BOTH, ADMIN + " (weight updates)"),
    _refused("/sleep", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/release_kv_cache_memory", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/wake_up", "POST", VLLM, ADMIN + " (development mode)"),
    _refused("/is_sleeping", "GET", VLLM, ADMIN + " (development mode)"),
    *(
        _refused(path, methods, VLLM, ADMIN + " (weight synchronisation; development mode)")
        for path, methods in (
            ("/pause", "POST"),
            ("/resume", "POST"),
            ("/is_paused", "GET"),
            ("/init_weight_transfer_engine", "POST"),
            ("/shutdown_weight_transfer_engine", "POST"),
            ("/start_weight_update", "POST"),
            ("/start_draft_weight_update", "POST"),
            ("/update_weights", "POST"),
            ("/finish_weight_update", "POST"),
            ("/weight_info", "GET"),
            ("/weight_checker", "POST"),
            ("/get_world_size", "GET"),
        )
    ),
    _refused("/api/chat", "POST", SGLANG, NOT_METERED + " (Ollama)"),
    _refused("/api/generate", "POST", SGLANG, NOT_METERED + " (Ollama)"),
    _refused("/api/tags", "GET", SGLANG, "Ollama model listing: not needed by OpenAI clients"),
    _refused("/api/show", "POST", SGLANG, "Ollama model details: not needed by OpenAI clients"),
    _refused("/", "GET,HEAD", SGLANG, "Ollama root: not needed by OpenAI clients"),
    _refused("/vertex_generate", "POST", SGLANG, NOT_METERED + " (Vertex AI)"),
    _refused("/health_generate", "GET", SGLANG, "runs a one-token generation per call; /health is free"),
    _refused("/ready", "GET", SGLANG, "readiness for the engine's own probes"),
    _refused("/get_model_info", "GET", SGLANG, "engine internals"),
    _refused("/model_info", "GET", SGLANG, "engine internals"),
    _refused("/get_server_info", "GET", SGLANG, "dumps the server configuration"),
    _refused("/get_hicache_l3_cache_layout", "GET", SGLANG, "engine internals"),
    _refused("/open_session", "GET,POST", SGLANG, "sessions hold context of unknown size"),
    _refused("/close_session", "GET,POST", SGLANG, "sessions hold context of unknown size"),
    _refused("/parse_function_call", "POST", SGLANG, "a utility outside the metered APIs"),
    _refused("/separate_reasoning", "POST", SGLANG, "a utility outside the metered APIs"),
    _refused("/flush_cache", "GET,POST", SGLANG, ADMIN),
    _refused("/pause_generation", "POST", SGLANG, ADMIN),
    _refused("/continue_generation", "POST", SGLANG, ADMIN),
    *(
        _refused(path, methods, SGLANG, ADMIN + " (weight updates)")
        for path, methods in (
            ("/update_weights_from_disk", "POST"),
            ("/update_weights_from_tensor", "POST"),
            ("/update_weights_from_distributed", "POST"),
            ("/update_weights_from_ipc", "POST"),
            ("/init_weights_update_group", "POST"),
            ("/destroy_weights_update_group", "POST"),
            ("/begin_weight_update", "POST"),
            ("/end_weight_update", "POST"),
            ("/get_weights_by_name", "GET,POST"),
            ("/weights_checker", "POST"),
            ("/init_weights_send_group_for_remote_instance", "POST"),
            ("/send_weights_to_remote_instance", "POST"),
            ("/get_remote_instance_transfer_engine_info", "GET"),
            ("/remote_instance_transfer_engine_info", "GET"),
        )
    ),
    *(
        _refused(path, methods, SGLANG, ADMIN)
        for path, methods in (
            ("/release_memory_occupation", "GET,POST"),
            ("/resume_memory_occupation", "GET,POST"),
            ("/slow_down", "GET,POST"),
            ("/pd_role_switch", "POST"),
            ("/set_internal_state", "POST"),
            ("/configure_logging", "GET,POST"),
            ("/freeze_gc", "POST"),
            ("/set_trace_level", "GET,POST"),
            ("/start_expert_distribution_record", "GET,POST"),
            ("/stop_expert_distribution_record", "GET,POST"),
            ("/dump_expert_distribution_record", "GET,POST"),
            ("/load_lora_adapter", "POST"),
            ("/load_lora_adapter_from_tensors", "POST"),
            ("/unload_lora_adapter", "POST"),
            ("/hicache/storage-backend", "GET,PUT,DELETE"),
            ("/hicache/storage-backend/clear", "POST"),
            ("/add_external_corpus", "POST"),
            ("/remove_external_corpus", "POST"),
            ("/list_external_corpora", "GET"),
            ("/dumper/{method}", "POST"),
        )
    ),
    _refused("/generate_from_file", "POST", SGLANG, NOT_METERED + " (SGLang 0.5.5)"),
    _refused("/get_load", "GET", SGLANG, "engine internals (SGLang 0.5.5)"),
    _refused("/get_weight_version", "GET", SGLANG, "engine internals (SGLang 0.5.5)"),
    _refused("/clear_hicache_storage_backend", "POST", SGLANG, ADMIN + " (SGLang 0.5.5)"),
)
"""Paths vLLM v0.33.0 and SGLang v0.5.23 serve that the gateway refuses, with the reason: documentation
only (every path outside `DEFAULT_RULES` is refused). Sources: the route registrations the notes in
docs/admission.md cite, e.g. vLLM v0.33.0 entrypoints/launchers/api_server/routers.py and SGLang v0.5.23
srt/entrypoints/http_server.py."""

BACKEND_CONTROL_HEADERS: tuple[str, ...] = (
    # vLLM v0.33.0 entrypoints/generate/base/serving.py:42,254-265: overrides the body's `priority`.
    PRIORITY_HEADER,
    # vLLM v0.33.0 entrypoints/generate/base/serving.py:216-228: pins a data-parallel rank.
    "x-data-parallel-rank",
    # model-hosting-container-standards 0.1.16 sagemaker/__init__.py:60-110, sagemaker/lora/constants.py:13
    # (applied on vLLM's /invocations, entrypoints/serve/sagemaker/api_router.py:109): written into the
    # body's `model` after the gateway metered it, switching model or LoRA adapter.
    "x-amzn-sagemaker-adapter-identifier",
    # SGLang v0.5.23 srt/entrypoints/request_headers.py:10-19, applied to /generate and chat completions
    # (http_server.py:948, openai/serving_chat.py:1421) when SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1.
    "x-override-rid",
    "x-override-bootstrap-host",
    "x-override-bootstrap-port",
    "x-override-bootstrap-room",
    "x-override-conversation-id",
    "x-override-routed-dp-rank",
    "x-override-disagg-prefill-dp-rank",
    "x-override-priority",
)
"""Request headers that let a client steer the backend past what the gateway metered or decided
(priority, placement, the model itself): the proxy must remove them before a request goes upstream. Lower
case."""


def normalize_path(path: str) -> str:
    """The path as a server's router would see it (see the module docstring)."""
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = posixpath.normpath("/" + path.replace("\\", "/"))
    return re.sub(r"/+", "/", path).rstrip("/") or "/"


@dataclass(frozen=True)
class PathTable:
    """Rules by normalized path; built once per config. Prefix rules (`/x/*`) apply when no exact rule does,
    the longest prefix first."""

    rules: Mapping[str, PathRule]
    _prefixes: tuple[PathRule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefixes = [rule for rule in self.rules.values() if rule.prefix is not None]
        prefixes.sort(key=lambda rule: len(rule.path), reverse=True)
        object.__setattr__(self, "_prefixes", tuple(prefixes))

    @classmethod
    def build(cls, rules: Iterable[PathRule] = DEFAULT_RULES) -> PathTable:
        return cls({rule.path: rule for rule in rules})

    def find(self, path: str) -> PathRule | None:
        """The rule for a (raw) path, whatever the method."""
        normal = normalize_path(path)
        rule = self.rules.get(normal)
        if rule is not None:
            return rule
        for candidate in self._prefixes:
            prefix = candidate.prefix
            if prefix is not None and normal.startswith(prefix) and len(normal) > len(prefix):
                return candidate
        return None

    def route(self, method: str, path: str) -> PathRule | None:
        """The rule this request falls under, or None: refused (unknown path, or a method not listed).

        OPTIONS (a browser's CORS preflight) is free on every listed path: it runs no model.
        """
        rule = self.find(path)
        if rule is None or rule.kind is RouteKind.DENIED:
            return None
        verb = method.upper()
        if verb in rule.methods:
            return rule
        if verb == "OPTIONS":
            return _free(rule.path, "CORS preflight", ("OPTIONS",))
        return None


DEFAULT_TABLE = PathTable.build()
