"""Every engine page in tests/data/metrics, rendered from the engine's own metric definitions (each file's
header cites the source file and version), parsed into the signals the feed must publish.

The expected numbers are worked out from each fixture's layout, not read back from the parser: data-parallel
capacity counted once per engine, tensor ranks not double counted, priority breakdowns not added to totals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.kvfeed.engines import PROFILES, InfoLabels, ServerKind
from extproc.kvfeed.parse import MetricsParseError, ModelNameMissing, parse_metrics, parse_series
from tests.support.metric_pages import DATA, page

DOCS = Path(__file__).resolve().parents[3] / "docs" / "feedback.md"

# Pages that are not an engine version but bad input (see test_parse.py).
MALFORMED = {"garbage_html.txt", "truncated.txt", "trtllm_json_iteration_stats.txt"}


@dataclass(frozen=True)
class Expect:
    kv_usage: float | None
    waiting: float | None
    running: float | None
    preemptions: float | None
    capacity: int | None


@dataclass(frozen=True)
class Case:
    fixture: str
    kind: ServerKind
    model: str  # the pool the samples belong to
    expect: Expect
    override: str | None = None  # the target's `model`


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"

CASES = [
    # Two DP engines: kv_cache_size_tokens (237,792) is per engine, so capacity is 2 x 237,792, not
    # 2 x 16 x 29,724 (num_gpu_blocks is already the sum over engines). Waiting 3 + 1 (by_reason ignored).
    Case("vllm_0.33.0_dp2.txt", ServerKind.VLLM, LLAMA, Expect(0.81, 4, 12, 16, 2 * 237_792)),
    # Hybrid model: the group-aware kv_cache_size_tokens, not 528 x 2184.
    Case(
        "vllm_0.33.0_hybrid.txt",
        ServerKind.VLLM,
        "ibm-granite/granite-4.0-h-small",
        Expect(0.3125, 0, 3, 0, 1_048_576),
    ),
    # No kv_cache_size_tokens yet: block_size x the page-wide num_gpu_blocks, once (not once per engine).
    Case("vllm_0.11.0_dp2.txt", ServerKind.VLLM, LLAMA, Expect(0.72, 2, 10, 11, 16 * 11_382)),
    Case("vllm_0.11.0_hidden_metrics.txt", ServerKind.VLLM, LLAMA, Expect(0.55, 2, 6, 9, 16 * 5691)),
    Case("vllm_0.8.5_v1.txt", ServerKind.VLLM, QWEN, Expect(0.4375, 2, 4, 3, 16 * 8000)),
    Case("vllm_0.8.5_v0.txt", ServerKind.VLLM, QWEN, Expect(0.4375, 2, 4, 3, 16 * 8000)),
    # DP 2 x TP 2: max_total_num_tokens per DP rank, summed; cache_config_info (the same pool again) is not
    # added; the retraction counter of TP rank 1 repeats rank 0's.
    Case("sglang_0.5.10_dp2_tp2.txt", ServerKind.SGLANG, QWEN, Expect(0.73, 5, 10, 7, 2 * 452_340)),
    # TP 2 with every scheduler publishing and priority breakdowns: the priority="" totals, once.
    Case("sglang_0.5.23_tp2_priority.txt", ServerKind.SGLANG, QWEN, Expect(0.45, 4, 9, 11, 880_000)),
    Case(
        "tgi_3.3.7.txt",
        ServerKind.TGI,
        "mistral-7b",
        Expect(98_304 / 131_072, 4, 16, None, 131_072),
        override="mistral-7b",
    ),
    Case("trtllm_serve_main_2026.txt", ServerKind.TRTLLM, "Qwen3-8B", Expect(0.71, 1, 22, None, 4096 * 32)),
    # waiting is active (14) minus scheduled (9); running is scheduled.
    Case(
        "triton_trtllm_0.19.0.txt",
        ServerKind.TRITON,
        "llama-3-8b",
        Expect(0.5, 5, 9, None, 6000 * 64),
        override="llama-3-8b",
    ),
]


def engine_fixtures() -> list[str]:
    return sorted(p.name for p in DATA.glob("*.txt") if p.name not in MALFORMED)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.fixture)
@pytest.mark.parametrize("explicit_kind", [True, False], ids=["kind", "auto"])
def test_fixture_signals(case: Case, explicit_kind: bool) -> None:
    out = parse_metrics(page(case.fixture), case.kind if explicit_kind else None, model=case.override)
    assert list(out) == [case.model]
    s = out[case.model]
    e = case.expect
    assert s.kind is case.kind
    assert s.kv_usage == (pytest.approx(e.kv_usage) if e.kv_usage is not None else None)
    assert (s.requests_waiting, s.requests_running, s.preemptions_total) == (
        e.waiting,
        e.running,
        e.preemptions,
    )
    assert s.kv_capacity_tokens == e.capacity


def test_vllms_prefilled_prompt_tokens_are_summed_over_its_engines() -> None:
    """`vllm:prompt_tokens_total`, one series per engine of a data-parallel server: the KV budget's evidence
    that a lease's prompt was prefilled (docs/feedback.md, "How each guess errs")."""
    signals = parse_metrics(page("vllm_0.33.0_dp2.txt"), ServerKind.VLLM)[LLAMA]
    assert signals.prompt_tokens_total == pytest.approx(1_234_567 + 1_100_230)


def test_every_engine_fixture_has_a_case_and_every_engine_a_fixture() -> None:
    assert sorted(c.fixture for c in CASES) == sorted(
        set(engine_fixtures()) - {"trtllm_serve_e7f7345_undefined.txt"}
    )
    assert {c.kind for c in CASES} == set(ServerKind)


@pytest.mark.parametrize("name", engine_fixtures())
def test_fixture_cites_its_source_and_is_valid_prometheus_text(name: str) -> None:
    text = page(name)
    assert text.startswith("# source: "), f"{name}: first line must cite the source file and version"
    families = list(text_string_to_metric_families(text))  # the reference parser accepts it
    assert families
    parse_series(text)  # and so does ours (it raises on anything it rejects), comments included


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.fixture)
def test_every_label_on_a_read_series_has_a_role(case: Case) -> None:
    """A label the profile does not know (a new rank or replica label) must be classified, not ignored."""
    profile = PROFILES[case.kind]
    info = {s.name for s in profile.capacity if isinstance(s, InfoLabels)}
    for s in parse_series(page(case.fixture), profile.names):
        if s.name in info:
            continue
        unknown = set(s.labels) - profile.known_labels
        assert not unknown, f"{case.fixture}: {s.name} has labels without a role: {sorted(unknown)}"


def test_trtllm_undefined_model_name_is_never_a_pool() -> None:
    """Older trtllm-serve labels everything model_name="undefined" and publishes no KV or queue gauges."""
    text = page("trtllm_serve_e7f7345_undefined.txt")
    with pytest.raises(MetricsParseError, match="no trtllm metrics on the page"):
        parse_metrics(text, ServerKind.TRTLLM)
    with pytest.raises(MetricsParseError):
        parse_metrics(text)  # no known prefix: not even detectable


def test_trtllm_placeholder_label_needs_a_model_from_elsewhere() -> None:
    text = page("trtllm_serve_main_2026.txt").replace('model_name="Qwen3-8B"', 'model_name="undefined"')
    with pytest.raises(ModelNameMissing) as info:
        parse_metrics(text)
    assert info.value.profile.model_api_path == "/v1/models"
    out = parse_metrics(text, model="Qwen3-8B")
    assert list(out) == ["Qwen3-8B"]
    assert out["Qwen3-8B"].kv_capacity_tokens == 4096 * 32


def test_tgi_page_names_no_model() -> None:
    with pytest.raises(ModelNameMissing, match="set model on the target"):
        parse_metrics(page("tgi_3.3.7.txt"))


def test_triton_model_label_is_the_repository_name_without_override() -> None:
    assert list(parse_metrics(page("triton_trtllm_0.19.0.txt"))) == ["tensorrt_llm"]


def test_docs_name_every_metric_and_fixture() -> None:
    docs = DOCS.read_text()
    names = set(re.findall(r"`([a-zA-Z_:][a-zA-Z0-9_:]*)", docs))
    for profile in PROFILES.values():
        missing = profile.names - names
        assert not missing, f"docs/feedback.md misses {profile.kind.value} metrics {sorted(missing)}"
    for fixture in engine_fixtures():
        assert fixture in docs, f"docs/feedback.md does not mention the fixture {fixture}"
