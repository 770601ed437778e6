from __future__ import annotations

import asyncio
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import main
from extproc.config import (
    DEFAULT_MODEL,
    MAX_PROBLEM_CHARS,
    Config,
    ConfigError,
    ConfigWatcher,
    load_config,
    parse_config,
)
from extproc.core.limiter.limiter import LimitSpec
from extproc.store.settings import RedisSettings

REPO = Path(__file__).resolve().parents[3]


def test_defaults_are_usable() -> None:
    config = parse_config({})
    assert config.server.grpc_listen == "127.0.0.1:50051"
    assert config.models[DEFAULT_MODEL].context_window == 8192
    specs, defaults = config.limit_specs()
    assert specs == {"global": LimitSpec()}
    assert defaults == {"tenant:": LimitSpec()}


def test_shipped_configs_are_valid() -> None:
    for path in [REPO / "config" / "local.yaml", *sorted((REPO / "k8s").rglob("config.yaml"))]:
        load_config(path)


def test_limit_keys_and_model_defaults() -> None:
    config = parse_config(
        {
            "models": {
                "*": {"context_window": 4096, "default_max_tokens": 100},
                "big": {"context_window": 32768},
            },
            "limits": {
                "global": {"max_concurrency": 10},
                "models": {"*": {"max_concurrency": 2}, "big": {"tokens_per_minute": 1000}},
                "tenant_default": {"tokens_per_minute": 50},
                "tenants": {"acme": {"max_concurrency": 3}},
            },
        }
    )
    assert config.models["big"].default_max_tokens == 100  # inherited from "*"
    assert config.admission_rules.model_policy("unknown") == config.models["*"]
    specs, defaults = config.limit_specs()
    assert specs == {
        "global": LimitSpec(max_concurrency=10),
        "model:big": LimitSpec(tokens_per_minute=1000),
        "tenant:acme": LimitSpec(max_concurrency=3),
    }
    assert defaults == {"tenant:": LimitSpec(tokens_per_minute=50), "model:": LimitSpec(max_concurrency=2)}


def test_unknown_models_refused_when_configured() -> None:
    config = parse_config(
        {"admission": {"reject_unknown_models": True}, "models": {"m": {"context_window": 10}}}
    )
    rules = config.admission_rules
    assert rules.model_policy("other") is None
    assert rules.model_policy("m") is not None


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"limits": {"models": {"m": {"max_concurrency": -1}}}}, "limits.models.m.max_concurrency"),
        ({"limits": {"global": {"tokens_per_minute": 0}}}, "limits.global.tokens_per_minute"),
        ({"limits": {"global": {"max_concurency": 3}}}, "limits.global.max_concurency"),
        ({"limits": {"global": {"max_concurrency": True}}}, "limits.global.max_concurrency"),
        ({"limits": {"global": {"max_concurrency": 1.5}}}, "limits.global.max_concurrency"),
        ({"limits": {"global": []}}, "limits.global"),
        ({"server": {"grpc_listen": "nohost"}}, "server.grpc_listen"),
        ({"server": {"admin_listen": "h:99999"}}, "server.admin_listen"),
        ({"server": {"max_receive_message_bytes": 1 << 20}}, "server.max_receive_message_bytes"),
        ({"admission": {"max_body_bytes": 0}}, "admission.max_body_bytes"),
        ({"admission": {"inject_include_usage": "yes"}}, "admission.inject_include_usage"),
        ({"admission": {"tenant": {"header": ""}}}, "admission.tenant.header"),
        ({"models": {"m": {"encoding": "no_such_encoding"}}}, "models.m.encoding"),
        ({"models": {"m": {"context_window": 0}}}, "models.m.context_window"),
        ({"models": {"m": {"colour": "red"}}}, "models.m.colour"),
        ({"log_level": "chatty"}, "log_level"),
        ({"surprise": 1}, "surprise"),
        ([1, 2], "<root>"),
    ],
)
def test_errors_name_the_key(data: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(key), str(err.value)


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML") as err:
        load_config(bad)
    assert f'in "{bad}", line 2' in str(err.value) and "<unicode string>" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def _configmap_dir(root: Path, version: str, data: dict[str, Any]) -> None:
    """Lay out a directory the way a Kubernetes ConfigMap volume does and swap `..data` atomically."""
    target = root / f"..{version}"
    target.mkdir()
    (target / "config.yaml").write_text(yaml.safe_dump(data))
    link = root / "..data_tmp"
    link.symlink_to(target.name)
    os.replace(link, root / "..data")
    if not (root / "config.yaml").exists():
        (root / "config.yaml").symlink_to("..data/config.yaml")


async def test_watcher_follows_configmap_symlink_swaps_and_refuses_invalid(tmp_path: Path) -> None:
    _configmap_dir(tmp_path, "v1", {"limits": {"global": {"max_concurrency": 1}}})
    applied: list[Config] = []

    async def on_change(config: Config) -> None:
        applied.append(config)

    watcher = ConfigWatcher(tmp_path / "config.yaml", on_change, interval_s=3600)
    assert await watcher.check() is False  # unchanged since start

    _configmap_dir(tmp_path, "v2", {"limits": {"global": {"max_concurrency": 7}}})
    assert await watcher.check() is True
    assert applied[-1].limits.global_.max_concurrency == 7

    _configmap_dir(tmp_path, "v3", {"limits": {"global": {"max_concurrency": -7}}})
    assert await watcher.check() is False
    assert watcher.failures == 1
    assert len(applied) == 1

    _configmap_dir(tmp_path, "v4", {"limits": {"global": {"max_concurrency": 9}}})
    assert await watcher.check() is True
    assert applied[-1].limits.global_.max_concurrency == 9


async def test_watcher_task_polls_by_itself(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("log_level: info\n")
    seen = asyncio.Event()

    async def on_change(_config: Config) -> None:
        seen.set()

    watcher = ConfigWatcher(path, on_change, interval_s=0.01)
    watcher.start()
    path.write_text("log_level: debug\n")
    await asyncio.wait_for(seen.wait(), 5)
    await watcher.stop()


def test_worked_examples_in_the_docs_are_valid() -> None:
    """Every complete config example in the docs parses, so the docs cannot drift from the schema."""
    import re

    docs = REPO / "docs"
    checked = 0
    for name in ("tenants.md", "configuration.md"):
        for block in re.findall(r"```yaml\n(.*?)```", (docs / name).read_text(), re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and ("limits" in data or "classes" in data):
                parse_config(data)
                checked += 1
    assert checked >= 2


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"classes": []}, "classes"),
        ({"classes": [{"queue": {}}]}, "classes[0].name"),
        ({"classes": [{"name": "a"}, {"name": "a"}]}, "classes[1].name"),
        (
            {"classes": [{"name": "a", "queue": {"max_wait_seconds": 4000}}]},
            "classes[0].queue.max_wait_seconds",
        ),
        ({"classes": [{"name": "a", "cut_streams_above_kv": 1.5}]}, "classes[0].cut_streams_above_kv"),
        ({"classes": [{"name": "a"}], "default_class": "b"}, "default_class"),
        ({"classes": [{"name": "a"}], "tenants": {"t": {"class": "zzz"}}}, "tenants.t.class"),
        (
            {
                "classes": [{"name": "a"}],
                "limits": {"global": {"max_concurrency": 2, "guaranteed": {"b": {}}}},
            },
            "limits.global.guaranteed.b",
        ),
        (
            {
                "classes": [{"name": "a"}],
                "limits": {"global": {"max_concurrency": 2, "guaranteed": {"a": {"max_concurrency": 3}}}},
            },
            "limits.global.guaranteed",
        ),
        ({"shadow": "on"}, "shadow"),
        ({"metrics": {"tenant_allowlist": "acme"}}, "metrics.tenant_allowlist"),
        # ceil(29.5) + 1 = 31 s of Envoy timer, over the shipped 30 s max_message_timeout.
        (
            {"classes": [{"name": "a"}, {"name": "b", "queue": {"max_wait_seconds": 29.5}}]},
            "classes[1].queue.max_wait_seconds",
        ),
        (
            {
                "admission": {"envoy_max_message_timeout_seconds": 10},
                "classes": [{"name": "a", "queue": {"max_wait_seconds": 10}}],
            },
            "classes[0].queue.max_wait_seconds",
        ),
        (
            {"admission": {"envoy_max_message_timeout_seconds": 0.5}},
            "admission.envoy_max_message_timeout_seconds",
        ),
        ({"admission": {"max_queue_wait_seconds": 0}}, "admission.max_queue_wait_seconds"),
        ({"admission": {"max_queue_wait_seconds": "soon"}}, "admission.max_queue_wait_seconds"),
        (
            {"admission": {"inference_pool": {"trust_objective": "yes please"}}},
            "admission.inference_pool.trust_objective",
        ),
        (
            {"admission": {"inference_pool": {"objectives": {"chat-latency": "critical"}}}},
            "admission.inference_pool.objectives.chat-latency",
        ),
    ],
)
def test_class_errors_name_the_key(data: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(key), str(err.value)


def test_classes_and_tenants() -> None:
    config = parse_config(
        {
            "classes": [{"name": "critical", "queue": {"max_wait_seconds": 5}}, {"name": "batch"}],
            "tenants": {"chat": {"class": "critical"}},
            "metrics": {"tenant_allowlist": ["chat"]},
        }
    )
    assert config.priority == ("critical", "batch")
    assert config.default_class == "batch"  # the lowest class when none is named
    rules = config.admission_rules
    assert rules.class_of("chat").name == "critical"
    assert rules.class_of("stranger").name == "batch"
    assert rules.class_config("critical").queues and rules.class_config("critical").max_queued == 100
    assert rules.tenant_label("chat") == "chat" and rules.tenant_label("x") == "other"


def test_admission_rules_are_converted_once_and_share_the_configs_tables() -> None:
    """Admission's rules are built with the config, not per request, and cost nothing per tenant: they
    share the config's tables, also across the pipe a reload comes back through."""
    config = parse_config(
        {
            "classes": [{"name": "critical"}, {"name": "batch"}],
            "tenants": {"chat": {"class": "critical"}},
            "limits": {"models": {"qwen": {"max_concurrency": 2}}},
        }
    )
    rules = config.admission_rules
    assert rules.tenant_classes is config.tenant_classes and rules.models is config.models
    assert rules.limited_models is config.limits.models and rules.classes is config.classes
    reloaded = pickle.loads(pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL))
    assert reloaded.admission_rules.tenant_classes is reloaded.tenant_classes
    assert reloaded.admission_rules.class_of("chat").name == "critical"
    assert not rules.shadow and replace(config, shadow=True).admission_rules.shadow  # a new config, new rules


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"store": {"backend": "memcached"}}, "store.backend"),
        ({"store": {"redis": {"url": "http://x"}}}, "store.redis.url"),
        ({"store": {"redis": {"lease_ttl_seconds": 0}}}, "store.redis.lease_ttl_seconds"),
        ({"store": {"on_unavailable": "shrug"}}, "store.on_unavailable"),
        ({"store": {"fallback_share": 2}}, "store.fallback_share"),
        ({"store": {"redis": {"db": 3}}}, "store.redis.db"),
    ],
)
def test_store_errors_name_the_key(data: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(key), str(err.value)


def test_store_defaults_to_in_process_state() -> None:
    store = parse_config({}).store
    assert store.backend == "local"
    redis = parse_config({"store": {"backend": "redis", "redis": {"url": "rediss://r:6380/1"}}}).store
    assert isinstance(redis.options, RedisSettings)
    assert (redis.backend, redis.options.url, redis.on_unavailable) == ("redis", "rediss://r:6380/1", "local")


def test_model_costs_pools_and_output_bound_policy() -> None:
    config = parse_config(
        {
            "models": {
                "*": {"context_window": 4096, "template": {"per_message": 4}, "pool": "llama"},
                "llama": {"missing_max_tokens": "inject", "media": {"image_tokens": 576}},
                "llama-lora-sql": {"pool": "llama"},
                "mistral": {"template": {"in_order": False}},
            },
            "limits": {"models": {"llama": {"max_concurrency": 8}, "qwen": {"max_concurrency": 2}}},
        }
    )
    llama = config.models["llama"]
    assert llama.template.per_message == 4 and llama.template.per_request == 32  # inherited, then default
    assert llama.template.in_order and not config.models["mistral"].template.in_order
    assert llama.media.image_tokens == 576 and llama.missing_max_tokens == "inject"
    assert config.models["*"].missing_max_tokens == "reserve_window"
    rules = config.admission_rules
    assert rules.pool_of("llama") == "llama"
    assert rules.pool_of("llama-lora-sql") == "llama"  # an adapter counts against its base model
    assert rules.pool_of("qwen") == "qwen"  # named under limits only
    assert rules.pool_of("made-up") == "llama"  # unknown names share the "*" pool
    assert parse_config({}).admission_rules.pool_of("made-up") == DEFAULT_MODEL


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (
            {"models": {"m": {"context_window": 10, "missing_max_tokens": "hope"}}},
            "models.m.missing_max_tokens",
        ),
        (
            {"models": {"m": {"context_window": 10, "template": {"per_message": -1}}}},
            "models.m.template.per_message",
        ),
        ({"models": {"m": {"context_window": 10, "media": {"pixels": 1}}}}, "models.m.media.pixels"),
        ({"models": {"m": {"context_window": 10, "pool": 3}}}, "models.m.pool"),
        ({"paths": {"free": ["GET v1/x"]}}, "paths.free"),
        ({"paths": {"free": ["/v1/chat/completions"]}}, "paths.free"),
        ({"paths": {"deny": ["/v1/unknown"]}}, "paths.deny"),
        ({"classes": [{"name": "a", "backend_priority": "high"}]}, "classes[0].backend_priority"),
        ({"admission": {"tokenizer_per_client": 0}}, "admission.tokenizer_per_client"),
        (
            {"admission": {"assumed_decode_tokens_per_second": 0}},
            "admission.assumed_decode_tokens_per_second",
        ),
        ({"admission": {"cached_prompt_token_weight": 1.5}}, "admission.cached_prompt_token_weight"),
        ({"admission": {"cached_prompt_token_weight": -0.1}}, "admission.cached_prompt_token_weight"),
        ({"admission": {"cached_prompt_token_weight": "half"}}, "admission.cached_prompt_token_weight"),
    ],
)
def test_new_keys_name_the_key_when_wrong(data: Any, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_config(data)


def test_paths_section_adds_free_paths_and_denies_built_in_ones() -> None:
    config = parse_config(
        {"paths": {"free": ["/v1/whoami", "POST /v1/feedback"], "deny": ["/v1/embeddings"]}}
    )
    assert config.paths.route("GET", "/v1/whoami") is not None
    assert config.paths.route("POST", "/v1/feedback") is not None
    assert config.paths.route("POST", "/v1/whoami") is None
    assert config.paths.route("POST", "/v1/embeddings") is None
    assert config.paths.route("POST", "/v1/chat/completions") is not None


def test_queue_wait_must_fit_under_envoys_max_message_timeout() -> None:
    """The sidecar extends Envoy's timer to ceil(wait) + 1 s; that must not pass max_message_timeout."""
    assert parse_config({"classes": [{"name": "a", "queue": {"max_wait_seconds": 29}}]})
    with pytest.raises(ConfigError, match=r"admission\.envoy_max_message_timeout_seconds \(30 s"):
        parse_config({"classes": [{"name": "a", "queue": {"max_wait_seconds": 29.01}}]})
    # A gateway whose Envoy allows 120 s states it, and a longer wait is accepted.
    raised = {"admission": {"envoy_max_message_timeout_seconds": 120}}
    config = parse_config({**raised, "classes": [{"name": "a", "queue": {"max_wait_seconds": 90}}]})
    assert config.admission.envoy_max_message_timeout_seconds == 120
    # A class that never queues (max_queued 0) holds no Envoy timer.
    parse_config({"classes": [{"name": "a", "queue": {"max_wait_seconds": 60, "max_queued": 0}}]})


def test_every_unknown_key_is_reported_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "survey": 1,
                "limits": {"global": {"max_concurency": 3}},
                "adaptive": {"low_watermrk": 0.2, "zzz": 1},
                "models": {"m": {"context_window": 10, "colour": "red"}},
            }
        )
    problems = err.value.problems
    assert len(problems) == 5, problems
    assert "models.m.colour: unknown key" in problems
    assert "limits.global.max_concurency: unknown key (did you mean 'max_concurrency'?)" in problems
    assert "adaptive.low_watermrk: unknown key (did you mean 'low_watermark'?)" in problems
    assert "adaptive.zzz: unknown key" in problems
    assert "survey: unknown key (did you mean 'server'?)" in problems


def test_unknown_keys_come_before_other_errors() -> None:
    """A later error may be a consequence of a misspelling: the unknown keys are listed first."""
    with pytest.raises(ConfigError) as err:
        parse_config({"limits": {"global": {"max_concurency": 3}}, "log_level": "chatty"})
    assert (
        err.value.problems[0] == "limits.global.max_concurency: unknown key (did you mean 'max_concurrency'?)"
    )
    assert err.value.problems[1].startswith("log_level: must be one of")


def test_an_error_quotes_at_most_a_bounded_value() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"limits": {"global": {"max_concurrency": [list(range(100_000))] * 3}}})
    assert len(str(err.value)) < 200, str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config({f"key{i}": i for i in range(1000)})
    assert len(err.value.problems) == 1000
    assert len(str(err.value)) < 20 * MAX_PROBLEM_CHARS


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "holds no YAML document"),
        ("# only a comment\n", "holds no YAML document"),
        ("- a\n- b\n", "<root>: must be a mapping, got list"),
        ("just words\n", "<root>: must be a mapping, got str"),
        ("survey: 1\nlog_levl: info\n", "log_levl: unknown key (did you mean 'log_level'?)"),
    ],
)
def test_check_config_refuses_empty_and_non_mapping_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, error: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 1
    out = capsys.readouterr()
    assert "config ok" not in out.out
    assert error in out.err, out.err
    if "survey" in text:  # every unknown key, one line each
        assert out.err.count("invalid config:") == 2, out.err
    path.write_text("{}\n")  # all defaults, said on purpose
    assert main(["check-config", str(path)]) == 0


def test_a_partial_default_model_entry_keeps_the_documented_window() -> None:
    config = parse_config({"models": {"*": {"default_max_tokens": 512}}})
    assert config.models[DEFAULT_MODEL].context_window == 8192
    assert config.models[DEFAULT_MODEL].default_max_tokens == 512


# -- docs/configuration.md and the code agree ---------------------------------------------------------------

TABLE_SECTIONS = {
    "server": ("server",),
    "admission": ("admission",),
    "models": ("models", "*"),
    "paths": ("paths",),
    "feedback": ("feedback",),
    "adaptive": ("adaptive",),
    "kv_budget": ("kv_budget",),
    "store": ("store",),
}
"""Sections whose `| key | default | ...` table documents every key, by the YAML path they sit at."""

DEFAULT_CONTEXT: dict[str, dict[str, Any]] = {
    # Read only with a feed source: a wrong default would not show in a config without one.
    "feedback.resolve_interval_seconds": {"feedback": {"exporters": ["127.0.0.1:50061"]}},
    "feedback.scrape_interval_seconds": {
        "feedback": {
            "direct_targets": [{"url": "http://127.0.0.1:8000/metrics", "kind": "vllm", "model": "m"}]
        }
    },
    # TLS settings need a rediss:// URL.
    "store.redis.tls.verify": {"store": {"redis": {"url": "rediss://127.0.0.1:6379/0"}}},
}


def documented_rows() -> list[tuple[tuple[str, ...], str, str | None]]:
    """(YAML path, key as documented, default as documented or None where it is not a literal)."""
    import re

    rows: list[tuple[tuple[str, ...], str, str | None]] = []
    text = (REPO / "docs" / "configuration.md").read_text()
    for heading, body in re.findall(r"^## `([a-z_]+)`\n(.*?)(?=^## |\Z)", text, re.S | re.M):
        if heading not in TABLE_SECTIONS or "| key | default |" not in body:
            continue
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 2 or not cells[0].startswith("`"):
                continue
            keys = re.findall(r"`([^`]+)`", cells[0])
            parts = [p.strip() for p in cells[1].split(", ")] if len(keys) > 1 else [cells[1]]
            parts = parts if len(parts) == len(keys) else [cells[1]] * len(keys)
            table_keys = set(re.findall(r"^\| `([^`]+)`", body, re.M))
            for key, part in zip(keys, parts, strict=True):
                literal = re.match(r"^`([^`]+)`", part)
                value = literal.group(1) if literal and literal.group(1) not in table_keys else None
                rows.append(((*TABLE_SECTIONS[heading], *key.split(".")), key, value))
    return rows


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: Any = value
    for name in reversed(path):
        out = {name: out}
    assert isinstance(out, dict)
    return out


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def yaml_value(text: str) -> Any:
    value = yaml.safe_load(text)
    return text if isinstance(value, dict) else value  # `extproc:` is a string, not a mapping


def test_documented_defaults_are_the_codes_defaults() -> None:
    """Each literal default in docs/configuration.md's tables, written out explicitly, changes nothing."""
    rows = [row for row in documented_rows() if row[2] is not None and "<" not in row[1]]
    assert len(rows) >= 50, rows
    wrong = []
    for path, _key, default in rows:
        assert default is not None
        dotted = ".".join(p for p in path if p != "*")
        context = merged(nested(path[:-1], {}), DEFAULT_CONTEXT.get(dotted, {}))
        try:
            implicit = parse_config(context)
            explicit = parse_config(merged(context, nested(path, yaml_value(default))))
        except ConfigError as exc:
            wrong.append(f"{dotted}: documented default {default!r}: {exc}")
            continue
        if explicit != implicit:
            wrong.append(f"{dotted}: documented default {default!r} is not the code's")
    assert not wrong, "\n".join(wrong)


def test_every_key_the_code_reads_is_documented() -> None:
    """A key the schema accepts but docs/configuration.md never names is a key no operator can find."""
    from extproc.config.walk import leaf_keys

    keys = set(leaf_keys())
    assert {"limits.global.guaranteed.NAME.max_concurrency", "classes[0].queue.max_queued"} <= keys, keys
    named = documented_names()
    missing = [key for key in sorted(keys) if not suffixes(key) & named]
    assert not missing, f"read by the code, not in docs/configuration.md: {missing}"


def test_every_documented_key_is_in_the_schema() -> None:
    """A row of docs/configuration.md's tables that the schema does not accept documents a key that a file
    cannot set (a rename, a removal, a typo in the docs)."""
    import re

    from extproc.config.walk import leaf_keys

    keys = [re.sub(r"\[0\]", "", key).split(".") for key in leaf_keys()]

    def accepted(path: tuple[str, ...]) -> bool:
        wanted = ["NAME" if part == "*" or part.startswith("<") else part for part in path]
        return any(
            len(key) >= len(wanted)
            and all(w == k or (w == "NAME" and k) for w, k in zip(wanted, key, strict=False))
            for key in keys
        )

    rows = documented_rows()
    assert len(rows) >= 50, rows
    unknown = [".".join(path) for path, _key, _default in rows if not accepted(path)]
    assert not unknown, f"documented in docs/configuration.md, not in the schema: {unknown}"


def suffixes(key: str) -> set[str]:
    """`limits.models.NAME.max_concurrency` -> {max_concurrency, models.max_concurrency, ...}: the ways the
    docs name a key (in its section's table, or in prose under its section)."""
    import re

    parts = [p for p in re.sub(r"\[\d+\]", "", key).split(".") if p not in ("NAME", "*", '"*"', "a")]
    parts = [p for p in parts if not p.startswith("<")]
    return {".".join(parts[i:]) for i in range(len(parts))}


def documented_names() -> set[str]:
    import re

    text = re.sub(r"```.*?```", "", (REPO / "docs" / "configuration.md").read_text(), flags=re.S)
    names: set[str] = set()
    for token in re.findall(r"`([^`]+)`", text):
        names |= suffixes(token)
    for path, _, _ in documented_rows():
        names |= suffixes(".".join(path))
    return names


# -- warnings: valid settings that work against each other --------------------------------------------------

BUDGET: dict[str, Any] = {
    "feedback": {"exporters": ["127.0.0.1:50061"]},
    "kv_budget": {"enabled": True, "target_utilization": 0.9},
}
UNDER_BUDGET: dict[str, Any] = {**BUDGET, "adaptive": {"low_watermark": 0.7, "high_watermark": 0.85}}
"""The budget with the watermarks an adaptive-only config defaults to, set by hand: they work against it."""


@pytest.mark.parametrize(
    ("extra", "marks"),
    [
        ({}, (0.92, 0.98)),
        ({"kv_budget": {"enabled": True, "target_utilization": 0.95}}, (0.95, 0.98)),
        ({"kv_budget": {"enabled": True, "target_utilization": 1.0}}, (0.99, 1.0)),
        ({"kv_budget": {"enabled": False}}, (0.70, 0.85)),
        ({"adaptive": {"low_watermark": 0.5}}, (0.5, 0.85)),
    ],
)
def test_the_default_watermarks_make_room_for_the_budget(
    extra: dict[str, Any], marks: tuple[float, float]
) -> None:
    """Beside a KV budget the watermarks default above its target, so no shipped or planned config needs
    them set to pass check-config without a warning; a config that sets either keeps the classic pair."""
    from extproc.config import config_warnings

    config = parse_config(merged(BUDGET, extra))
    assert config.feedback is not None
    adaptive = config.feedback.adaptive_default
    assert (adaptive.low_watermark, adaptive.high_watermark) == marks
    if extra.get("adaptive") is None and config.feedback.kv_budget.target_utilization < 0.99:
        assert config_warnings(config) == []  # (a target of 1.0 leaves no room above it: still warned)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({}, []),
        (
            {"adaptive": {"low_watermark": 0.7, "high_watermark": 0.85}},
            ["adaptive.low_watermark (0.7) and adaptive.high_watermark (0.85) sit below"],
        ),
        ({"adaptive": {"low_watermark": 0.8, "high_watermark": 0.95}}, ["adaptive.low_watermark (0.8) sits"]),
        ({"adaptive": {"low_watermark": 0.92, "high_watermark": 0.98}}, []),
        (
            {
                "adaptive": {
                    "low_watermark": 0.92,
                    "high_watermark": 0.98,
                    "pools": {"llama": {"low_watermark": 0.5}, "qwen": {}},
                }
            },
            ["adaptive.pools.llama.low_watermark (0.5) sits below kv_budget.target_utilization (0.9)"],
        ),
        ({"kv_budget": {"enabled": False}}, []),
    ],
)
def test_watermarks_below_the_budget_target_are_warned(extra: dict[str, Any], named: list[str]) -> None:
    from extproc.config import config_warnings

    warnings = config_warnings(parse_config(merged(BUDGET, extra)))
    assert len(warnings) == len(named), warnings
    for warning, start in zip(warnings, named, strict=True):
        assert warning.startswith(start), warning
        assert "both act and stack" in warning


@pytest.mark.parametrize(("budget", "warned"), [(True, False), (False, True)])
def test_trusting_the_picked_engine_without_a_kv_budget_is_warned(budget: bool, warned: bool) -> None:
    """The picked engine is read only to book it on that engine's budget: without one, the flag is inert."""
    from extproc.config import config_warnings

    flag = {"admission": {"inference_pool": {"trust_destination_endpoint": True}}}
    raw = merged(BUDGET, flag) if budget else merged(BUDGET, {**flag, "kv_budget": {"enabled": False}})
    warnings = [w for w in config_warnings(parse_config(raw)) if "trust_destination_endpoint" in w]
    assert bool(warnings) is warned, warnings


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        # limits under a served name, or under the pool an alias counts against: used.
        ({"models": {"llama": {}}, "limits": {"models": {"llama": {"max_concurrency": 4}}}}, []),
        (
            {
                "models": {"llama-lora": {"pool": "llama"}},
                "limits": {"models": {"llama": {"max_concurrency": 4}}},
            },
            [],
        ),
        # models."*" alone: limits.models is where the names are declared (docs/configuration.md).
        (
            {
                "models": {"*": {"context_window": 4096}},
                "limits": {"models": {"llama": {"max_concurrency": 4}}},
            },
            [],
        ),
        # nothing declared at all, not even "*": nothing says the name is served.
        (
            {"limits": {"models": {"llama": {"max_concurrency": 4}}}},
            ['limits.models.llama: models declares no model and no "*" of its own'],
        ),
        ({"models": {"*": {"pool": "shared"}}, "limits": {"models": {"shared": {"max_concurrency": 4}}}}, []),
        (
            {
                "models": {"meta-llama/Llama-3.1-8B-Instruct": {}},
                "limits": {"models": {"llama-3.1-8b": {"max_concurrency": 4}}},
            },
            [
                "limits.models.llama-3.1-8b: models declares meta-llama/Llama-3.1-8B-Instruct but not "
                "'llama-3.1-8b'"
            ],
        ),
        (
            {"models": {"llama-3-8b": {}}, "limits": {"models": {"llama3-8b": {"max_concurrency": 4}}}},
            [
                "limits.models.llama3-8b: models declares llama-3-8b but not 'llama3-8b', and no model "
                "counts against it as its pool (did you mean 'llama-3-8b'?)"
            ],
        ),
        (
            {"models": {"alias": {"pool": "base"}}, "limits": {"models": {"alias": {"max_concurrency": 4}}}},
            [
                "limits.models.alias: models.alias.pool is 'base', so requests for 'alias' count against "
                "limits.models.base"
            ],
        ),
        (
            {
                "admission": {"reject_unknown_models": True},
                "limits": {"models": {"llama": {"max_concurrency": 4}}},
            },
            ["limits.models.llama: 'llama' is not declared in models and admission.reject_unknown_models"],
        ),
    ],
)
def test_limits_under_a_name_no_request_counts_against_are_warned(
    raw: dict[str, Any], named: list[str]
) -> None:
    from extproc.config import config_warnings

    warnings = [w for w in config_warnings(parse_config(raw)) if w.startswith("limits.")]
    assert len(warnings) == len(named), warnings
    for warning, start in zip(warnings, named, strict=True):
        assert warning.startswith(start), warning


def test_check_config_names_limits_that_match_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "models:\n  meta-llama/Llama-3.1-8B-Instruct: {}\nlimits:\n  models:\n    llama-3.1-8b:\n"
        "      max_concurrency: 8\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out == "config ok\n"
    assert out.err.startswith("warning: limits.models.llama-3.1-8b: models declares"), out.err


def test_check_config_prints_warnings_and_still_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(UNDER_BUDGET))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out == "config ok\n"
    assert out.err.startswith("warning: adaptive.low_watermark (0.7) and adaptive.high_watermark (0.85)")


def test_check_config_strict_fails_on_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CI gate runs `--strict`: limits under a misspelt model name must not pass it as `config ok`."""
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {"models": {"llama-3-8b": {}}, "limits": {"models": {"llama3-8b": {"max_concurrency": 8}}}}
        )
    )
    assert main(["check-config", str(path)]) == 0
    capsys.readouterr()
    assert main(["check-config", str(path), "--strict"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("warning: limits.models.llama3-8b: models declares llama-3-8b"), out.err
    assert out.err.endswith("check-config --strict: 1 warning(s), counted as errors\n"), out.err
    path.write_text(yaml.safe_dump({"models": {"llama-3-8b": {}}}))
    assert main(["check-config", str(path), "--strict"]) == 0
    assert capsys.readouterr().out == "config ok\n"


SHARED: dict[str, Any] = {"store": {"backend": "redis", "fallback_share": 0.5}}
"""Limits shared by the replicas through Redis, each falling back to half of them while it is away."""


@pytest.mark.parametrize("replicas", [2, 3, 10])
def test_check_config_refuses_replicas_without_a_shared_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replicas: int
) -> None:
    """N replicas each enforcing the whole of every limit admit N times it: the file alone cannot say how
    many replicas run it, so `--replicas` does."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"limits": {"global": {"max_concurrency": 48}}}))
    assert main(["check-config", str(path)]) == 0  # one replica: its own store is the only one
    capsys.readouterr()
    assert main(["check-config", str(path), "--replicas", str(replicas)]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("invalid config: store.backend: 'local' keeps the limits in each replica"), (
        out.err
    )
    assert f"every limit would be multiplied by {replicas}" in out.err
    path.write_text(yaml.safe_dump({"limits": {"global": {"max_concurrency": 48}}, **SHARED}))
    assert main(["check-config", str(path), "--replicas", "2", "--strict"]) == 0
    assert capsys.readouterr().err == ""


def test_check_config_warns_a_fallback_share_above_one_per_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While the store is away each replica admits on fallback_share: 3 replicas on a half each are 1.5 x."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(SHARED))
    assert main(["check-config", str(path), "--replicas", "3"]) == 0
    out = capsys.readouterr()
    assert out.out == "config ok\n"
    assert out.err == (
        "warning: store.fallback_share: 0.5 with 3 replicas: while the store cannot be reached the replicas "
        "admit 1.5 x every limit between them; set it to 1 / 3 (0.3333) or less\n"
    )
    assert main(["check-config", str(path), "--replicas", "3", "--strict"]) == 1
    capsys.readouterr()
    rejecting = {"store": {**SHARED["store"], "on_unavailable": "reject"}}  # fails closed: never over
    path.write_text(yaml.safe_dump(rejecting))
    assert main(["check-config", str(path), "--replicas", "3", "--strict"]) == 0


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_check_config_refuses_a_replica_count_that_is_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["check-config", str(path), "--replicas", value])
    assert exit_.value.code == 2
    assert "--replicas: must be" in capsys.readouterr().err


async def test_a_reload_logs_the_warnings_of_the_new_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_level: info\n")

    async def on_change(_config: Config) -> None:
        pass

    watcher = ConfigWatcher(path, on_change, interval_s=3600)
    path.write_text(yaml.safe_dump(UNDER_BUDGET))
    with caplog.at_level("WARNING", logger="extproc.config"):
        assert await watcher.check() is True
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(messages) == 1 and "kv_budget.target_utilization (0.9)" in messages[0], messages


async def test_a_refused_reload_names_its_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_level: info\n")

    async def on_change(_config: Config) -> None:
        pass

    watcher = ConfigWatcher(path, on_change, interval_s=3600)
    path.write_text("limits: [unclosed\n")
    with caplog.at_level("ERROR", logger="extproc.config"):
        assert await watcher.check() is False
    refused = [r for r in caplog.records if r.getMessage().startswith("config reload not applied")]
    assert len(refused) == 1 and getattr(refused[0], "path", None) == str(path)
    assert str(path) in getattr(refused[0], "error", "")


# -- bounds on what a file may make the loader build ------------------------------------------------------


def laughs(levels: int, fan: int = 9) -> str:
    """The "billion laughs" file: each level is `fan` aliases of the one before (fan ** levels nodes)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fan)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]" for i in range(1, levels)]
    lines.append(f"max_concurrency: *l{levels - 1}")  # where a refusal quotes the value
    return "\n".join(["limits:", "  global:", *(f"    {line}" for line in lines)]) + "\n"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (laughs(7), "YAML expands to more than 2000000 nodes"),  # 9^7 = 4.8 x 10^6 nodes
        (laughs(9), "YAML expands to more than 2000000 nodes"),  # the classic: 9^9 = 3.9 x 10^8 nodes
        # Under the node bound, but the refusal used to quote the expanded value (an 80 MB log line).
        (f"limits: {{global: {{max_concurrency: &x [{'a' * 1000}, {'b' * 1000}]}}}}\n", "limits.global"),
        ("shadow: &s " + "x" * 1_000_000 + "\nlist: [" + ", ".join(["*s"] * 70) + "]\n", "scalars expand"),
        ("limits: " + "[" * 500 + "]" * 500 + "\n", "YAML nested deeper than 64 levels"),
        ("shadow: " + "1" * 5_000 + "\n", "ValueError"),  # longer than Python converts to an int
    ],
)
def test_a_yaml_bomb_is_refused_cheaply_and_quoted_briefly(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert error in str(err.value), str(err.value)[:500]
    assert len(str(err.value)) <= MAX_PROBLEM_CHARS + 40


def test_a_file_over_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    from extproc.config.load import MAX_CONFIG_BYTES

    path = tmp_path / "huge.yaml"
    path.write_text("#" * MAX_CONFIG_BYTES + "\n")  # one comment line: valid YAML, and "all defaults" before
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(path)


def test_aliases_within_the_bounds_still_load(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "limits:\n  tenant_default: &base {max_concurrency: 2, tokens_per_minute: 1000}\n"
        "  tenants: {a: *base, b: {<<: *base, max_concurrency: 5}}\n"
    )
    config = load_config(path)
    assert config.limits.tenants["a"] == LimitSpec(max_concurrency=2, tokens_per_minute=1000)
    assert config.limits.tenants["b"] == LimitSpec(max_concurrency=5, tokens_per_minute=1000)


def test_null_reads_as_absent_and_a_null_entry_as_an_empty_one() -> None:
    """`key: ` (YAML null) keeps the default; `tenants: {acme: }` still names acme; an unknown key is
    reported whatever its value."""
    config = parse_config(
        {
            "server": None,
            "admission": {"max_body_bytes": None},
            "limits": {"tenant_default": {"max_concurrency": 3}, "tenants": {"acme": None}},
            "models": {"m": None},
        }
    )
    assert config.server == parse_config({}).server
    assert config.admission.max_body_bytes == parse_config({}).admission.max_body_bytes
    assert config.limits.tenants == {"acme": LimitSpec()}
    assert config.models["m"] == config.models[DEFAULT_MODEL]
    with pytest.raises(ConfigError) as err:
        parse_config({"admission": {"max_body_byte": None}})
    assert err.value.problems == ("admission.max_body_byte: unknown key (did you mean 'max_body_bytes'?)",)


def test_the_cached_prompt_token_weight_reaches_the_settlement_rules() -> None:
    """Default full price; 0 (free) and 1 are both allowed."""
    assert parse_config({}).admission_rules.cached_prompt_token_weight == 1.0
    for weight in (0, 0.25, 1):
        rules = parse_config({"admission": {"cached_prompt_token_weight": weight}}).admission_rules
        assert rules.cached_prompt_token_weight == weight


def test_split_limits_reach_the_stores_and_the_request_keys() -> None:
    """`input_tokens_per_minute` / `output_tokens_per_minute` become the derived keys of
    extproc/core/limiter/split.py:
    in the stores' tables, and in the keys a request of that model or tenant names."""
    config = parse_config(
        {
            "limits": {
                "models": {"llama": {"tokens_per_minute": 9000, "input_tokens_per_minute": 6000}},
                "tenant_default": {"output_tokens_per_minute": 1200},
                "tenants": {"acme": {"max_concurrency": 3}},
            }
        }
    )
    specs, defaults = config.limit_specs()
    assert specs["model:llama"].tokens_per_minute == 9000
    assert specs["input:model:llama"] == LimitSpec(tokens_per_minute=6000)
    assert specs["output:model:llama"] == LimitSpec()
    assert specs["input:tenant:acme"] == specs["output:tenant:acme"] == LimitSpec()  # acme names none
    assert defaults["output:tenant:"] == LimitSpec(tokens_per_minute=1200)
    keys = config.admission_rules.split_keys.keys_for(["global", "model:llama", "tenant:acme", "tenant:b"])
    assert keys[4:] == ["input:model:llama", "output:model:llama", "input:tenant:b", "output:tenant:b"]


@pytest.mark.parametrize("key", ["input_tokens_per_minute", "output_tokens_per_minute"])
def test_a_split_limit_names_itself_when_wrong(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"limits\.models\.m\.{key}"):
        parse_config({"limits": {"models": {"m": {key: 0}}}})
    with pytest.raises(ConfigError, match=rf"limits\.global\.guaranteed\.default\.{key}"):
        parse_config({"limits": {"global": {"guaranteed": {"default": {key: 10}}}}})
