"""`extproc plan`: suggestions and their arithmetic, output formats, the config snippet, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import main
from extproc.config import parse_config
from extproc.geometry.capacity import DeploymentSpec, plan_capacity
from extproc.geometry.presets import GPU_PRESETS, model_preset
from extproc.plan.planner import SHIPPED_FEED, SHIPPED_STORE, PlanRequest, TrafficProfile, build_plan
from extproc.plan.timing import requests_per_second

REPO = Path(__file__).resolve().parents[3]
SHIPPED_CONFIG = REPO / "k8s" / "gateway" / "config.yaml"


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run_plan(capsys, "--output", "json", *args)
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def test_default_plan_is_the_simulators_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, "--model-config", "llama-3-8b", "--gpu-memory-utilization", "0.9")
    assert data["num_gpu_blocks"] == 27_551
    assert data["kv_cache_tokens"] == 440_816
    assert data["kv_bytes_per_token"] == 131_072
    assert data["weights_per_gpu_gib"] == 14.96
    assert data["deployment"]["gpu_memory_gib"] == 79.19


def test_70b_tp4_plan(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, "--model", "llama-3-70b", "--tensor-parallel", "4")
    assert data["num_gpu_blocks"] == 29_588
    assert data["kv_bytes_per_token"] == 81_920
    assert data["kv_bytes_per_token_all_gpus"] == 327_680
    assert data["weights_per_gpu_gib"] == pytest.approx(32.855)
    assert data["memory"]["overhead_gib"]["total"] == 2.297
    assert data["deployment"]["gpus"] == 4


def test_suggestions_follow_the_documented_arithmetic() -> None:
    capacity = plan_capacity(model_preset("llama-3-8b"), DeploymentSpec())
    traffic = TrafficProfile(source="given", mean_prompt=1000, mean_output=200, rate_rps=2.0)
    request = PlanRequest(capacity, GPU_PRESETS["h100-80gb"], traffic, "preset", "llama-3-8b")
    plan = build_plan(request)
    s = plan.suggestions
    assert s.footprint_tokens == 1200  # 75 whole blocks of 16
    assert s.budget_tokens == int(440_816 * 0.9)
    assert s.kv_concurrency == s.budget_tokens // 1200 == 330
    assert s.max_concurrency == 256 and s.capped_by_max_num_seqs
    rps = requests_per_second(s.timing, 256, 1000, 200)
    assert s.engine_rps == pytest.approx(rps)
    assert s.tokens_per_minute == int(60 * rps * 1200 // 1000) * 1000
    assert s.offered_tokens_per_minute == pytest.approx(60 * 2.0 * 1200)
    assert (s.low_watermark, s.high_watermark) == (0.92, 0.98)  # above the budget's target 0.9
    text = "\n".join(plan.arithmetic)
    assert "min(396,734 // 1,200 = 330, max_num_seqs 256) = 256" in text
    assert "floor(53.811 GiB / (16 x 131,072 B)) = 27,551" in text


def test_kv_limited_concurrency_when_the_engine_runs_more_sequences(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = plan_json(
        capsys, "--max-num-seqs", "1024", "--prompt-tokens-mean", "2000", "--output-tokens-mean", "500"
    )
    # 396,734 // 2,512 (157 blocks) = 157 concurrent requests: the KV budget, not max_num_seqs, binds.
    assert data["estimates"]["footprint_tokens"] == 2512
    assert data["max_concurrency"] == 157


def test_config_snippet_is_a_valid_sidecar_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = plan_json(
        capsys, "--model", "qwen2.5-7b", "--served-model-name", "qwen", "--max-model-len", "32768"
    )
    snippet = data["config"]
    config = parse_config(snippet)
    assert config.models["qwen"].context_window == 32768
    assert config.limits.models["qwen"].max_concurrency == data["max_concurrency"]
    assert config.limits.models["qwen"].tokens_per_minute == data["tokens_per_minute"]
    assert config.feedback.kv_budget.enabled and config.feedback.kv_budget.target_utilization == 0.9
    assert config.feedback.adaptive_pools["qwen"].high_watermark == 0.98
    assert snippet["feedback"] == {"service": SHIPPED_FEED} and "store" not in snippet
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(snippet))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out == "config ok\n" and out.err == ""  # the planner's snippet passes without a warning


def test_yaml_and_text_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, "--output", "yaml")
    assert code == 0
    data = yaml.safe_load(out)
    assert data["num_gpu_blocks"] == 27_551 and "config" in data and data["arithmetic"]
    code, out, _ = run_plan(
        capsys, "--model", "llama-3-70b", "--tensor-parallel", "4", "--pipeline-parallel", "2"
    )
    assert code == 0
    assert "num_gpu_blocks" in out and "min over stages" in out
    assert "stage 1 weights per GPU" in out
    assert "Sidecar config (ConfigMap config.yaml)" in out
    assert yaml.safe_load(out.split("Sidecar config (ConfigMap config.yaml)\n", 1)[1])["limits"]


def test_traffic_file_feeds_the_suggestions(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:00:{i:02d}.0000000,1000,200" for i in range(0, 50, 2)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows))
    data = plan_json(capsys, "--traffic", str(trace))
    assert data["traffic"]["requests"] == 25
    assert data["traffic"]["mean_prompt_tokens"] == 1000.0
    assert data["traffic"]["rate_rps"] == 0.5
    assert data["estimates"]["offered_tokens_per_minute"] == 60 * 0.5 * 1200


def test_rehearse_reports_both_runs(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--prompt-tokens-mean", "800", "--output-tokens-mean", "200", "--request-rate", "40")
    data = plan_json(capsys, *args, "--synthetic-requests", "300", "--rehearse", "--max-num-seqs", "64")
    rehearsal = data["rehearsal"]
    assert rehearsal["requests"] == 300
    for run in ("with_limits", "without_limits"):
        for key in ("preemptions", "goodput_output_tokens_per_s", "rejections", "ttft_p50_s", "ttft_p99_s"):
            assert key in rehearsal[run]
    assert rehearsal["without_limits"]["rejections"] == 0
    again = plan_json(capsys, *args, "--synthetic-requests", "300", "--rehearse", "--max-num-seqs", "64")
    assert again["rehearsal"] == rehearsal
    code, out, _ = run_plan(capsys, *args, "--synthetic-requests", "100", "--rehearse")
    assert code == 0 and "planned limits" in out and "TTFT p99 (s)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "gpt-5"), "unknown model preset 'gpt-5'"),
        (("--model-config", "/nonexistent/config.json"), "neither a file nor a preset"),
        (("--rehearse",), "--rehearse needs --traffic"),
        (("--gpu-memory-utilization", "1.2"), "--gpu-memory-utilization"),
        (("--target-utilization", "0"), "--target-utilization"),
        (("--prompt-tokens-mean", "10"), "go together"),
        (("--traffic", "/nonexistent.csv"), "cannot read"),
    ],
)
def test_bad_input_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("extproc plan: ") and message in err


def test_model_config_file_and_notes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from extproc.geometry.presets import MODEL_PRESETS

    folder = tmp_path / "Quantized-8B"
    folder.mkdir()
    config = {**MODEL_PRESETS["llama-3-8b"][1], "quantization_config": {"bits": 4}}
    (folder / "config.json").write_text(json.dumps(config))
    data = plan_json(capsys, "--model-config", str(folder / "config.json"))
    assert data["model"]["name"] == "Quantized-8B"
    assert any("--weights-gib" in note for note in data["notes"])
    small = plan_json(capsys, "--model-config", str(folder / "config.json"), "--weights-gib", "5.5")
    assert small["weights_per_gpu_gib"] == 5.5 and small["num_gpu_blocks"] > 27_551


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, "--list-presets")
    assert code == 0 and "llama-3-70b" in out and "mlc-ai/mlc-llm" in out and "h100-80gb" in out


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base` key by key, as an operator merges the snippet into the ConfigMap."""
    out = dict(base)
    for key, value in over.items():
        inner = out.get(key)
        out[key] = merged(inner, value) if isinstance(inner, dict) and isinstance(value, dict) else value
    return out


def check(capsys: pytest.CaptureFixture[str], tmp_path: Path, config: dict[str, Any], *args: str) -> str:
    """`check-config --strict` on a config: its stderr; fails on any problem or warning."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["check-config", str(path), "--strict", *args])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def test_the_snippet_names_what_the_shipped_installs_run() -> None:
    """Its feed and its store are the shipped ConfigMap's, so merging it there changes neither."""
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    assert shipped["feedback"]["service"] == SHIPPED_FEED
    assert shipped["store"]["redis"]["url"] == SHIPPED_STORE


def test_the_snippet_adds_no_direct_target_unasked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A direct target on the gateway pod's own 127.0.0.1, merged beside the shipped feedback.service, scraped
    nothing and passed check-config: the feed is the shipped one unless --metrics-url names an engine."""
    snippet = plan_json(capsys)["config"]
    assert snippet["feedback"] == {"service": SHIPPED_FEED}
    config = merged(yaml.safe_load(SHIPPED_CONFIG.read_text()), snippet)
    assert config["feedback"] == {"service": SHIPPED_FEED}
    check(capsys, tmp_path, config, "--replicas", "2")
    engine = "http://vllm.llm-serving.svc:8000/metrics"
    asked = plan_json(capsys, "--metrics-url", engine)
    assert asked["config"]["feedback"] == {
        "direct_targets": [{"url": engine, "kind": "vllm", "model": "llama-3-8b"}]
    }
    assert not any("--metrics-url" in note for note in asked["notes"])
    local = plan_json(capsys, "--metrics-url", "http://127.0.0.1:8000/metrics")["notes"]
    assert any(
        note.startswith("--metrics-url http://127.0.0.1:8000/metrics is the sidecar's own host")
        for note in local
    )


@pytest.mark.parametrize(("replicas", "share"), [(2, 0.5), (3, 0.3333), (8, 0.125)])
def test_replicas_share_the_limits_through_the_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, replicas: int, share: float
) -> None:
    """With N gateway replicas the limits stay the engine's, counted once for the fleet in the shared store,
    each replica falling back to 1 / N of them: check-config --replicas N passes the snippet, alone or merged
    into the shipped ConfigMap."""
    data = plan_json(capsys, "--replicas", str(replicas))
    alone = plan_json(capsys)
    assert data["max_concurrency"] == alone["max_concurrency"]  # fleet-wide, not divided
    assert data["config"]["store"] == {
        "backend": "redis",
        "redis": {"url": SHIPPED_STORE},
        "on_unavailable": "local",
        "fallback_share": share,
    }
    assert share * replicas <= 1
    check(capsys, tmp_path, data["config"], "--replicas", str(replicas))
    shipped = merged(yaml.safe_load(SHIPPED_CONFIG.read_text()), data["config"])
    check(capsys, tmp_path, shipped, "--replicas", str(replicas))
    assert any(
        note.startswith(f"the limits are fleet-wide: the {replicas} gateway replicas")
        for note in data["notes"]
    )
    code, out, _ = run_plan(capsys, "--replicas", str(replicas))
    assert code == 0 and f"fleet-wide: one set for all {replicas} gateway replicas" in out
    other = plan_json(capsys, "--replicas", str(replicas), "--store-url", "rediss://cache.example:6380/2")
    assert other["config"]["store"]["redis"] == {"url": "rediss://cache.example:6380/2"}


def test_one_replicas_snippet_is_refused_for_several(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    snippet = plan_json(capsys)["config"]
    assert "store" not in snippet
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(snippet))
    assert main(["check-config", str(path), "--replicas", "2"]) == 1
    assert "every limit would be multiplied by 2" in capsys.readouterr().err
    code, out, err = run_plan(capsys, "--replicas", "0")
    assert code == 2 and out == "" and "--replicas: must be >= 1" in err
