"""The limiter stores: in-process (the default) and Redis, shared by replicas, behind the core's port.

Modules, by their path from this folder: `local.py` (in-process `LimiterStore`, the default), `redis/` (shared
by replicas: `store.py` (`RedisStore`) composes `connection.py` (one Redis or a Cluster, TLS, ACL user),
`scripts.py` (one Lua script per operation), `calls.py` (every Redis call: the scripts, the bound on calls in
flight, retries), `breaker.py` (the circuit breaker), `keyspace.py` (each key's limits, scale and state as the
scripts take and return them), `views.py` (the keys as last read, for `snapshot()`), `leases.py` (acquire,
adoption, release, renewal: leases expire unless renewed), `forget.py` (what a call whose answer was lost
placed, taken back), `refunds.py` (part of an open lease's reservation given back
early), `scales.py` (one adaptive scale per key for every replica), `wake.py` (a release on one replica wakes
the queues of the others), `mailbox.py` (messages between the replicas, the port's `Mailbox`: the end reports
relayed by pub/sub), `kvboard.py` (the pools' KV-budget figures of every replica, the port's `KvBoard`),
`guard.py` (a Redis that lost its state or may evict) and `build.py` (`RedisStore` from its settings)),
`fallback.py` (local limits cut to a share while Redis is away, and what they admitted adopted into it
after), `backends.py` (every backend registered in one place by its `store.backend` name: the parser of its
own section of `store` and its builder), `factory.py`
(builds the store the registered backend names from `settings.py`'s `StoreSettings` (what every backend
shares, and the backend's own settings, `RedisSettings` for Redis), which the config package fills).
"""
