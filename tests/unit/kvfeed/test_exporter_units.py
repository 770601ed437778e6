"""Exporter building blocks without sockets: hub fan-out bounds, target specs, pod-to-target mapping."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from extproc.kvfeed.engines import PROFILES, ServerKind
from extproc.kvfeed.exporter.cli import build_parser, config_from_args
from extproc.kvfeed.exporter.discovery import KubeDiscovery, KubeDiscoveryConfig
from extproc.kvfeed.exporter.hub import SampleHub
from extproc.kvfeed.proto import feedback_pb2
from extproc.kvfeed.sample import FeedSample, from_proto, to_proto
from extproc.kvfeed.targets import Target, load_targets_file, parse_target_spec
from extproc.logs import RateLimitedLog


def sample(endpoint: str = "10.0.0.1:8000", model: str = "m", kv: float = 0.5, t: float = 1.0) -> FeedSample:
    return FeedSample("n", endpoint, model, ServerKind.VLLM, kv, 1.0, 2.0, 3.0, 1600, t, True)


async def test_slow_subscriber_keeps_only_newest_per_key() -> None:
    hub = SampleHub()
    slow = hub.subscribe()
    fast = hub.subscribe()
    for i in range(1000):
        hub.publish([sample(kv=i / 1000), sample(endpoint="10.0.0.2:8000", kv=i / 1000)])
        if i == 500:
            assert len(await fast.next_batch()) == 2
    assert slow.pending == 2  # bounded by keys, not by publishes
    batch = await slow.next_batch()
    assert sorted(s.kv_usage or 0 for s in batch) == [0.999, 0.999]
    slow.close()
    assert hub.subscribers == 1


async def test_new_subscription_is_primed_and_filtered() -> None:
    hub = SampleHub()
    hub.publish([sample(model="a"), sample(model="b")])
    sub = hub.subscribe(["b"])
    assert [s.model for s in await sub.next_batch()] == ["b"]
    hub.forget_endpoint("10.0.0.1:8000")
    assert hub.latest() == []


def test_proto_round_trip_keeps_unknowns_unknown() -> None:
    s = sample(t=1700000000.25)
    assert from_proto(to_proto(s)) == s
    counted = replace(s, generation_tokens_total=300.0, prompt_tokens_total=12_000.0)
    assert from_proto(to_proto(counted)) == counted
    down = FeedSample.down("n", "e:1", "m", None, "timeout: x", 5.5)
    back = from_proto(to_proto(down))
    assert back == down
    assert back.kv_usage is None and back.kv_capacity_tokens is None


@pytest.mark.parametrize("kind", list(ServerKind))
def test_every_engine_kind_crosses_the_wire_under_its_profiles_name(kind: ServerKind) -> None:
    """The wire carries what the engine's profile says: a new kind is its profile, and the proto's enum."""
    message = to_proto(replace(sample(), server_kind=kind))
    assert feedback_pb2.ServerKind.Name(message.server_kind) == PROFILES[kind].wire
    assert from_proto(message).server_kind is kind


def test_a_kind_without_a_profile_fails_where_it_is_sent() -> None:
    """Not sent as SERVER_KIND_UNSPECIFIED, which every receiver reads as "not said"."""
    unknown = replace(sample(), server_kind=cast(ServerKind, "made-up"))
    with pytest.raises(KeyError):
        to_proto(unknown)


def test_target_specs_and_file(tmp_path: Path) -> None:
    t = parse_target_spec("url=http://127.0.0.1:8000/metrics,kind=vllm,model=llama")
    assert t == Target("http://127.0.0.1:8000/metrics", ServerKind.VLLM, "llama")
    assert t.endpoint == "127.0.0.1:8000"
    assert Target("http://[fd00::1]:9/metrics").endpoint == "[fd00::1]:9"
    assert parse_target_spec("url=http://h/metrics,kind=auto").kind is None
    with pytest.raises(ValueError, match="kind"):
        parse_target_spec("url=http://h/metrics,kind=llamacpp")
    with pytest.raises(ValueError, match="unknown key"):
        parse_target_spec("url=http://h/metrics,port=3")
    with pytest.raises(ValueError, match="url"):
        parse_target_spec("kind=vllm")
    f = tmp_path / "t.yaml"
    f.write_text(
        "targets:\n  - url: http://a:8000/metrics\n  - url: http://b:8002/metrics\n    kind: triton\n"
    )
    assert [x.kind for x in load_targets_file(f)] == [None, ServerKind.TRITON]
    f.write_text("targets:\n  - kind: vllm\n")
    with pytest.raises(ValueError, match=r"targets\[0\]"):
        load_targets_file(f)


def test_cli_builds_config() -> None:
    args = build_parser().parse_args(
        ["--node-name", "n1", "--target", "url=http://127.0.0.1:8000/metrics", "--grpc-address", ":7000"]
    )
    cfg = config_from_args(args)
    assert (cfg.grpc_host, cfg.grpc_port, cfg.metrics_port) == ("0.0.0.0", 7000, 9465)
    assert cfg.scrape_interval == 1.0 and cfg.node_name == "n1"


async def test_pods_to_targets() -> None:
    async with aiohttp.ClientSession() as session:
        d = KubeDiscovery(
            session, KubeDiscoveryConfig(label_selector="a=b", node_name="n", default_port=8000, ca_path=None)
        )
        pods = {
            "items": [
                {"metadata": {"name": "a"}, "status": {"phase": "Running", "podIP": "10.1.0.5"}},
                {
                    "metadata": {
                        "name": "b",
                        "annotations": {
                            "extproc.io/metrics-port": "8080",
                            "extproc.io/server-kind": "trtllm",
                            "extproc.io/model": "llama",
                        },
                    },
                    "status": {"phase": "Running", "podIP": "10.1.0.6"},
                },
                {
                    "metadata": {"name": "c", "deletionTimestamp": "x"},
                    "status": {"phase": "Running", "podIP": "1.1.1.1"},
                },
                {"metadata": {"name": "d"}, "status": {"phase": "Running"}},
                {
                    "metadata": {"name": "e", "annotations": {"extproc.io/metrics-port": "oops"}},
                    "status": {"phase": "Running", "podIP": "10.1.0.7"},
                },
            ]
        }
        targets = d.targets_from_pod_list(pods)
    assert targets == [
        Target("http://10.1.0.5:8000/metrics"),
        Target("http://10.1.0.6:8080/prometheus/metrics", ServerKind.TRTLLM, "llama"),
    ]


def test_rate_limited_log() -> None:
    now = [0.0]
    rl = RateLimitedLog(10.0, clock=lambda: now[0])
    assert rl.allow("t") == (True, 0)
    assert rl.allow("t") == (False, 0)
    assert rl.allow("t") == (False, 0)
    now[0] = 10.0
    assert rl.allow("t") == (True, 2)


async def test_close_all_ends_waiting_subscribers() -> None:
    hub = SampleHub()
    sub = hub.subscribe()
    waiter = asyncio.create_task(sub.next_batch())
    await asyncio.sleep(0)
    hub.close_all()
    assert await waiter == []
    assert sub.closed and hub.subscribers == 0


def test_block_size_travels_and_an_impossible_one_is_dropped_alone() -> None:
    from dataclasses import replace

    from extproc.kvfeed.sample import checked

    s = replace(sample(t=5.0), kv_block_tokens=128)
    assert from_proto(to_proto(s)).kv_block_tokens == 128
    assert from_proto(to_proto(sample())).kv_block_tokens is None
    for flag in (True, False, None):
        assert from_proto(to_proto(replace(s, prefix_caching=flag))).prefix_caching is flag
    for bad in (0, 2**21):
        dropped = checked(replace(s, kv_block_tokens=bad))
        assert dropped.up and dropped.kv_block_tokens is None and dropped.kv_usage == s.kv_usage


@pytest.mark.parametrize("field", ["generation_tokens_total", "prompt_tokens_total"])
def test_the_token_counters_travel_and_an_impossible_one_is_dropped_alone(field: str) -> None:
    from dataclasses import replace

    from extproc.kvfeed.sample import checked

    counted: dict[str, Any] = {field: 12345.0}
    s = replace(sample(t=5.0), **counted)
    assert getattr(from_proto(to_proto(s)), field) == 12345.0
    assert getattr(from_proto(to_proto(sample())), field) is None
    for bad in (-1.0, float("nan"), float("inf")):
        impossible: dict[str, Any] = {field: bad}
        dropped = checked(replace(s, **impossible))
        assert dropped.up and getattr(dropped, field) is None and dropped.kv_usage == s.kv_usage


def test_admission_rejections_travel_and_an_impossible_count_is_refused_as_any_count() -> None:
    from dataclasses import replace

    from extproc.kvfeed.sample import checked

    s = replace(sample(t=5.0), admission_rejections_total=7.0)
    assert from_proto(to_proto(s)).admission_rejections_total == 7.0
    assert from_proto(to_proto(sample())).admission_rejections_total is None
    bad = checked(replace(s, admission_rejections_total=-1.0))
    assert not bad.up and bad.error.startswith("invalid: admission_rejections_total")
