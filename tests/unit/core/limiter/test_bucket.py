import math

import pytest

from extproc.core.limiter.bucket import TokenBucket


def test_starts_full_and_refills_at_tpm_over_60() -> None:
    b = TokenBucket.full(600, now=0.0)
    assert b.wait_for(600, 0.0) == 0
    b.take(600, 0.0)
    assert b.remaining(0.0) == 0
    # 600 TPM refills 10 tokens per second.
    assert b.remaining(1.0) == 10
    assert b.remaining(60.0) == 600
    assert b.remaining(120.0) == 600  # never above capacity


def test_wait_is_exact_time_to_refill_the_missing_tokens() -> None:
    b = TokenBucket.full(600, now=0.0)
    b.take(550, 0.0)
    assert b.wait_for(100, 0.0) == pytest.approx(5.0)
    assert b.wait_for(100, 5.0) == 0.0


def test_more_than_capacity_can_never_fit() -> None:
    b = TokenBucket.full(600, now=0.0)
    assert math.isinf(b.wait_for(601, 0.0))


def test_refund_is_capped_at_capacity() -> None:
    b = TokenBucket.full(600, now=0.0)
    b.take(100, 0.0)
    b.refill(30.0)  # full again
    refunded = b.settle(reserved=100, actual=10, now=30.0)
    assert refunded == 0
    assert b.remaining(30.0) == 600


def test_partial_refund() -> None:
    b = TokenBucket.full(600, now=0.0)
    b.take(500, 0.0)
    assert b.settle(reserved=500, actual=200, now=0.0) == 300
    assert b.remaining(0.0) == 400


def test_overrun_is_charged_as_debt_and_delays_later_requests() -> None:
    b = TokenBucket.full(600, now=0.0)
    b.take(600, 0.0)
    assert b.settle(reserved=600, actual=900, now=0.0) == -300
    assert b.tokens == -300
    assert b.remaining(0.0) == 0
    # Debt of 300 plus 60 wanted, at 10 tokens per second.
    assert b.wait_for(60, 0.0) == pytest.approx(36.0)


def test_resize_drops_excess_and_keeps_debt() -> None:
    b = TokenBucket.full(600, now=0.0)
    b.resize(300, 0.0)
    assert b.remaining(0.0) == 300
    b.take(400, 0.0)
    b.resize(600, 0.0)
    assert b.tokens == -100


def test_clock_going_back_credits_nothing() -> None:
    b = TokenBucket.full(600, now=10.0)
    b.take(600, 10.0)
    b.refill(5.0)
    assert b.tokens == 0


def test_invalid_capacity() -> None:
    with pytest.raises(ValueError):
        TokenBucket.full(0, now=0.0)
