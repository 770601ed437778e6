from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import DEFAULT_MODEL, Config, ConfigError, ConfigWatcher, load_config, parse_config
from extproc.core.limiter import LimitSpec

REPO = Path(__file__).resolve().parents[2]


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
    assert config.model_policy("unknown") == config.models["*"]
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
    assert config.model_policy("other") is None
    assert config.model_policy("m") is not None


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
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
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
    assert config.class_of("chat").name == "critical"
    assert config.class_of("stranger").name == "batch"
    assert config.class_config("critical").queues and config.class_config("critical").max_queued == 100
    assert config.tenant_label("chat") == "chat" and config.tenant_label("x") == "other"


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
    assert (redis.backend, redis.redis_url, redis.on_unavailable) == ("redis", "rediss://r:6380/1", "local")


def test_model_costs_pools_and_output_bound_policy() -> None:
    config = parse_config(
        {
            "models": {
                "*": {"context_window": 4096, "template": {"per_message": 4}, "pool": "llama"},
                "llama": {"missing_max_tokens": "inject", "media": {"image_tokens": 576}},
                "llama-lora-sql": {"pool": "llama"},
            },
            "limits": {"models": {"llama": {"max_concurrency": 8}, "qwen": {"max_concurrency": 2}}},
        }
    )
    llama = config.models["llama"]
    assert llama.template.per_message == 4 and llama.template.per_request == 32  # inherited, then default
    assert llama.media.image_tokens == 576 and llama.missing_max_tokens == "inject"
    assert config.models["*"].missing_max_tokens == "reserve_window"
    assert config.pool_of("llama") == "llama"
    assert config.pool_of("llama-lora-sql") == "llama"  # an adapter counts against its base model
    assert config.pool_of("qwen") == "qwen"  # named under limits only
    assert config.pool_of("made-up") == "llama"  # unknown names share the "*" pool
    assert parse_config({}).pool_of("made-up") == DEFAULT_MODEL


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
