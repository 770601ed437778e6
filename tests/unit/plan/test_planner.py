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
from extproc.plan.planner import PlanRequest, TrafficProfile, build_plan
from extproc.plan.timing import requests_per_second


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
