"""Retry times for a burst (extproc/core/kv/schedule.py): each refused request is fitted after the releases
and around the promises already made, so a burst comes back in waves the cache can hold."""

from __future__ import annotations

import pytest

from extproc.core.kv.schedule import RetrySchedule


def burst_etas(schedule: RetrySchedule, refused: int, now: float = 0.0) -> list[float]:
    """Eight 100-token requests hold an 800-token budget until 10 s from now; `refused` more, each of 100
    tokens for 10 s, are refused one after the other."""
    releases = [(10.0, 100)] * 8
    return [schedule.eta(("client", i), now, 900, 800, releases, 10.0, 100) for i in range(refused)]


def test_a_burst_is_sent_back_in_waves_the_budget_holds() -> None:
    etas = burst_etas(RetrySchedule(), 32)
    assert etas == [10.0] * 8 + [20.0] * 8 + [30.0] * 8 + [40.0] * 8


def test_a_client_back_at_its_time_replaces_its_promise_and_an_admission_removes_one() -> None:
    schedule = RetrySchedule()
    burst_etas(schedule, 8)
    assert schedule.promises == 8
    # Client 0 is back at its time (10 s) and refused again (the leases ran late): its promise is replaced.
    assert schedule.eta(("client", 0), 10.0, 900, 800, [(1.0, 800)], 10.0, 100) == 1.0
    assert schedule.promises == 8
    schedule.kept(("client", 1))
    assert schedule.promises == 7


def test_clients_sending_the_same_body_each_get_a_place() -> None:
    schedule = RetrySchedule()
    releases = [(10.0, 100)] * 8
    etas = [schedule.eta("same body", 0.0, 900, 800, releases, 10.0, 100) for _ in range(16)]
    assert etas == [10.0] * 8 + [20.0] * 8


def test_promises_lapse_at_their_expected_end() -> None:
    schedule = RetrySchedule()
    burst_etas(schedule, 16)
    # 25 s later the leases and the first wave's promises are over: the second wave's (20-30 s) remain, and
    # a request refused then is sent after them.
    assert schedule.eta("late", 25.0, 100, 800, [], 10.0, 100) == pytest.approx(5.0)
    assert schedule.promises == 9
    # Beside the late one's promise (30-40 s) there is room for 600 more once the second wave ends.
    assert schedule.eta("big", 25.0, 700, 800, [], 10.0, 600) == pytest.approx(5.0)


def test_a_request_that_fits_nowhere_is_sent_to_the_last_release() -> None:
    schedule = RetrySchedule()
    assert schedule.eta("huge", 0.0, 2000, 800, [(3.0, 100), (7.0, 100)], 10.0, 1500) == 7.0


def test_memory_is_bounded() -> None:
    schedule = RetrySchedule(max_promises=4)
    burst_etas(schedule, 10)
    assert schedule.promises == 4


def test_a_tenant_that_received_less_is_planned_before_promises_of_one_that_received_more() -> None:
    schedule = RetrySchedule()
    releases = [(10.0, 100)] * 8
    for index in range(16):  # the flooding tenant (much service received) is promised two waves
        schedule.eta(("flood", index), 0.0, 900, 800, releases, 10.0, 100, priority=(0.0, 5000.0))
    # A request of a tenant that received little is fitted ahead of those promises, at the first release.
    assert schedule.eta("starved", 0.0, 900, 800, releases, 10.0, 100, priority=(0.0, 100.0)) == 10.0
    # One of a more important class too, whatever its tenant received.
    assert schedule.eta("critical", 0.0, 900, 800, releases, 10.0, 100, priority=(-1.0, 9e9)) == 10.0
    # Among equals, promises keep their order: one more of the flood waits for the third wave.
    assert schedule.eta(("flood", 99), 0.0, 900, 800, releases, 10.0, 100, priority=(0.0, 5000.0)) == 30.0


def test_a_tenants_service_is_read_now_not_as_it_stood_at_each_promise() -> None:
    """Service decays: a tenant's later refusal stands a little lower than its earlier promises were made
    at. Compared as recorded, each of a burst's refusals, milliseconds apart, passed every promise before
    it and was sent to the first release. Read now, a tenant's own earlier promises stay ahead of it, and
    another tenant's are ahead only while that tenant has received no more."""
    schedule = RetrySchedule()
    service = {"a": 1000.0}

    def standing(tenant: str) -> float:
        return service[tenant]

    def eta(owner: object, tenant: str, served: float, now: float = 0.0) -> float:
        releases = [(10.0 - now, 100)] * 8  # the same leases' ends, seen from `now`
        return schedule.eta(
            owner,
            now,
            900,
            800,
            releases,
            10.0,
            100,
            priority=(0.0, served),
            tenant=tenant,
            standing=standing,
        )

    # The flood's tenant, its service decaying between its refusals 2 ms apart.
    starts = [i * 0.002 + eta(("a", i), "a", 1000.0 - i, now=i * 0.002) for i in range(16)]
    assert starts == pytest.approx([10.0] * 8 + [20.0] * 8)
    # A tenant that has received more than the flood's is planned behind its promises ...
    service["b"] = 2000.0
    assert eta("b", "b", 2000.0) == 30.0
    # ... one that has received less goes ahead of them: its KV is taken at the first release.
    service["c"] = 0.0
    assert eta("c", "c", 0.0) == 10.0
