"""Split input/output limits as derived keys: each key's part of a reservation, the spec tables the stores
get, and which keys a request names (the stores' behaviour: tests/support/limiter_cases.py, split cases)."""

from __future__ import annotations

import pickle

import pytest

from extproc.core.limiter.limiter import LimitSpec
from extproc.core.limiter.split import SplitIndex, base_key, expand, key_tokens


def test_each_key_holds_its_part() -> None:
    assert key_tokens("model:m", 500, 200) == 500
    assert key_tokens("input:model:m", 500, 200) == 300
    assert key_tokens("output:model:m", 500, 200) == 200
    assert key_tokens("input:tenant:t", 10, 0) == 10 and key_tokens("output:tenant:t", 10, 0) == 0
    assert base_key("output:tenant:t") == "tenant:t" and base_key("global") == "global"


def test_expand_adds_the_derived_keys_and_keeps_a_configured_key_off_its_prefix_default() -> None:
    specs = {
        "global": LimitSpec(tokens_per_minute=100),
        "model:m": LimitSpec(input_tokens_per_minute=60),
        "tenant:plain": LimitSpec(max_concurrency=2),
    }
    defaults = {"tenant:": LimitSpec(output_tokens_per_minute=30), "model:": LimitSpec(max_concurrency=4)}
    out, out_defaults = expand(specs, defaults)
    assert out["input:model:m"] == LimitSpec(tokens_per_minute=60)
    assert out["output:model:m"] == LimitSpec()  # no output limit: unlimited
    assert out["input:tenant:plain"] == out["output:tenant:plain"] == LimitSpec()
    assert "input:global" not in out and "input:model:" not in out_defaults
    assert out_defaults["output:tenant:"] == LimitSpec(tokens_per_minute=30)
    assert out_defaults["input:tenant:"] == LimitSpec()
    assert expand({"global": LimitSpec(tokens_per_minute=1)}, {}) == (
        {"global": LimitSpec(tokens_per_minute=1)},
        {},
    )


def test_a_request_names_derived_keys_only_where_split_limits_apply() -> None:
    specs = {"model:m": LimitSpec(output_tokens_per_minute=60), "tenant:plain": LimitSpec(max_concurrency=2)}
    index = SplitIndex.of(specs, {"tenant:": LimitSpec(input_tokens_per_minute=30)})
    keys = index.keys_for(["global", "model:m", "tenant:plain"])
    assert keys == ["global", "model:m", "tenant:plain", "input:model:m", "output:model:m"]
    assert index.keys_for(["global", "model:x", "tenant:new"])[3:] == [
        "input:tenant:new",
        "output:tenant:new",
    ]
    assert SplitIndex().keys_for(["global"]) == ["global"]
    assert pickle.loads(pickle.dumps(index)) == index  # it crosses the reload child's pipe


@pytest.mark.parametrize("field", ["input_tokens_per_minute", "output_tokens_per_minute"])
def test_a_split_limit_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LimitSpec(**{field: 0})  # type: ignore[arg-type]
