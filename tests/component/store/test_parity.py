"""The limiter's behaviour, proven the same for the in-process store and the Redis store.

The cases are written once in tests/support/limiter_cases.py; tests/unit/core/limiter/test_limiter.py and
test_shares.py run them on the in-process store on a fake clock, and this module runs each on one Redis and
on a Redis Cluster (`redis_h`), on real time.
"""

from __future__ import annotations

import pytest

from tests.support.limiter_cases import LIMITER_CASES, SHARE_CASES, Case, case_id
from tests.support.store_harness import Harness


@pytest.mark.parametrize("case", [*LIMITER_CASES, *SHARE_CASES], ids=case_id)
async def test_the_redis_store_behaves_as_the_limiter(case: Case, redis_h: Harness) -> None:
    await case(redis_h)
