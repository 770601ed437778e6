"""Which KV budgets are one engine's (a picker named the engine, `FeedbackRuntime.endpoint_budget`), and when
one may go: the feed forgot its engine and no request holds it.

An engine's budget lives under the key `<pool>@<endpoint>` beside the pools' budgets. It is dropped, with its
series, once the feed's loop has forgotten the engine (not heard from for `forget_after`: a rollout gives pods
new addresses, and the budgets and labels must not pile up) and its last lease is released; never because a
reading is merely missing (a restarted feed has read nothing yet). A request resolved to a budget may still be
counting or waiting in a queue when the budget is dropped: the budget is kept, weakly, while such a request
holds it, and handed back if its engine returns, so what that request books is seen by the next ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

from extproc.core.kv.budget import KvBudget


def endpoint_key(pool: str, endpoint: str) -> str:
    """The key of one engine's KV budget: its series' `pool` label, and what the replicas sharing a store
    exchange its figures under."""
    return f"{pool}@{endpoint}"


class EngineBudgets:
    """The engines' budgets among a runtime's budgets (`budgets`, keyed as the runtime keys them)."""

    __slots__ = ("_budgets", "_engines", "_forgotten", "_retired")

    def __init__(self, budgets: dict[str, KvBudget]) -> None:
        self._budgets = budgets  # the runtime's, the pools' and the engines' alike
        self._engines: dict[str, tuple[str, str]] = {}  # an engine's budget key -> its (pool, endpoint)
        self._forgotten: set[str] = set()  # engines the feed forgot whose budgets still hold leases
        self._retired: weakref.WeakValueDictionary[str, KvBudget] = weakref.WeakValueDictionary()

    def engine_of(self, key: str) -> tuple[str, str] | None:
        """The (pool, endpoint) whose budget `key` names; None for a pool's."""
        return self._engines.get(key)

    def get(self, pool: str, endpoint: str) -> tuple[str, KvBudget | None]:
        """The engine's key and its budget, a dropped one still held by a request handed back; None: none."""
        key = endpoint_key(pool, endpoint)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._retired.pop(key, None)
            if budget is not None:
                self.add(pool, endpoint, budget)
        self._forgotten.discard(key)  # its engine is read again
        return key, budget

    def add(self, pool: str, endpoint: str, budget: KvBudget) -> None:
        key = endpoint_key(pool, endpoint)
        self._budgets[key] = budget
        self._engines[key] = (pool, endpoint)

    def forgotten(self, engines: Iterable[tuple[str, str]]) -> Iterator[str]:
        """The feed forgot `engines` (pool, endpoint): the keys of their budgets dropped now (no lease)."""
        for pool, endpoint in engines:
            key = endpoint_key(pool, endpoint)
            if key in self._engines:
                self._forgotten.add(key)
                if self.drop_if_idle(key):
                    yield key

    def drop_if_idle(self, key: str) -> bool:
        """Drop the budget of a forgotten engine that holds no lease; True if dropped."""
        budget = self._budgets.get(key)
        if key not in self._forgotten or budget is None or budget.leases:
            return False
        del self._budgets[key]
        del self._engines[key]
        self._forgotten.discard(key)
        self._retired[key] = budget
        return True

    def clear(self) -> list[str]:
        """Every engine's budget goes (budgets turned off): their keys."""
        keys = list(self._engines)
        for key in keys:
            self._budgets.pop(key, None)
        self._engines.clear()
        self._forgotten.clear()
        return keys
