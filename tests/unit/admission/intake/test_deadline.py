"""A client's first-token deadline from its headers: this gateway's strictly, llm-d's as llm-d reads it."""

from __future__ import annotations

import pytest

from extproc.admission.intake.deadline import MAX_DEADLINE_MS, deadline_ms
from extproc.admission.vocabulary.errors import AdmissionError

OWN = "x-extproc-ttft-deadline-ms"
LLMD = "x-llm-d-slo-ttft-ms"


def test_no_header_no_deadline() -> None:
    assert deadline_ms({}) is None


@pytest.mark.parametrize(
    ("raw", "ms"), [("0", 0), ("250", 250), (" 1500 ", 1500), (str(MAX_DEADLINE_MS), MAX_DEADLINE_MS)]
)
def test_own_header_in_milliseconds(raw: str, ms: int) -> None:
    assert deadline_ms({OWN: raw}) == ms


@pytest.mark.parametrize(
    "raw", ["", "-1", "1.5", "1e3", "+5", "1_000", "soon", "٣٠٠", str(MAX_DEADLINE_MS + 1), "9" * 40]
)
def test_own_header_refuses_a_bad_value_naming_the_header(raw: str) -> None:
    with pytest.raises(AdmissionError) as caught:
        deadline_ms({OWN: raw})
    error = caught.value
    assert error.status == 400
    assert error.param == OWN and error.code == "invalid_value"
    assert OWN in error.message
    assert len(error.message) < 300  # a long value is cut, never echoed whole


@pytest.mark.parametrize(("raw", "ms"), [("300", 300), (" 300 ", 300), ("+300", 300), ("0", 0)])
def test_llmd_header_parsed_as_llmd_parses_it(raw: str, ms: int) -> None:
    assert deadline_ms({LLMD: raw}) == ms


@pytest.mark.parametrize("raw", ["", "-5", "1.5", "abc", "9223372036855"])
def test_llmd_header_invalid_is_ignored_as_llmd_ignores_it(raw: str) -> None:
    assert deadline_ms({LLMD: raw}) is None


def test_llmd_header_past_a_day_bounds_nothing_more_than_a_day() -> None:
    assert deadline_ms({LLMD: "9223372036854"}) == MAX_DEADLINE_MS


def test_the_nearer_of_both_holds() -> None:
    assert deadline_ms({OWN: "900", LLMD: "400"}) == 400
    assert deadline_ms({OWN: "300", LLMD: "400"}) == 300
    assert deadline_ms({OWN: "300", LLMD: "junk"}) == 300


def test_a_bad_own_header_is_refused_even_beside_a_valid_llmd_one() -> None:
    with pytest.raises(AdmissionError):
        deadline_ms({OWN: "x", LLMD: "400"})
