from hypothesis import given
from hypothesis import strategies as st

from extproc.core.queue.waitqueue import Waiter, WaitQueue

PRIORITY = ["critical", "standard", "batch"]


def w(holder: str, tenant: str, at: float = 0.0, deadline: float = 10.0) -> Waiter:
    return Waiter(holder=holder, tenant=tenant, enqueued_at=at, deadline=deadline)


def drain(q: WaitQueue) -> list[Waiter]:
    """Admit one waiter at a time, always the first candidate, as the server does when one slot frees."""
    out = []
    while len(q):
        head = next(q.candidates())
        q.remove(head)
        out.append(head)
    return out


def test_highest_class_first_then_fifo() -> None:
    q = WaitQueue(PRIORITY, {"critical": 10, "standard": 10, "batch": 10})
    b1, s1, c1, c2 = w("batch", "t"), w("standard", "t"), w("critical", "t"), w("critical", "t")
    for x in (b1, s1, c1, c2):
        assert q.push(x)
    assert drain(q) == [c1, c2, s1, b1]


def test_tenants_take_turns_within_a_class() -> None:
    q = WaitQueue(PRIORITY, {"standard": 100})
    flood = [w("standard", "noisy") for _ in range(5)]
    quiet = [w("standard", "quiet") for _ in range(2)]
    for x in flood:
        q.push(x)
    for x in quiet:
        q.push(x)
    order = [x.tenant for x in drain(q)]
    assert order[:4] == ["noisy", "quiet", "noisy", "quiet"]


def test_bounds_per_class_and_classes_without_queue() -> None:
    q = WaitQueue(PRIORITY, {"critical": 1})
    assert q.push(w("critical", "a"))
    assert not q.push(w("critical", "b"))
    assert not q.push(w("batch", "a"))  # batch may not queue at all
    assert q.depth("critical") == 1


def test_removing_a_waiter_that_left() -> None:
    q = WaitQueue(PRIORITY, {"critical": 5})
    a, b = w("critical", "t"), w("critical", "t")
    q.push(a)
    q.push(b)
    assert q.remove(b)
    assert not q.remove(b)
    assert list(q.candidates()) == [a]


def test_newcomers_do_not_overtake_same_or_higher_class() -> None:
    q = WaitQueue(PRIORITY, {"standard": 5})
    q.push(w("standard", "t"))
    assert q.ahead_of("standard")
    assert q.ahead_of("batch")
    assert not q.ahead_of("critical")


def test_expired() -> None:
    q = WaitQueue(PRIORITY, {"critical": 5})
    a, b = w("critical", "t", deadline=1.0), w("critical", "t", deadline=5.0)
    q.push(a)
    q.push(b)
    assert q.expired(2.0) == [a]


@given(st.lists(st.tuples(st.sampled_from(PRIORITY), st.sampled_from(["a", "b", "c"])), max_size=40))
def test_drain_respects_class_order_and_per_tenant_fifo(items: list[tuple[str, str]]) -> None:
    q = WaitQueue(PRIORITY, dict.fromkeys(PRIORITY, 1000))
    waiters = [w(h, t) for h, t in items]
    for x in waiters:
        assert q.push(x)
    out = drain(q)
    assert sorted(map(id, out)) == sorted(map(id, waiters))
    ranks = [PRIORITY.index(x.holder) for x in out]
    assert ranks == sorted(ranks)
    for holder in PRIORITY:
        for tenant in "abc":
            mine = [x for x in out if x.holder == holder and x.tenant == tenant]
            assert mine == [x for x in waiters if x.holder == holder and x.tenant == tenant]


def due(tenant: str, at: float | None, holder: str = "standard") -> Waiter:
    return Waiter(holder=holder, tenant=tenant, enqueued_at=0.0, deadline=10.0, due=at)


def test_nearest_deadline_first_within_a_tenant_none_last_fifo_among_equals() -> None:
    q = WaitQueue(PRIORITY, {"standard": 10})
    plain1, late, plain2, early, early_too = (
        due("t", None),
        due("t", 9.0),
        due("t", None),
        due("t", 2.0),
        due("t", 2.0),
    )
    for x in (plain1, late, plain2, early, early_too):
        assert q.push(x)
    assert drain(q) == [early, early_too, late, plain1, plain2]


def test_a_deadline_never_moves_a_request_ahead_of_another_tenants_turn() -> None:
    q = WaitQueue(PRIORITY, {"standard": 10, "critical": 10})
    patient = due("a", None)
    urgent = [due("b", 0.5), due("b", 0.1)]
    higher = due("c", None, holder="critical")
    for x in (patient, *urgent, higher):
        q.push(x)
    # The higher class first; then tenant a's turn (it queued first), then b's, nearest deadline first.
    assert drain(q) == [higher, patient, urgent[1], urgent[0]]


def test_service_order_is_class_then_tenants_in_turn_then_each_line() -> None:
    q = WaitQueue(PRIORITY, {"critical": 10, "standard": 10, "batch": 10})
    plain, late, early = due("t", None), due("t", 3.0), due("t", 1.0)
    others = [due("other", 0.1), due("other", None), due("other", None)]
    higher, lower = due("c", None, holder="critical"), due("b", 0.0, holder="batch")
    for x in (plain, late, early, *others, higher, lower):
        q.push(x)
    assert q.service_order("standard") == [higher, early, others[0], late, others[1], plain, others[2]]
    assert q.service_order("critical") == [higher]
    # A newcomer, not queued, in its place: in its tenant's line by deadline, or a new tenant's last turn.
    newcomer = due("t", 2.0)
    newcomer.seq = 10**9
    assert q.service_order("standard", newcomer)[:5] == [higher, early, others[0], newcomer, others[1]]
    stranger = due("new", None)
    stranger.seq = 10**9
    assert q.service_order("standard", stranger)[:4] == [higher, early, others[0], stranger]
    assert q.service_order("batch")[-1] is lower
    assert len(q) == 8  # nothing was queued by asking
    assert WaitQueue(PRIORITY, {}).service_order("standard", newcomer) == [newcomer]
